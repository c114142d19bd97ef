"""Dynamic batching and instance groups end to end: kiln serve + tritonclient.http."""

from __future__ import annotations

import re
import shutil
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

CPU_GROUP = re.compile(r"instance_group \[.*?\]\n", re.S)


def repo_with_mlp(example_repo: Path, dest: Path, extra: str) -> Path:
    """A copy of the example repository whose mlp config ends with ``extra``."""
    repo = dest / "repo"
    shutil.copytree(example_repo, repo)
    config = repo / "mlp" / "config.pbtxt"
    config.write_text(CPU_GROUP.sub("", config.read_text()) + extra)
    return repo


def mlp_input(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 64)).astype(np.float32)


def infer(
    client: httpclient.InferenceServerClient, data: np.ndarray, **kwargs: Any
) -> httpclient.InferResult:
    tensor = httpclient.InferInput("INPUT", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    return client.infer("mlp", [tensor], **kwargs)


def pending_gauge(server: KilnProcess) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    match = re.search(r'nv_inference_pending_request_count\{[^}]*model="mlp"[^}]*\} (\S+)', text)
    return float(match.group(1)) if match else -1.0


def test_concurrent_requests_are_batched_across_two_instances(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    repo = repo_with_mlp(
        example_repo,
        tmp_path,
        "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 20000 }\n",
    )
    server = make_server(repo).start()
    session = ort.InferenceSession(
        str(repo / "mlp" / "1" / "model.onnx"), providers=["CPUExecutionProvider"]
    )
    clients, per_client = 16, 8
    mismatches: list[str] = []
    lock = threading.Lock()

    def worker(c: int) -> int:
        client = httpclient.InferenceServerClient(server.http_url)
        rows_sent = 0
        for i in range(per_client):
            data = mlp_input(1 + (c + i) % 3, seed=c * 100 + i)
            result = infer(client, data)
            expected = session.run(["LOGITS", "PROBABILITIES"], {"INPUT": data})
            for name, want in zip(("LOGITS", "PROBABILITIES"), expected, strict=True):
                got = result.as_numpy(name)
                if got is None or got.shape != want.shape or not np.allclose(got, want, atol=1e-5):
                    with lock:
                        mismatches.append(f"client {c} request {i} output {name}")
            rows_sent += data.shape[0]
        client.close()
        return rows_sent

    with ThreadPoolExecutor(clients) as pool:
        total_rows = sum(pool.map(worker, range(clients)))
    assert mismatches == []

    client = httpclient.InferenceServerClient(server.http_url)
    stats = client.get_inference_statistics("mlp")["model_stats"][0]
    assert int(stats["inference_count"]) == total_rows
    assert int(stats["inference_stats"]["success"]["count"]) == clients * per_client
    assert int(stats["execution_count"]) < clients * per_client  # requests shared batches
    sizes = {int(b["batch_size"]) for b in stats["batch_stats"]}
    assert max(sizes) > 3  # larger than any single request: merged
    executed = sum(int(b["compute_infer"]["count"]) for b in stats["batch_stats"])
    assert executed == int(stats["execution_count"])
    config = client.get_model_config("mlp")
    assert [g["count"] for g in config["instance_group"]] == [2]
    # mlp sets no priority_levels: a priority is a client error, and the model keeps serving.
    with pytest.raises(InferenceServerException) as err:
        infer(client, mlp_input(1, seed=0), priority=2)
    assert err.value.status() == "400"
    assert "priority 2 is out of range for model 'mlp'" in err.value.message()
    assert infer(client, mlp_input(1, seed=0)).as_numpy("LOGITS").shape == (1, 10)


def test_full_queue_and_expired_timeout_answer_503_and_queued_requests_still_run(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    # A 2 s queue delay keeps the first requests queued while the others arrive.
    repo = repo_with_mlp(
        example_repo,
        tmp_path,
        "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        "dynamic_batching { max_queue_delay_microseconds: 2000000 "
        "default_queue_policy { max_queue_size: 2 allow_timeout_override: true } }\n",
    )
    server = make_server(repo).start()
    client = httpclient.InferenceServerClient(server.http_url)

    def wait_pending(count: float) -> None:
        deadline = time.monotonic() + 30
        while pending_gauge(server) != count and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pending_gauge(server) == count

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(
            infer, httpclient.InferenceServerClient(server.http_url), mlp_input(1, 1)
        )
        wait_pending(1)
        # Its own 1 ms timeout expires long before the 2 s delay: REJECT (the default).
        with pytest.raises(InferenceServerException) as expired:
            infer(client, mlp_input(1, 2), timeout=1000)
        assert expired.value.status() == "503"
        assert expired.value.message() == "Request timeout expired"
        second = pool.submit(
            infer, httpclient.InferenceServerClient(server.http_url), mlp_input(2, 3)
        )
        wait_pending(2)
        with pytest.raises(InferenceServerException) as full:
            infer(client, mlp_input(1, 4))
        assert full.value.status() == "503"
        assert "Exceeds maximum queue size" in full.value.message()
        assert "'mlp'" in full.value.message()
        results = [first.result(timeout=30), second.result(timeout=30)]
    assert [r.as_numpy("LOGITS").shape for r in results] == [(1, 10), (2, 10)]
    stats = client.get_inference_statistics("mlp")["model_stats"][0]
    assert [int(b["batch_size"]) for b in stats["batch_stats"]] == [3]  # the two merged
    assert int(stats["inference_stats"]["fail"]["count"]) == 2
    # Both are the scheduler's refusals: Triton's REJECTED reason on /metrics.
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    rejected = re.search(
        r'^nv_inference_request_failure\{(?=[^}]*model="mlp")(?=[^}]*reason="REJECTED")[^}]*\} '
        r"(\S+)$",
        text,
        re.M,
    )
    assert rejected is not None and float(rejected.group(1)) == 2
    # The server keeps serving: other models, and mlp once its queue has room again.
    assert client.is_model_ready("simple")
    assert infer(client, mlp_input(64, seed=5)).as_numpy("LOGITS").shape == (64, 10)


def test_kind_gpu_without_a_gpu_fails_the_load_with_the_reason(
    example_repo: Path, tmp_path: Path, make_server: type[KilnProcess]
) -> None:
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has a usable GPU: KIND_GPU would load")
    repo = repo_with_mlp(example_repo, tmp_path, "instance_group [ { count: 1 kind: KIND_GPU } ]\n")
    server = make_server(repo, args=["--model-control-mode", "explicit"]).start()
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as err:
        client.load_model("mlp")
    message = err.value.message()
    assert "failed to load 'mlp'" in message
    assert "has kind KIND_GPU but server does not support GPUs" in message
    assert not client.is_model_ready("mlp")
    index = {m["name"]: m for m in client.get_model_repository_index()}
    assert index["mlp"]["state"] == "UNAVAILABLE"
    assert "KIND_GPU" in index["mlp"]["reason"]
    client.load_model("simple")  # the server keeps loading and serving other models
    assert client.is_model_ready("simple")
