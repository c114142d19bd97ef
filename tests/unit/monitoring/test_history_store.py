"""The SQLite history: sampling rows, queries (rates, ratios, quantiles), bounds, failures."""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

import pytest

from kiln.monitoring.history import HistoryOptions, HistoryRecorder
from kiln.monitoring.history_query import HistoryQuery, HistoryQueryError, run_query
from kiln.monitoring.snapshot import Labels, Snapshot

MLP: Labels = (("model", "mlp"), ("version", "1"))
T0 = 1_700_000_000.0


def _buckets(counts: tuple[float, float, float]) -> dict[Labels, float]:
    return {(("le", le), *MLP): c for le, c in zip(("0.01", "0.1", "+Inf"), counts, strict=True)}


def _snapshot(
    i: int, success: float, queue_us: float, buckets: tuple[float, float, float]
) -> Snapshot:
    return Snapshot(
        T0 + i,
        {
            "nv_inference_request_success": {MLP: success},
            "nv_inference_count": {MLP: 2 * success},
            "nv_inference_exec_count": {MLP: success / 2},
            "nv_inference_queue_duration_us": {MLP: queue_us},
            "nv_inference_pending_request_count": {MLP: float(i)},
            "process_resident_memory_bytes": {(): 1000.0 + i},
            "kiln_request_duration_seconds_bucket": _buckets(buckets),
            "nv_cache_num_hits_per_model": {MLP: 1.0},  # not a stored metric
        },
    )


class Feed:
    def __init__(self, snaps: list[Snapshot]) -> None:
        self.snaps = iter(snaps)

    def __call__(self) -> Snapshot:
        return next(self.snaps)


def _sampler(tmp_path: Path, snaps: list[Snapshot], **kw: float) -> HistoryRecorder:
    options = HistoryOptions(tmp_path / "h.db", 1.0, **kw)  # type: ignore[arg-type]
    sampler = HistoryRecorder(options, Feed(snaps))
    sampler.store.open()
    for _ in snaps:
        sampler.sample_once()
    return sampler


def _query(path: Path, metric: str, step: float = 2.0, **kw: object) -> dict[Labels, list[float]]:
    q = HistoryQuery(metric, T0, T0 + 10, step, **kw)  # type: ignore[arg-type]
    result = run_query(path, q)
    return {
        tuple(sorted(s["labels"].items())): [p[1] for p in s["points"]] for s in result["series"]
    }


@pytest.fixture
def db(tmp_path: Path) -> Path:
    # 10 requests/s, 100 µs queue each; latencies: first 5 s fast (<= 10 ms), then slow
    snaps = []
    for i in range(11):
        fast = min(i, 5) * 10
        slow = max(i - 5, 0) * 10
        snaps.append(_snapshot(i, 10 * i, 1000 * i, (fast, fast, fast + slow)))
    _sampler(tmp_path, snaps).stop()
    return tmp_path / "h.db"


def test_counters_come_back_as_rates_and_raw(db: Path) -> None:
    assert _query(db, "nv_inference_request_success") == {MLP: [10.0] * 5}
    assert _query(db, "throughput") == {MLP: [20.0] * 5}
    raw = HistoryQuery("nv_inference_request_success", T0, T0 + 10, 2.0, raw=True)
    assert [p[1] for p in run_query(db, raw)["series"][0]["points"]] == [10, 30, 50, 70, 100]


def test_derived_ratios(db: Path) -> None:
    assert _query(db, "avg_queue_us") == {MLP: [100.0] * 5}
    assert _query(db, "avg_batch_size") == {MLP: [4.0] * 5}
    assert _query(db, "avg_queue_us", model="cnn") == {}


def test_gauges_are_averaged_per_step(db: Path) -> None:
    assert _query(db, "nv_inference_pending_request_count") == {MLP: [0.5, 2.5, 4.5, 6.5, 9]}
    assert _query(db, "process_resident_memory_bytes", step=10) == {(): [1005.0]}


def test_latency_quantiles_per_interval(db: Path) -> None:
    p99 = _query(db, "kiln_request_duration_p99_seconds", step=1)[MLP]
    # 1..5: every request of the interval <= 10 ms; 6..10: all above 100 ms (+Inf bucket);
    # the range's end is inclusive, so 9 and 10 share the last step
    assert all(0 < v <= 0.01 for v in p99[:5]) and p99[5:] == [0.1] * 4


def test_unstored_metrics_are_not_kept(db: Path) -> None:
    conn = sqlite3.connect(db)
    names = {m for (m,) in conn.execute("SELECT metric FROM series")}
    conn.close()
    assert "nv_cache_num_hits_per_model" not in names
    assert "kiln_request_duration_seconds_bucket" not in names


