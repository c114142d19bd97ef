"""Graceful shutdown: on SIGTERM in-flight requests finish, new connections are refused, and
kiln exits 0. A Loop model makes a request slow by its input, not by a sleep."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import KilnProcess
from tests.onnx_models import write_slow_model

ITERS = 6000
SIZE = 200_000


def _pending(server: KilnProcess, model: str) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    pattern = rf'^nv_inference_pending_request_count\{{model="{model}",version="1"\}} (\S+)$'
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _refuses_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except ConnectionRefusedError:
        return True


def test_sigterm_finishes_in_flight_requests(
    make_server: type[KilnProcess], example_repo: Path, tmp_path: Path
) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(example_repo / "simple", repo / "simple")
    write_slow_model(repo)
    server = make_server(repo).start()
    values = np.arange(SIZE, dtype=np.float32) % 7
    results: dict[int, np.ndarray] = {}
    errors: list[str] = []

    def slow_request(i: int) -> None:
        try:
            client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
            data = httpclient.InferInput("INPUT", [SIZE], "FP32")
            data.set_data_from_numpy(values)
            iters = httpclient.InferInput("ITERS", [1], "INT64")
            iters.set_data_from_numpy(np.array([ITERS], dtype=np.int64))
            results[i] = client.infer("slow", [data, iters]).as_numpy("OUTPUT")
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=slow_request, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    # The model has one instance: a request is pending only while the other one computes,
    # so pending == 1 means both are in flight.
    for _ in range(600):
        if _pending(server, "slow") >= 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the slow requests never overlapped:\n{server.log()}")

    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    for _ in range(600):
        if _refuses_connections(server.http_port):
            break
        time.sleep(0.05)
    else:
        pytest.fail("kiln kept accepting connections after SIGTERM")

    for t in threads:
        t.join(120)
    assert errors == []
    for i in (0, 1):
        np.testing.assert_array_equal(results[i], values + ITERS)
    assert server.proc.wait(60) == 0
    assert "kiln stopped" in server.log()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_on_idle_server_exits_0(
    make_server: type[KilnProcess], example_repo: Path, sig: signal.Signals
) -> None:
    server = make_server(example_repo).start()
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.is_server_ready()
    assert server.stop(sig) == 0
    assert "kiln stopped" in server.log()
    assert _refuses_connections(server.http_port)


# vLLM's --shutdown-timeout is kiln's exit timeout; 0 gives up on in-flight requests at once
@pytest.mark.parametrize(
    "timeout", [["--exit-timeout-secs", "1"], ["--shutdown-timeout", "0"]], ids=" ".join
)
def test_exit_timeout_bounds_shutdown_of_a_request_that_cannot_finish(
    make_server: type[KilnProcess], tmp_path: Path, timeout: list[str]
) -> None:
    write_slow_model(tmp_path / "repo")
    server = make_server(tmp_path / "repo", args=timeout).start()
    errors: list[str] = []

    def endless_request() -> None:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        data = httpclient.InferInput("INPUT", [SIZE], "FP32")
        data.set_data_from_numpy(np.zeros(SIZE, dtype=np.float32))
        iters = httpclient.InferInput("ITERS", [1], "INT64")
        iters.set_data_from_numpy(np.array([10**9], dtype=np.int64))  # hours of compute
        try:
            client.infer("slow", [data, iters])
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=endless_request, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(600):
        if _pending(server, "slow") >= 1:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the requests never overlapped:\n{server.log()}")
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    # compute cannot finish: kiln must give up on it at the exit timeout and still exit 0
    assert server.proc.wait(90) == 0
    assert "exiting anyway" in server.log()
    for t in threads:
        t.join(30)
    assert len(errors) == 2
