"""Metrics history: an embedded SQLite store, written by a recorder thread.

Every ``--history-interval-secs`` the recorder takes a snapshot of the exported series
(the same ones /metrics serves) and stores a chosen subset: raw counters (rates, mean
latency, queue vs compute and batch size are derived at query time, so nothing is lost
to a fixed window), gauges, and p50/p99 over the interval from kiln's latency histograms
(requests, and the LLM engine's time to first token, inter-token and e2e latency).

Durability and bounds: WAL journal (a crash mid-write leaves the last committed samples
readable), one transaction per sample, rows older than ``--history-retention`` pruned, and
a byte budget (``--history-max-mb``) enforced both softly (oldest rows pruned at 90 %) and
hard (``max_page_count``). Any SQLite or OS error is logged and the sample dropped:
history must never take serving down.
"""

from __future__ import annotations

import json
import logging
import math
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.metrics import names
from kiln.monitoring.promql_eval import histogram_quantile
from kiln.monitoring.snapshot import Labels, Snapshot

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS series (
  id INTEGER PRIMARY KEY, metric TEXT NOT NULL, labels TEXT NOT NULL, UNIQUE (metric, labels));
CREATE TABLE IF NOT EXISTS samples (
  series_id INTEGER NOT NULL, ts INTEGER NOT NULL, value REAL NOT NULL,
  PRIMARY KEY (series_id, ts)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""
# Stored as sampled. Counters are cumulative (reset to 0 when kiln restarts).
STORED_METRICS = (
    names.INFERENCE_REQUEST_SUCCESS,
    names.INFERENCE_REQUEST_FAILURE,
    names.INFERENCE_COUNT,
    names.INFERENCE_EXEC_COUNT,
    names.INFERENCE_REQUEST_DURATION_US,
    names.INFERENCE_QUEUE_DURATION_US,
    names.INFERENCE_COMPUTE_INPUT_DURATION_US,
    names.INFERENCE_COMPUTE_INFER_DURATION_US,
    names.INFERENCE_COMPUTE_OUTPUT_DURATION_US,
    names.INFERENCE_PENDING_REQUEST_COUNT,
    names.KILN_MODEL_READY,
    names.CPU_UTILIZATION,
    names.CPU_MEMORY_USED_BYTES,
    names.CPU_MEMORY_TOTAL_BYTES,
    names.PROCESS_RESIDENT_MEMORY_BYTES,
    names.PROCESS_CPU_SECONDS_TOTAL,
    names.GPU_UTILIZATION,
    names.GPU_MEMORY_USED_BYTES,
    names.GPU_MEMORY_TOTAL_BYTES,
    names.GPU_POWER_USAGE,
    names.ENERGY_CONSUMPTION,
    names.KILN_GPU_TEMPERATURE_CELSIUS,
    # The fleet's GPUs (kiln serve --monitor-agent / --monitor-prometheus), DCGM's names.
    names.DCGM_FI_DEV_GPU_UTIL,
    names.DCGM_FI_DEV_MEM_COPY_UTIL,
    names.DCGM_FI_DEV_FB_USED,
    names.DCGM_FI_DEV_FB_FREE,
    names.DCGM_FI_DEV_GPU_TEMP,
    names.DCGM_FI_DEV_MEMORY_TEMP,
    names.DCGM_FI_DEV_POWER_USAGE,
    names.DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION,
    names.DCGM_FI_DEV_SM_CLOCK,
    names.DCGM_FI_DEV_XID_ERRORS,
    # LLM engine (label model_name): load and throughput; rates are derived at query time.
    names.VLLM_NUM_REQUESTS_RUNNING,
    names.VLLM_NUM_REQUESTS_WAITING,
    names.VLLM_KV_CACHE_USAGE_PERC,
    names.VLLM_NUM_PREEMPTIONS_TOTAL,
    names.VLLM_PROMPT_TOKENS_TOTAL,
    names.VLLM_GENERATION_TOKENS_TOTAL,
    names.VLLM_PREFIX_CACHE_QUERIES_TOTAL,
    names.VLLM_PREFIX_CACHE_HITS_TOTAL,
)
_TTFT, _ITL = names.VLLM_TIME_TO_FIRST_TOKEN_SECONDS, names.VLLM_INTER_TOKEN_LATENCY_SECONDS
# name -> (histogram family, quantile): computed per sampling interval from the delta of
# the family's buckets, so each row describes the requests of that interval only.
QUANTILES: dict[str, tuple[str, float]] = {
    "kiln_request_duration_p50_seconds": (names.KILN_REQUEST_DURATION_SECONDS, 0.5),
    "kiln_request_duration_p99_seconds": (names.KILN_REQUEST_DURATION_SECONDS, 0.99),
    "kiln_llm_time_to_first_token_p50_seconds": (_TTFT, 0.5),
    "kiln_llm_time_to_first_token_p99_seconds": (_TTFT, 0.99),
    "kiln_llm_inter_token_latency_p50_seconds": (_ITL, 0.5),
    "kiln_llm_inter_token_latency_p99_seconds": (_ITL, 0.99),
    "kiln_llm_e2e_request_latency_p50_seconds": ("vllm:e2e_request_latency_seconds", 0.5),
}


@dataclass(frozen=True, slots=True)
class HistoryOptions:
    path: Path
    interval_s: float = 5.0
    retention_s: float = 24 * 3600.0
    max_bytes: int = 256 * 1024 * 1024


def labels_json(labels: Labels) -> str:
    return json.dumps(dict(labels), sort_keys=True, separators=(",", ":"))


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=5.0, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000")
    return conn


class HistoryStore:
    """The writer side: one connection, used by the recorder thread only."""

    def __init__(self, options: HistoryOptions) -> None:
        self.options = options
        self.conn: sqlite3.Connection | None = None
        self._series: dict[tuple[str, str], int] = {}

    def open(self) -> None:
        path = self.options.path
        path.parent.mkdir(parents=True, exist_ok=True)
        conn = connect(path)
        try:
            # auto_vacuum must precede table creation; on an existing db it is a no-op.
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            if conn.execute("PRAGMA journal_mode = WAL").fetchone()[0] != "wal":
                raise sqlite3.OperationalError("cannot switch the database to WAL mode")
            # NORMAL in WAL mode survives a process crash; only power loss may drop the
            # last commits, which for monitoring samples is the right trade.
            conn.execute("PRAGMA synchronous = NORMAL")
            conn.executescript(SCHEMA)
            page = conn.execute("PRAGMA page_size").fetchone()[0]
            conn.execute(f"PRAGMA max_page_count = {max(64, self.options.max_bytes // page)}")
            conn.execute(
                "INSERT OR REPLACE INTO meta VALUES ('interval_s', ?)",
                (str(self.options.interval_s),),
            )
            for sid, metric, labels in conn.execute("SELECT id, metric, labels FROM series"):
                self._series[(metric, labels)] = sid
        except Exception:
            conn.close()
            raise
        self.conn = conn

    def _series_id(self, conn: sqlite3.Connection, metric: str, labels: str) -> int:
        sid = self._series.get((metric, labels))
        if sid is None:
            conn.execute(
                "INSERT OR IGNORE INTO series (metric, labels) VALUES (?, ?)", (metric, labels)
            )
            row = conn.execute(
                "SELECT id FROM series WHERE metric = ? AND labels = ?", (metric, labels)
            ).fetchone()
            sid = self._series[(metric, labels)] = int(row[0])
        return sid

    def write(self, ts: float, rows: list[tuple[str, Labels, float]]) -> None:
        conn = self.conn
        assert conn is not None
        ts_ms = int(ts * 1000)
        conn.execute("BEGIN IMMEDIATE")
        try:
            values = [
                (self._series_id(conn, metric, labels_json(labels)), ts_ms, value)
                for metric, labels, value in rows
            ]
            conn.executemany("INSERT OR REPLACE INTO samples VALUES (?, ?, ?)", values)
            conn.execute("COMMIT")
        except BaseException:
            # SQLITE_FULL and friends roll the transaction back themselves.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            self._series.clear()  # ids inserted by the rolled-back transaction are gone
            for sid, metric, labels in conn.execute("SELECT id, metric, labels FROM series"):
                self._series[(metric, labels)] = sid
            raise

    def used_bytes(self) -> int:
        assert self.conn is not None
        page = self.conn.execute("PRAGMA page_size").fetchone()[0]
        pages = self.conn.execute("PRAGMA page_count").fetchone()[0]
        free = self.conn.execute("PRAGMA freelist_count").fetchone()[0]
        return int((pages - free) * page)

    def prune(self, now: float) -> int:
        """Drop rows beyond retention, then the oldest tenth until under 90 % of budget."""
        conn = self.conn
        assert conn is not None
        deleted = self._delete_before(now - self.options.retention_s)
        for _ in range(10):
            if self.used_bytes() < 0.9 * self.options.max_bytes:
                break
            oldest = conn.execute("SELECT min(ts) FROM samples").fetchone()[0]
            if oldest is None:
                break
            deleted += self._delete_before((oldest + (now * 1000 - oldest) / 10) / 1000)
        if deleted:
            conn.execute("PRAGMA incremental_vacuum")
        return deleted

    def _delete_before(self, cutoff: float) -> int:
        """Samples older than ``cutoff``, and the series left without any: label sets that
        change (a fleet peer's GPU ids, models loaded under new names) must not pile up."""
        conn = self.conn
        assert conn is not None
        cutoff_ms = int(cutoff * 1000)
        total = 0
        # Per series, so each DELETE walks the (series_id, ts) primary key.
        for key, sid in list(self._series.items()):
            cur = conn.execute(
                "DELETE FROM samples WHERE series_id = ? AND ts < ?", (sid, cutoff_ms)
            )
            total += cur.rowcount
            if conn.execute("SELECT 1 FROM samples WHERE series_id = ? LIMIT 1", (sid,)).fetchone():
                continue
            conn.execute("DELETE FROM series WHERE id = ?", (sid,))
            del self._series[key]
        return total

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class HistoryRecorder:
    def __init__(self, options: HistoryOptions, source: Callable[[], Snapshot]) -> None:
        self.options = options
        self.source = source
        self.store = HistoryStore(options)
        self.error = ""  # last storage error, shown by /api/history/metrics
        self.samples_written = 0
        self._prev_buckets: dict[str, dict[Labels, float]] = {}  # family -> le labels -> v
        self._last_prune = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.store.conn is not None

    def rows(self, snap: Snapshot) -> list[tuple[str, Labels, float]]:
        out = [
            (metric, labels, v)
            for metric in STORED_METRICS
            for labels, v in snap.series(metric).items()
            if not math.isnan(v)
        ]
        deltas: dict[str, dict[Labels, float]] = {}
        for family in {family for family, _ in QUANTILES.values()}:
            buckets = snap.series(family + "_bucket")
            prev = self._prev_buckets.get(family, {})
            deltas[family] = {
                labels: v - prev[labels] if v >= prev[labels] else v
                for labels, v in buckets.items()
                if labels in prev
            }
            self._prev_buckets[family] = dict(buckets)
        for name, (family, q) in QUANTILES.items():
            for labels, v in histogram_quantile(q, deltas[family]).items():
                if not math.isnan(v):  # no request finished in this interval
                    out.append((name, labels, v))
        return out

    def sample_once(self) -> None:
        if not self.available:
            return
        snap = self.source()
        rows = self.rows(snap)
        try:
            self.store.write(snap.ts, rows)
            self.samples_written += 1
            if snap.ts - self._last_prune >= 60 or self.error:
                self._last_prune = snap.ts
                self.store.prune(snap.ts)
            self.error = ""
        except (sqlite3.Error, OSError) as exc:
            self._fail(f"writing {self.options.path} failed, sample dropped: {exc}")
            if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
                try:
                    self.store.prune(snap.ts)  # budget reached: make room for the next sample
                except (sqlite3.Error, OSError) as again:
                    log.debug("pruning history after a full write failed: %s", again)

    def _fail(self, message: str) -> None:
        if message != self.error:  # log each distinct failure once, not every interval
            log.error("history: %s (serving continues)", message)
        self.error = message

    def start(self) -> None:
        try:
            self.store.open()
            log.info(
                "history: sampling every %.3gs into %s", self.options.interval_s, self.options.path
            )
        except (sqlite3.Error, OSError) as exc:
            self._fail(f"cannot open {self.options.path}: {exc}; history is disabled")
            return
        self._thread = threading.Thread(target=self._run, name="kiln-history", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.options.interval_s):
            try:
                self.sample_once()
            except Exception:  # history must never take the server down
                log.exception("history sample failed")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store.close()