def test_restart_counts_from_zero_without_negative_rates(tmp_path: Path) -> None:
    snaps = [_snapshot(i, s, 0, (0, 0, 0)) for i, s in enumerate([0, 10, 20, 5, 15])]
    _sampler(tmp_path, snaps).stop()
    assert _query(tmp_path / "h.db", "nv_inference_request_success", step=1) == {
        MLP: [10.0, 10.0, 5.0, 10.0]
    }


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (HistoryQuery("nope", T0, T0 + 1, 1), "unknown history metric 'nope'"),
        (HistoryQuery("throughput", T0 + 1, T0, 1), "must not be before 'start'"),
        (HistoryQuery("throughput", T0, T0 + 1, 0), "'step' must be a positive"),
        (HistoryQuery("throughput", T0, T0 + 86400, 1), "maximum resolution"),
    ],
)
def test_bad_queries(db: Path, query: HistoryQuery, message: str) -> None:
    with pytest.raises(HistoryQueryError, match=message):
        run_query(db, query)


def test_retention_prunes_old_rows(tmp_path: Path) -> None:
    snaps = [_snapshot(i, i, 0, (0, 0, 0)) for i in range(10)]
    sampler = _sampler(tmp_path, snaps, retention_s=3.0)
    sampler.store.prune(T0 + 9)
    raw = HistoryQuery("nv_inference_request_success", T0, T0 + 10, 1.0, raw=True)
    assert [p[1] for p in run_query(tmp_path / "h.db", raw)["series"][0]["points"]] == [6, 7, 8, 9]
    sampler.stop()


def test_byte_budget_is_enforced(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 300 KiB budget; each sample is many rows: the store must stay within it by pruning
    wide = {f"m{i}": str(i) for i in range(400)}
    snaps = [
        Snapshot(
            T0 + i,
            {
                "nv_cpu_utilization": {
                    tuple(sorted({"n": k, **wide}.items()))[:2]: 0.5 for k in range(60)
                }
            },
        )
        for i in range(400)
    ]
    sampler = _sampler(tmp_path, snaps, max_bytes=300 * 1024)
    assert sampler.store.used_bytes() <= 300 * 1024
    assert os.path.getsize(tmp_path / "h.db") <= 300 * 1024 * 1.5
    latest = HistoryQuery("nv_cpu_utilization", T0 + 390, T0 + 400, 10.0)
    assert run_query(tmp_path / "h.db", latest)["series"]  # the newest samples are kept
    sampler.stop()


def test_full_database_is_logged_and_sampling_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def wide(i: int) -> Snapshot:  # 2000 new series: needs new pages
        return Snapshot(
            T0 + i, {"nv_cpu_utilization": {(("n", f"{i}-{k}"),): 0.5 for k in range(2000)}}
        )

    sampler = HistoryRecorder(
        HistoryOptions(tmp_path / "h.db", 1.0), Feed([wide(i) for i in range(3)])
    )
    sampler.store.open()
    assert sampler.store.conn is not None
    pages = sampler.store.conn.execute("PRAGMA page_count").fetchone()[0]
    sampler.store.conn.execute(f"PRAGMA max_page_count = {pages}")  # the "disk" is full
    with caplog.at_level(logging.ERROR, "kiln.monitoring.history"):
        sampler.sample_once()
        sampler.sample_once()
    assert "database or disk is full" in sampler.error and sampler.samples_written == 0
    assert sum("database or disk is full" in r.message for r in caplog.records) == 1
    sampler.store.conn.execute("PRAGMA max_page_count = 100000")  # space again
    sampler.sample_once()
    assert sampler.error == "" and sampler.samples_written == 1
    sampler.stop()


@pytest.mark.parametrize("case", ["parent is a file", "not a database"])
def test_unusable_path_disables_history_with_a_logged_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    # (a read-only folder would not stop root, which runs these tests in CI)
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"this is not a folder nor a SQLite database" * 100)
    path = blocker / "h.db" if case == "parent is a file" else blocker
    sampler = HistoryRecorder(HistoryOptions(path, 1.0), Feed([]))
    with caplog.at_level(logging.ERROR, "kiln.monitoring.history"):
        sampler.start()
    assert not sampler.available
    assert "history is disabled" in sampler.error
    assert any("cannot open" in r.message for r in caplog.records)
    sampler.sample_once()  # a tick with no store is a no-op, not an error
    sampler.stop()
