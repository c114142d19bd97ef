"""``kiln bench`` as a user runs it (CLI subprocess) against a private ``kiln serve``.

Counts are compared with the server's statistics endpoint: every request the generator
reports as successful must appear exactly once in the model's ``success`` count.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.bench import BenchError, Protocol, run
from tests.conftest import KilnProcess, free_port

SHORT = ["--measurement-interval-ms", "300", "--max-trials", "3"]


@pytest.fixture(scope="module")
def server(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """A server only this module talks to, so statistics deltas are ours alone."""
    log = tmp_path_factory.mktemp("bench") / "kiln.log"
    process = KilnProcess(example_repo, args=["--no-history"], log_path=log).start()
    yield process
    process.stop()


def success_count(server: KilnProcess, model: str) -> int:
    url = f"http://{server.http_url}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as resp:
        doc = json.load(resp)
    return sum(int(m["inference_stats"]["success"]["count"]) for m in doc["model_stats"])


def settled_count(server: KilnProcess, model: str, want: int) -> int:
    """``success_count`` once it reaches ``want`` (or after 5 s): a decoupled request is
    counted after its final response is sent, so the client can finish first."""
    deadline = time.monotonic() + 5
    count = success_count(server, model)
    while count < want and time.monotonic() < deadline:
        time.sleep(0.05)
        count = success_count(server, model)
    return count


def bench(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kiln", "bench", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def check_report(doc: dict[str, Any], model: str, levels: list[int]) -> None:
    assert doc["model"] == model and doc["mode"] == "concurrency"
    assert [lv["concurrency"] for lv in doc["levels"]] == levels
    for lv in doc["levels"]:
        assert lv["requests"] > 0 and lv["errors"] == 0
        assert 1 <= lv["windows"] <= 3
        assert lv["throughput_infer_per_sec"] > 0
        lat = lv["latency_us"]
        assert 0 < lat["p50"] <= lat["p90"] <= lat["p95"] <= lat["p99"]
        assert set(lv["server_us"]) == {"queue", "compute_input", "compute_infer",
                                        "compute_output"}  # fmt: skip
        assert lv["server_us"]["compute_infer"] > 0
        assert lv["client_cpu_us_per_request"] > 0
    assert doc["total"]["errors"] == 0 and doc["total"]["first_error"] is None
    assert doc["total"]["requests"] >= sum(lv["requests"] for lv in doc["levels"])


@pytest.mark.parametrize("model", ["simple", "mlp"])
@pytest.mark.parametrize(
    ("encoding", "flags"),
    [("http-json", ["--json-data"]), ("http-binary", []), ("grpc", ["-i", "grpc"])],
)
def test_counts_match_server_statistics(
    server: KilnProcess, tmp_path: Path, model: str, encoding: str, flags: list[str]
) -> None:
    url = server.grpc_url if encoding == "grpc" else server.http_url
    report = tmp_path / "report.json"
    before = success_count(server, model)
    done = bench(model, "-u", url, *flags, "--concurrency", "1:2", *SHORT, "--json", str(report))
    after = success_count(server, model)
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    assert doc["encoding"] == encoding
    check_report(doc, model, [1, 2])
    assert doc["total"]["requests"] == after - before
    assert "concurrency" in done.stdout and "p99 ms" in done.stdout


def test_csv_and_plot(server: KilnProcess, tmp_path: Path) -> None:
    csv_path, png = tmp_path / "r.csv", tmp_path / "r.png"
    done = bench("mlp", "-u", server.http_url, "--concurrency-range", "1:2", *SHORT,
                 "-f", str(csv_path), "--plot", str(png))  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = csv_path.read_text().splitlines()
    assert rows[0].startswith("Concurrency,Request Rate,Inferences/Second")
    assert [r.split(",")[0] for r in rows[1:]] == ["1", "2"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 100 and image.shape[1] > 100


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_inputs(server: KilnProcess, tmp_path: Path, protocol: str) -> None:
    url = server.grpc_url if protocol == "grpc" else server.http_url
    report = tmp_path / "r.json"
    before = success_count(server, "simple")
    done = bench("simple", "-u", url, "-i", protocol, "--shared-memory", "system",
                 "--concurrency", "2", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    assert doc["shared_memory"] == "system"
    check_report(doc, "simple", [2])
    assert doc["total"]["requests"] == success_count(server, "simple") - before
    # the region was unregistered and its /dev/shm object removed
    with urllib.request.urlopen(f"http://{server.http_url}/v2/systemsharedmemory/status") as r:
        assert json.load(r) == []
    assert not list(Path("/dev/shm").glob("kiln_bench_*_simple"))


def test_open_loop_request_rate(server: KilnProcess, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    before = success_count(server, "mlp")
    done = bench("mlp", "-u", server.http_url, "--request-rate", "50:100:50",
                 "--request-distribution", "poisson", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    assert doc["mode"] == "request_rate" and doc["distribution"] == "poisson"
    assert [lv["request_rate"] for lv in doc["levels"]] == [50, 100]
    assert all(lv["requests"] > 0 and lv["concurrency"] is None for lv in doc["levels"])
    assert doc["total"]["requests"] == success_count(server, "mlp") - before


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_sequence_model_gets_sequences(
    server: KilnProcess, tmp_path: Path, protocol: str
) -> None:
    """``simple_sequence`` has ``sequence_batching``: each client sends sequences of
    ``--sequence-length`` requests under its own id, START first and END last (a request
    without a sequence id, or a sequence without START, fails on the server), and every
    request the generator counts reached the model."""
    url = server.grpc_url if protocol == "grpc" else server.http_url
    report = tmp_path / "r.json"
    before = success_count(server, "simple_sequence")
    done = bench("simple_sequence", "-u", url, "-i", protocol, "--concurrency", "1:2",
                 "--sequence-length", "5", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    check_report(doc, "simple_sequence", [1, 2])
    assert doc["sequence_length"] == 5
    assert doc["total"]["requests"] == success_count(server, "simple_sequence") - before
    assert "sequences of 5" in done.stdout


def test_a_sequence_model_refuses_the_open_loop(server: KilnProcess) -> None:
    done = bench("simple_sequence", "-u", server.http_url, "--request-rate", "50", *SHORT)
    assert done.returncode == 2
    assert "model 'simple_sequence' has sequence_batching" in done.stderr
    assert "--concurrency-range" in done.stderr


def test_a_decoupled_model_is_streamed(server: KilnProcess, tmp_path: Path) -> None:
    """``repeat_int32`` is decoupled: its requests go over a ``ModelStreamInfer`` stream,
    each one done at its final response; every one the generator counts succeeded on the
    server. A plain model streams with ``--streaming``."""
    report = tmp_path / "r.json"
    before = success_count(server, "repeat_int32")
    done = bench("repeat_int32", "-u", server.grpc_url, "-i", "grpc", "--shape", "IN:4",
                 "--concurrency", "1:2", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr
    doc = json.loads(report.read_text())
    assert doc["streaming"] is True
    check_report(doc, "repeat_int32", [1, 2])
    for level in doc["levels"]:  # four responses with outputs per request (IN has four)
        assert level["responses_per_sec"] == pytest.approx(4 * level["requests_per_sec"])
    want = before + doc["total"]["requests"]
    assert doc["total"]["requests"] == settled_count(server, "repeat_int32", want) - before
    assert "streaming" in done.stdout
    done = bench("mlp", "-u", server.grpc_url, "-i", "grpc", "--streaming", "--request-rate",
                 "50", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 0, done.stderr  # the open loop streams too
    doc = json.loads(report.read_text())
    assert doc["streaming"] is True and doc["levels"][0]["requests"] > 0
    assert doc["levels"][0]["responses_per_sec"] == pytest.approx(
        doc["levels"][0]["requests_per_sec"]
    )


async def test_a_streamed_request_ends_at_its_final_response(server: KilnProcess) -> None:
    from kiln.bench.bodies import Placement, grpc_request
    from kiln.bench.inputs import ModelSpec, TensorSpec
    from kiln.bench.transport import GrpcStreamSlot

    spec = ModelSpec("repeat_int32", "", [TensorSpec("IN", "INT32", [-1])], decoupled=True)
    request = grpc_request(spec, {"IN": np.arange(4, dtype=np.int32)}, Placement(),
                           {"triton_enable_empty_final_response": True})  # fmt: skip
    slot = GrpcStreamSlot(server.grpc_url, [request], 30.0)
    try:
        assert await slot.infer() == 4  # four responses with outputs...
        assert slot.responses == 5  # ...then the FINAL flag on its own
        assert await slot.infer() == 4  # the same stream carries the next request
        assert slot.responses == 10
    finally:
        await slot.close()


def test_a_decoupled_model_needs_grpc(server: KilnProcess) -> None:
    done = bench("repeat_int32", "-u", server.http_url, "--shape", "IN:4", *SHORT)
    assert done.returncode == 2
    assert "model 'repeat_int32' is decoupled" in done.stderr and "-i grpc" in done.stderr
    done = bench("mlp", "-u", server.http_url, "--streaming", *SHORT)
    assert done.returncode == 2 and "--streaming needs gRPC" in done.stderr


def test_python_api_batch_size(server: KilnProcess) -> None:
    before = success_count(server, "mlp")
    result = run(model="mlp", url=server.grpc_url, protocol=Protocol.GRPC, batch_size=4,
                 concurrency=[1], measurement_interval_ms=300, max_trials=3)  # fmt: skip
    level = result.levels[0]
    assert level.throughput == pytest.approx(level.requests_per_sec * 4)
    assert result.total_requests == success_count(server, "mlp") - before
    with pytest.raises(BenchError, match="exceeds model 'mlp' max_batch_size"):
        run(model="mlp", url=server.http_url, batch_size=10_000)


def test_unknown_model(server: KilnProcess) -> None:
    for flags in (["-u", server.http_url], ["-u", server.grpc_url, "-i", "grpc"]):
        done = bench("no_such_model", *flags, *SHORT)
        assert done.returncode == 2
        assert "model 'no_such_model' is not available" in done.stderr


def test_server_unreachable() -> None:
    port = str(free_port())
    for flags in (["-u", f"127.0.0.1:{port}"], ["-u", f"127.0.0.1:{port}", "-i", "grpc"]):
        done = bench("simple", *flags, *SHORT)
        assert done.returncode == 2
        assert f"cannot reach the server at 127.0.0.1:{port}" in done.stderr


def test_failing_requests_are_counted(server: KilnProcess, tmp_path: Path) -> None:
    data = tmp_path / "bad.npz"  # INPUT0 has 8 columns; the model wants 16
    np.savez(data, INPUT0=np.zeros((1, 8), np.int32), INPUT1=np.zeros((1, 16), np.int32))
    report = tmp_path / "r.json"
    done = bench("simple", "-u", server.http_url, "--input-data", str(data),
                 "--concurrency", "1", *SHORT, "--json", str(report))  # fmt: skip
    assert done.returncode == 1
    doc = json.loads(report.read_text())
    assert doc["total"]["requests"] == 0 and doc["total"]["errors"] > 0
    assert doc["levels"][0]["errors"] > 0
    assert "INPUT0" in doc["total"]["first_error"]
    assert "first error" in done.stdout and "INPUT0" in done.stdout
    assert success_count(server, "simple") >= 0  # the server still answers


def test_plot_without_matplotlib(tmp_path: Path) -> None:
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('matplotlib blocked for the test')\n")
    env = dict(os.environ, PYTHONPATH=str(blocker.parent))
    done = bench("simple", "--plot", str(tmp_path / "x.png"), env=env)
    assert done.returncode == 2
    assert "install kiln-serve[bench]" in done.stderr
