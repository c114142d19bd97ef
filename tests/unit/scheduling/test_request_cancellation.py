"""``Job.cancel``: how a backend hears that a request's client went away."""

from __future__ import annotations

import numpy as np

from kiln.core.stats import RequestTimes
from kiln.scheduling.base import Job


def _job() -> Job:
    return Job({"X": np.zeros((1, 2), np.float32)}, ["Y"], 1, RequestTimes())


def test_cancel_calls_each_callback_once_and_late_ones_at_once() -> None:
    job = _job()
    calls: list[str] = []
    job.add_cancel_callback(lambda: calls.append("early"))
    assert not job.cancelled and calls == []
    job.cancel()
    job.cancel()  # a second cancel changes nothing
    job.add_cancel_callback(lambda: calls.append("late"))
    assert job.cancelled and calls == ["early", "late"]


def test_a_failing_callback_does_not_stop_the_others() -> None:
    job = _job()
    calls: list[int] = []

    def broken() -> None:
        raise RuntimeError("boom")

    job.add_cancel_callback(broken)
    job.add_cancel_callback(lambda: calls.append(1))
    job.cancel()
    assert calls == [1]
