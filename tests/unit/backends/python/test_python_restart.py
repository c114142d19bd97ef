"""Restarting a Python worker when two threads find it dead at once, or one finds it late.

The loop's reader and the instance's thread both read a worker's pipe. When the worker
dies, each may report it; only one restart may follow, and a report about a worker that
was replaced already must leave its successor alone (killing it again could catch it in
its ``initialize``, which then read a batch's answer as its own).
"""

from __future__ import annotations

import logging
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.backends.base import ResponseSink
from kiln.backends.python.backend import PythonBackend
from kiln.backends.python.process import WorkerDied
from kiln.config.loader import parse_config_text
from tests.unit.backends.python.test_python_loopcall import CONFIG, MODEL, SPEC


class _Request:
    """What a scheduler hands a backend (``BackendRequest``), outside any sequence."""

    correlation_id = 0
    flags = 0
    request_id = ""
    deadline_ns = 0

    def __init__(self, value: float) -> None:
        self.inputs = {"IN": np.full((1, 2), value, np.float32)}
        self.output_names = ["OUT"]
        self.parameters: dict[str, Any] = {}
        self.response_parameters: dict[str, Any] | None = None
        self.sink: ResponseSink | None = None


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[PythonBackend]:
    version = tmp_path / "double" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(MODEL))
    b = PythonBackend(parse_config_text(CONFIG), version, SPEC)
    yield b
    b.close()


def _doubles(backend: PythonBackend, value: float) -> None:
    (out,) = backend.execute_requests([_Request(value)])
    assert isinstance(out, dict), out
    assert out["OUT"].tolist() == [[2 * value, 2 * value]]


def test_two_threads_that_find_the_worker_dead_restart_it_once(
    backend: PythonBackend, caplog: pytest.LogCaptureFixture
) -> None:
    assert backend.worker.proc is not None and backend.worker.conn is not None
    dead = backend.worker.conn
    backend.worker.proc.kill()
    backend.worker.proc.wait()
    gate = threading.Barrier(8)

    def report() -> None:
        gate.wait()
        backend.session.begin_restart("the Python worker stopped (test)", dead)

    with caplog.at_level(logging.WARNING, logger="kiln.backends.python.worker_session"):
        threads = [threading.Thread(target=report) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        restarting = backend.session.restart_thread
        assert restarting is not None
        restarting.join(60)
    restarts = [r for r in caplog.records if "restarted" in r.getMessage()]
    failures = [r for r in caplog.records if "restart failed" in r.getMessage()]
    assert len(restarts) == 1 and not failures, caplog.text
    _doubles(backend, 3.0)  # the first batch after it waits for it, then runs


def test_a_late_report_of_a_replaced_worker_leaves_the_new_one_alone(
    backend: PythonBackend,
) -> None:
    assert backend.worker.proc is not None
    old = backend.worker.conn
    backend.worker.proc.kill()
    backend.worker.proc.wait()
    backend.session.begin_restart("the Python worker stopped (test)", old)
    restarting = backend.session.restart_thread
    assert restarting is not None
    restarting.join(60)
    _doubles(backend, 2.0)
    pid = backend.worker.pid
    assert backend.session.restart_thread is None
    backend.session.begin_restart("the Python worker stopped (the old one, reported late)", old)
    assert backend.session.restart_thread is None and backend.worker.pid == pid
    _doubles(backend, 4.0)


def test_nothing_meant_for_a_replaced_worker_reaches_the_new_one(
    backend: PythonBackend,
) -> None:
    old = backend.worker.conn
    assert old is not None
    backend.worker.kill()
    backend.worker.start()
    with pytest.raises(WorkerDied, match="restarted"):
        backend.worker.send(("execute", [], 0, False), old)
    # The new worker's first message is still the answer to its initialize.
    backend.worker.send(("initialize", backend.session.args, False), backend.worker.conn)
    assert backend.worker.recv(None, backend.worker.conn)[0] == "ready"
    # Reading the old pipe, closed by the restart, is the old worker's death.
    with pytest.raises(WorkerDied):
        backend.worker.recv(1.0, old)
    _doubles(backend, 5.0)


def test_a_restart_outlives_a_batch_that_stopped_waiting_for_it(
    backend: PythonBackend,
) -> None:
    """Every request of a batch expired while it waited: the batch returns, and the
    restart's marker stays until the restart is over (the loop sends nothing meanwhile)."""
    release = threading.Event()
    backend.session.restart_thread = threading.Thread(target=release.wait, daemon=True)
    backend.session.restart_thread.start()
    try:
        request = _Request(1.0)
        request.deadline_ns = 1  # long past
        (out,) = backend.execute_requests([request])
        assert not isinstance(out, dict)
        marker = backend.session.restart_thread
        assert marker is not None and marker.is_alive()
    finally:
        release.set()
        backend.session.restart_thread.join()
    _doubles(backend, 6.0)
    assert backend.session.restart_thread is None
