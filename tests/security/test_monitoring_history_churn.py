"""History under label churn: a fleet peer whose GPU ids change at every scrape (or models
loaded and unloaded under new names) makes new series all the time. Before, a series row
and its entry in the recorder's map were kept forever, after its last sample was pruned:
memory grew without end, every prune walked every series that ever was, and once the size
budget was spent on series rows, pruning samples could free nothing for them. A series
without samples left is now dropped with them, and comes back if it is seen again."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from kiln.monitoring.history import HistoryOptions, HistoryRecorder
from kiln.monitoring.snapshot import Snapshot

T0 = 1_700_000_000.0
TEMP = "DCGM_FI_DEV_GPU_TEMP"


def _gpu(uuid: str) -> tuple[tuple[str, str], ...]:
    return (("UUID", uuid), ("gpu", "0"), ("instance", "peer:9400"))


def _series_rows(path: Path) -> list[str]:
    with sqlite3.connect(path) as conn:
        return [row[0] for row in conn.execute("SELECT labels FROM series ORDER BY labels")]


def test_series_whose_samples_expired_are_dropped(tmp_path: Path) -> None:
    # a churning peer: a new GPU id at every scrape, one steady GPU beside it
    snaps = [
        Snapshot(T0 + i, {TEMP: {_gpu(f"GPU-churn-{i}"): 60.0, _gpu("GPU-steady"): 50.0}})
        for i in range(100)
    ]
    feed = iter([*snaps, Snapshot(T0 + 100, {TEMP: {_gpu("GPU-churn-0"): 61.0}})])
    options = HistoryOptions(tmp_path / "h.db", 1.0, retention_s=10.0)
    recorder = HistoryRecorder(options, lambda: next(feed))
    recorder.store.open()
    for _ in snaps:
        recorder.sample_once()
    recorder.store.prune(T0 + 99)  # keeps the samples of T0+89 .. T0+99
    rows = _series_rows(options.path)
    assert len(rows) == 1 + 11 and any("GPU-steady" in r for r in rows)
    assert len(recorder.store._series) == 12  # the recorder's map follows the table
    recorder.sample_once()  # a dropped series seen again is recorded again
    assert any("GPU-churn-0" in r for r in _series_rows(options.path))
    recorder.stop()
