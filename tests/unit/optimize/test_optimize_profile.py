"""Units of kiln.optimize.profile: interleaved rounds and the per-round statistics.

A fake clock that only moves when a fake runner runs makes every duration exact, so these
tests assert what the profiler computes, never how long anything took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.optimize.profile import Timed, profile_all, round_order, summarize, time_window


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """Costs ``cost`` seconds per call, plus ``burst`` while ``busy`` says the machine is loaded;
    logs its name per call so the tests can see the order of the windows."""

    def __init__(self, name: str, cost: float, clock: FakeClock, log: list[str],
                 busy: Any = None, burst: float = 0.0) -> None:  # fmt: skip
        self.name, self.cost, self.clock, self.log = name, cost, clock, log
        self.busy, self.burst = busy, burst
        self.closed = False

    def run(self, _outputs: Any, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        extra = self.burst if self.busy is not None and self.busy(self.clock.now) else 0.0
        self.clock.now += self.cost * len(feed["x"]) + extra
        self.log.append(self.name)
        return [feed["x"]]

    def close(self) -> None:
        self.closed = True


DATA = {"x": np.zeros((4, 2), np.float32)}


def _timed(runners: list[FakeRunner], tmp_path: Path) -> list[Timed]:
    out = []
    for r in runners:
        path = tmp_path / f"{r.name}.onnx"
        path.write_bytes(b"x" * 1024)
        out.append(Timed(lambda r=r: r, path))  # type: ignore[misc]
    return out


def test_summarize_takes_the_quietest_rounds_median_and_pools_p99() -> None:
    quiet = [0.001] * 9 + [0.002]
    loaded = [0.003] * 10
    bp = summarize(2, [loaded, quiet, loaded])
    assert bp.p50_ms == pytest.approx(1.0)
    assert bp.round_p50_ms == pytest.approx([3.0, 1.0, 3.0])
    assert bp.iterations == 30
    assert bp.p99_ms == pytest.approx(3.0)  # the loaded rounds' tail is not hidden
    assert bp.throughput == pytest.approx(2 * 10 / (0.009 + 0.002))


def test_summarize_against_a_reference_scales_by_the_median_round_ratio() -> None:
    reference = [[0.002] * 4, [0.001] * 4, [0.002] * 4]  # the machine: slow, fast, slow
    runner = [[0.001] * 4, [0.0005] * 4, [0.004] * 4]  # half the reference, but one outlier
    bp = summarize(1, runner, reference)
    # Ratios 0.5, 0.5, 2.0 -> 0.5; the reference's quietest round is 1 ms.
    assert bp.p50_ms == pytest.approx(0.5)
    assert bp.throughput == pytest.approx(1000.0 * 2.0)
    assert bp.round_p50_ms == pytest.approx([1.0, 0.5, 4.0])  # raw, unscaled
    assert bp.p99_ms == pytest.approx(4.0)
    with pytest.raises(ValueError, match="one window per round"):
        summarize(1, runner, reference[:2])


def test_round_order_rotates_so_each_runner_leads_once() -> None:
    orders = [round_order(3, r) for r in range(3)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1]]
    assert {o[0] for o in orders} == {0, 1, 2}
    assert round_order(0, 4) == []


def test_time_window_runs_at_least_the_minimum_and_stops_at_the_deadline() -> None:
    clock, log = FakeClock(), []
    runner = FakeRunner("a", 2**-6, clock, log)  # binary fractions: exact sums, exact counts
    times = time_window(runner.run, {"x": np.zeros((1, 2))}, seconds=2**-3, clock=clock)
    assert times == [2**-6] * 8
    assert len(log) == 8 + 3  # plus the untimed warm-up
    slow = time_window(FakeRunner("b", 1.0, clock, []).run, {"x": np.zeros((1, 2))}, 0.1, clock)
    assert len(slow) == 5  # a window shorter than one call still gets its minimum


def test_profile_all_interleaves_windows_and_closes_runners(tmp_path: Path) -> None:
    clock, log = FakeClock(), []
    runners = [FakeRunner(n, 0.001, clock, log) for n in ("base", "a", "b")]
    rounds: list[int] = []
    profiles = profile_all(_timed(runners, tmp_path), DATA, [1, 4], seconds=0.03, rounds=3,
                           on_round=rounds.append, clock=clock)  # fmt: skip
    assert rounds == [0, 1, 2]
    # Collapse consecutive calls into windows: each runner has one window per batch size per
    # round, and the rounds run in the rotated order.
    blocks = [n for i, n in enumerate(log) if i == 0 or log[i - 1] != n]
    assert blocks == ["base", "a", "b", "a", "b", "base", "b", "base", "a"]
    assert all(r.closed for r in runners)
    for p in profiles:
        assert [b.batch_size for b in p.batches] == [1, 4]
        assert [len(b.round_p50_ms) for b in p.batches] == [3, 3]
        assert p.batches[0].p50_ms == pytest.approx(1.0)
        assert p.batches[1].p50_ms == pytest.approx(4.0)
        assert p.file_size_mb == pytest.approx(1 / 1024)
        assert p.gpu_mb is None


def test_a_burst_of_load_does_not_decide_the_comparison(tmp_path: Path) -> None:
    """The same cost for both, and load during the first 0.05 s of the run: the baseline,
    timed first, would look 3x slower from its one window; its later quiet rounds say 1x."""
    clock, log = FakeClock(), []

    def busy(now: float) -> bool:
        return now < 0.05

    base = FakeRunner("base", 0.001, clock, log, busy, burst=0.002)
    same = FakeRunner("same", 0.001, clock, log, busy, burst=0.002)
    profiles = profile_all(_timed([base, same], tmp_path), DATA, [1], seconds=0.2, rounds=4,
                           clock=clock)  # fmt: skip
    b, s = profiles[0].batches[0], profiles[1].batches[0]
    assert b.round_p50_ms[0] == pytest.approx(3.0)  # what a single first window reported
    assert b.p50_ms == pytest.approx(s.p50_ms) == pytest.approx(1.0)
    assert b.p99_ms == pytest.approx(3.0)


def test_profile_all_closes_runners_when_one_fails(tmp_path: Path) -> None:
    clock, log = FakeClock(), []
    good = FakeRunner("good", 0.001, clock, log)
    timed = _timed([good], tmp_path)

    def broken() -> Any:
        raise RuntimeError("cannot load")

    timed.append(Timed(broken, timed[0].path))
    with pytest.raises(RuntimeError, match="cannot load"):
        profile_all(timed, DATA, [1], seconds=0.01, rounds=2, clock=clock)
    assert good.closed


def test_a_fast_moment_caught_by_one_runner_does_not_decide(tmp_path: Path) -> None:
    """The machine is slow (2 ms a call) but for the moment one runner's round-1 window ran (1 ms).
    The lowest window would call that runner 2x faster than the same-cost baseline; paired
    round for round with the baseline, it is not."""
    clock, log = FakeClock(), []
    state = {"round": 0}
    base = FakeRunner("base", 0.001, clock, log, lambda _now: True, burst=0.001)
    same = FakeRunner("same", 0.001, clock, log, lambda _now: state["round"] != 1, burst=0.001)
    profiles = profile_all(_timed([base, same], tmp_path), DATA, [1], seconds=0.2, rounds=4,
                           on_round=lambda r: state.update(round=r), clock=clock)  # fmt: skip
    b, s = profiles[0].batches[0], profiles[1].batches[0]
    assert min(s.round_p50_ms) == pytest.approx(1.0)  # what the lowest window would report
    assert b.p50_ms == pytest.approx(2.0)
    assert s.p50_ms == pytest.approx(2.0)
    assert s.throughput == pytest.approx(b.throughput)
