"""History of a real ``kiln serve``: queryable, kept across restarts and SIGKILL, and never
a reason to stop serving."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess
from tests.integration.monitor_helpers import get_json, infer_simple, wait_for

FAST = ["--history-interval-secs", "0.1", "--no-default-alert-rules", "--no-allow-grpc"]


@pytest.fixture(scope="module")
def simple_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("history") / "model_repository"
    build_example_repository(root, ["simple"])
    return root


def _raw_success(server: KilnProcess, start: str = "now-10m") -> list[float]:
    status, body = get_json(
        server,
        "/api/history",
        metric="nv_inference_request_success",
        model="simple",
        fn="raw",
        start=start,
        step="0.1",
    )
    assert status == 200, body
    return [v for s in body["series"] for _, v in s["points"]]


def _has(server: KilnProcess, value: float) -> bool:
    return value in _raw_success(server)


def _at_least(server: KilnProcess, successes: float) -> bool:
    # A bool, never the empty list: wait_for accepts any result but None and False, so
    # ``points and max(points) >= n`` returned at once before the first sample existed.
    points = _raw_success(server)
    return bool(points) and max(points) >= successes


def test_history_is_queryable_and_survives_a_restart(
    make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    db = tmp_path / "h.db"
    first = make_server(simple_repo, args=[*FAST, "--history-path", str(db)]).start()
    # A sample from before the requests: the average below is a ratio of two deltas, which
    # a loaded machine could otherwise leave without a "before" point.
    wait_for(lambda: _has(first, 0.0), 30, "a sample before any request")
    assert infer_simple(first, 5) == 5
    wait_for(lambda: _has(first, 5.0), 30, "5 successes in history")
    status, body = get_json(first, "/api/history", metric="avg_request_us", model="simple")
    assert status == 200 and body["kind"] == "ratio"
    [series] = body["series"]
    assert series["labels"] == {"model": "simple", "version": "1"}
    assert all(v > 0 for _, v in series["points"])
    status, meta = get_json(first, "/api/history/metrics")
    assert status == 200 and meta["path"] == str(db) and meta["error"] == ""
    assert {"throughput", "avg_queue_us", "kiln_request_duration_p99_seconds"} <= {
        m["name"] for m in meta["metrics"]
    }
    assert first.stop() == 0

    second = make_server(simple_repo, args=[*FAST, "--history-path", str(db)]).start()
    assert _has(second, 5.0)  # the first run's samples are still there
    assert infer_simple(second, 2) == 2
    wait_for(lambda: _has(second, 2.0), 30, "the restarted server's own samples")
    # the counter restarted at 0: the rate never goes negative across the restart
    status, rates = get_json(
        second, "/api/history", metric="nv_inference_request_success", start="now-1h", step="1"
    )
    assert status == 200 and all(v >= 0 for s in rates["series"] for _, v in s["points"])

    out = subprocess.run(
        [sys.executable, "-m", "kiln", "monitor", "history", second.http_url,
         "--metric", "throughput", "--metric", "avg_request_us", "--since", "10m"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "throughput (rate" in out.stdout and "avg_request_us (ratio" in out.stdout
    assert "model=simple" in out.stdout


def test_sigkill_during_sampling_leaves_a_readable_database(
    make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    db = tmp_path / "h.db"
    args = [*FAST, "--history-path", str(db), "--history-interval-secs", "0.05"]
    server = make_server(simple_repo, args=args).start()
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                infer_simple(server, 1)
            except Exception:  # the server is killed under it
                return

    worker = threading.Thread(target=load)
    worker.start()
    wait_for(lambda: _at_least(server, 3), 30, "3 successes in history")
    server.stop(signal.SIGKILL)
    stop.set()
    worker.join(10)

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    kept = conn.execute(
        "SELECT max(value) FROM samples JOIN series ON series.id = series_id "
        "WHERE metric = 'nv_inference_request_success'"
    ).fetchone()[0]
    conn.close()
    assert kept >= 3

    again = make_server(simple_repo, args=args).start()
    assert max(_raw_success(again)) == kept
    assert infer_simple(again, 1) == 1
    wait_for(lambda: _has(again, 1.0), 30, "new samples after the crash")


def test_unusable_history_path_is_logged_and_serving_continues(
    make_server: type[KilnProcess], simple_repo: Path, tmp_path: Path
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    server = make_server(simple_repo, args=[*FAST, "--history-path", str(blocker / "h.db")])
    server.start()
    assert infer_simple(server, 3) == 3
    assert "history: cannot open" in server.log() and "serving continues" in server.log()
    for path in ("/api/history", "/api/history/metrics"):
        status, body = get_json(server, path, metric="throughput")
        assert status == 503 and body["error"].startswith("history is unavailable: cannot open")
    assert infer_simple(server, 1) == 1


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"metric": "nv_inference_cnt"}, "unknown history metric 'nv_inference_cnt'"),
        ({}, "missing 'metric'"),
        ({"metric": "throughput", "start": "yesterday"}, "'start' must be unix seconds"),
        ({"metric": "throughput", "start": "now-5x"}, "'start': invalid duration '5x'"),
        ({"metric": "throughput", "step": "-1"}, "'step' must be a positive number"),
        ({"metric": "throughput", "step": "fast"}, "'step' must be seconds or a duration"),
        ({"metric": "throughput", "fn": "sum"}, "'fn' must be 'rate' or 'raw'"),
        ({"metric": "throughput", "start": "now-1d", "step": "1"}, "maximum resolution"),
    ],
)
def test_bad_history_queries_get_400(
    kiln_server: KilnProcess, params: dict[str, str], message: str
) -> None:
    status, body = get_json(kiln_server, "/api/history", **params)
    assert status == 400 and message in body["error"]
    assert infer_simple(kiln_server, 1) == 1


def test_default_history_path_is_per_port_under_the_state_dir(kiln_server: KilnProcess) -> None:
    status, meta = get_json(kiln_server, "/api/history/metrics")
    assert status == 200
    expected = (
        kiln_server.repository.parent / "state" / "kiln" / f"history-{kiln_server.http_port}.db"
    )
    assert meta["path"] == str(expected) and meta["interval"] == 5.0


def test_no_history_flag(make_server: type[KilnProcess], simple_repo: Path) -> None:
    server = make_server(simple_repo, args=["--no-history", "--no-default-alert-rules"]).start()
    status, body = get_json(server, "/api/history", metric="throughput")
    assert status == 503 and "--no-history" in body["error"]
    status, alerts = get_json(server, "/api/alerts")
    assert status == 200 and alerts == {"alerts": [], "rules": []}
