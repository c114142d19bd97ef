"""Request tracing on a real ``kiln serve`` (``--trace-config``), driven by tritonclient over
HTTP, gRPC and gRPC asyncio: the Triton-format trace file, an ensemble's and a BLS call's
child traces, settings changed at run time, and bad flags."""

from __future__ import annotations

import asyncio
import json
import queue
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient

from tests.conftest import KilnProcess

BLS_CONFIG = """
name: "bls_caller"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1, 16 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1, 16 ] } ]
"""

BLS_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            inputs = [pb_utils.Tensor("INPUT0", x), pb_utils.Tensor("INPUT1", x)]
            # traced as this request's child ...
            traced = pb_utils.InferenceRequest(
                model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"],
                request_id="with-trace", trace=request.trace()).exec()
            # ... and on its own (sampled like any request)
            pb_utils.InferenceRequest(
                model_name="simple", inputs=inputs, requested_output_names=["OUTPUT0"],
                request_id="without-trace").exec()
            y = pb_utils.get_output_tensor_by_name(traced, "OUTPUT0").as_numpy()
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return responses
"""

HTTP_STAMPS = [
    "HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START", "COMPUTE_START",
    "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END", "INFER_RESPONSE_COMPLETE",
    "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END",
]  # fmt: skip
GRPC_STAMPS = [
    "GRPC_WAITREAD_START", "GRPC_WAITREAD_END", *HTTP_STAMPS[2:-2], "GRPC_SEND_START",
    "GRPC_SEND_END",
]  # fmt: skip


@pytest.fixture
def repo(example_repo: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(example_repo, copy)
    model = copy / "bls_caller"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(BLS_CONFIG)
    (model / "1" / "model.py").write_text(textwrap.dedent(BLS_MODEL))
    return copy


def _written(path: Path, timeout: float = 30.0) -> Path:
    """``path`` once the server's trace writer thread has put it there (files appear whole:
    written aside, then renamed)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.02)
    return path


def _traces(path: Path) -> dict[int, dict[str, Any]]:
    """id -> {head fields, "stamps": [(name, ns)], "tensors": [...]}, from Triton's format."""
    out: dict[int, dict[str, Any]] = {}
    for entry in json.loads(path.read_text()):
        trace = out.setdefault(entry["id"], {"stamps": [], "tensors": []})
        if "model_name" in entry:
            trace.update(entry)
        elif "timestamps" in entry:
            trace["stamps"] += [(t["name"], t["ns"]) for t in entry["timestamps"]]
        else:
            trace["tensors"].append(entry)
    return out


def _flags(*settings: str) -> list[str]:
    return [arg for setting in settings for arg in ("--trace-config", setting)]


def _by_request(traces: dict[int, dict[str, Any]], request_id: str) -> dict[str, Any]:
    [trace] = [t for t in traces.values() if t.get("request_id") == request_id]
    return trace


def simple_inputs(module: Any) -> list[Any]:
    """``simple``'s two inputs (0..15) for a tritonclient module (http, grpc, aio)."""
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [module.InferInput("INPUT0", [1, 16], "INT32"),
              module.InferInput("INPUT1", [1, 16], "INT32")]  # fmt: skip
    for item in inputs:
        item.set_data_from_numpy(a)
    return inputs


def test_every_protocol_ensemble_and_bls_call_is_traced(
    make_server: type[KilnProcess], repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "trace.json"
    server = make_server(
        repo,
        args=_flags(f"triton,file={out}", "level=TIMESTAMPS", "level=TENSORS", "rate=1"),
    ).start()
    http = httpclient.InferenceServerClient(server.http_url)
    assert http.get_trace_settings()["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    http.infer("simple", simple_inputs(httpclient), request_id="over-http")
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.infer("simple", simple_inputs(grpcclient), request_id="over-grpc")

    async def aio() -> None:
        async with aioclient.InferenceServerClient(server.grpc_url) as client:
            await client.infer("simple", simple_inputs(aioclient), request_id="over-aio")

    asyncio.run(aio())
    image = httpclient.InferInput("IMAGE", [1, 28, 28, 1], "UINT8")
    image.set_data_from_numpy(np.full((1, 28, 28, 1), 128, np.uint8))
    http.infer("python_pipeline", [image], request_id="ensemble")
    x = httpclient.InferInput("X", [1, 16], "INT32")
    x.set_data_from_numpy(np.arange(16, dtype=np.int32).reshape(1, 16))
    http.infer("bls_caller", [x], request_id="bls")

    # a chunked body takes the ASGI route instead of the fast path: traced the same
    body = {"id": "chunked", "inputs": [
        {"name": n, "shape": [1, 16], "datatype": "INT32", "data": list(range(16))}
        for n in ("INPUT0", "INPUT1")]}  # fmt: skip
    chunked = requests.post(
        f"http://{server.http_url}/v2/models/simple/infer",
        data=iter([json.dumps(body).encode()]), timeout=30,
    )  # fmt: skip
    assert chunked.status_code == 200, chunked.text

    # Per model, at run time: simple stops being traced, the others go on.
    http.update_trace_settings("simple", {"trace_level": ["OFF"]})
    http.infer("simple", simple_inputs(httpclient), request_id="not-traced")
    assert server.stop() == 0  # the traces are written as the server stops
    traces = _traces(out)

    over_http = _by_request(traces, "over-http")
    assert over_http["model_name"] == "simple" and over_http["model_version"] == 1
    names = [name for name, _ in over_http["stamps"]]
    assert names == HTTP_STAMPS
    times = [ns for _, ns in over_http["stamps"]]
    assert times == sorted(times) and times[0] < times[-1]
    tensors = {(t["activity"], t["tensor"]["name"]): t["tensor"] for t in over_http["tensors"]}
    assert tensors[("TENSOR_QUEUE_INPUT", "INPUT0")]["data"] == ",".join(map(str, range(16)))
    assert tensors[("TENSOR_BACKEND_OUTPUT", "OUTPUT0")]["data"] == ",".join(
        str(2 * i) for i in range(16)
    )
    assert tensors[("TENSOR_BACKEND_OUTPUT", "OUTPUT0")]["shape"] == "1,16"
    assert [n for n, _ in _by_request(traces, "chunked")["stamps"]] == HTTP_STAMPS
    for request_id in ("over-grpc", "over-aio"):
        assert [n for n, _ in _by_request(traces, request_id)["stamps"]] == GRPC_STAMPS

    ensemble = _by_request(traces, "ensemble")
    children = [t for t in traces.values() if t.get("parent_id") == ensemble["id"]]
    assert sorted(t["model_name"] for t in children) == ["cnn", "postprocess", "python_preprocess"]
    assert "COMPUTE_START" not in [n for n, _ in ensemble["stamps"]]  # its steps compute
    for child in children:
        child_names = [n for n, _ in child["stamps"]]
        assert child_names[:2] == ["REQUEST_START", "QUEUE_START"]
        assert "COMPUTE_END" in child_names and child_names[-1] == "REQUEST_END"
        start, end = child["stamps"][0][1], child["stamps"][-1][1]
        assert ensemble["stamps"][0][1] <= start <= end <= ensemble["stamps"][-1][1]

    bls = _by_request(traces, "bls")
    assert _by_request(traces, "with-trace")["parent_id"] == bls["id"]
    assert "parent_id" not in _by_request(traces, "without-trace")
    assert not [t for t in traces.values() if t.get("request_id") == "not-traced"]

    # the summary a user reads it with
    summary = subprocess.run(
        [sys.executable, "-m", "kiln", "trace", "summary", str(out), "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    groups = {(g["model_name"], g["protocol"]): g for g in json.loads(summary.stdout)}
    assert groups[("simple", "HTTP")]["traces"] == 2  # the fast path and the chunked one
    assert groups[("simple", "GRPC")]["traces"] == 2
    assert groups[("simple", "in-server")]["traces"] == 2  # the two BLS calls
    assert groups[("cnn", "in-server")]["mean_us"]["compute"] > 0


def test_a_decoupled_stream_is_traced_response_by_response(
    make_server: type[KilnProcess], example_repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    server = make_server(
        example_repo, args=_flags(f"triton,file={out}", "level=TIMESTAMPS", "rate=1")
    ).start()
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    values = grpcclient.InferInput("IN", [3], "INT32")
    values.set_data_from_numpy(np.array([4, 5, 6], np.int32))
    client.async_stream_infer("repeat_int32", [values], request_id="streamed")
    answers = [got.get(timeout=30) for _ in range(3)]
    client.stop_stream()
    assert [int(a.as_numpy("OUT")[0]) for a in answers] == [4, 5, 6]
    assert server.stop() == 0
    trace = _by_request(_traces(out), "streamed")
    names = [n for n, _ in trace["stamps"]]
    assert names.count("INFER_RESPONSE_COMPLETE") == 3
    assert names[:2] == ["REQUEST_START", "QUEUE_START"] and names[-1] == "REQUEST_END"
    assert "COMPUTE_START" in names


def test_log_frequency_and_trace_count_over_the_api(
    make_server: type[KilnProcess], example_repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    server = make_server(
        example_repo,
        args=_flags(
            f"triton,file={out}", "level=TIMESTAMPS", "rate=2", "count=3", "triton,log-frequency=2"
        ),
    ).start()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for _ in range(4):  # every 2nd: two traces, written to t.json.0 at the second
        client.infer("simple", simple_inputs(grpcclient))
    first = _traces(_written(Path(f"{out}.0")))
    assert [t["model_name"] for t in first.values()] == ["simple", "simple"]
    settings = client.get_trace_settings(as_json=True)["settings"]
    assert settings["trace_count"]["value"] == ["1"]  # the count left, as Triton reports
    # every request now, but only one trace is left to take
    client.update_trace_settings(settings={"trace_rate": "1"})
    for _ in range(3):
        client.infer("simple", simple_inputs(grpcclient))
    assert client.get_trace_settings(as_json=True)["settings"]["trace_count"]["value"] == ["0"]
    assert server.stop() == 0
    assert len(_traces(Path(f"{out}.1"))) == 1  # what was left, at the next index
    assert not Path(f"{out}.2").exists() and not out.exists()


def test_the_trace_file_is_not_a_client_s_to_choose(
    make_server: type[KilnProcess], example_repo: Path, tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    server = make_server(
        example_repo, args=["--trace-config", f"triton,file={out}"]
    ).start()  # fmt: skip
    url = f"http://{server.http_url}/v2/trace/setting"
    r = requests.post(url, json={"trace_file": str(tmp_path / "elsewhere")}, timeout=10)
    assert r.status_code == 501  # Status.UNSUPPORTED, as for log_file
    assert "changing trace_file at run time is not supported" in r.json()["error"]
    r = requests.post(url, json={"trace_mode": "opentelemetry"}, timeout=10)
    assert r.status_code == 501 and "trace_mode cannot be changed at run time" in r.json()["error"]
    # the server goes on serving
    client = httpclient.InferenceServerClient(server.http_url)
    assert client.infer("simple", simple_inputs(httpclient)).as_numpy("OUTPUT0") is not None


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("level=TIMESTAMPS", "needs a file to write the traces to"),
        ("rate=sometimes", "'trace_rate' must be an integer from 0 to 4294967295, got 'sometimes'"),
        ("triton,colour=red", "unknown trace setting"),
    ],
)
def test_a_bad_trace_config_stops_kiln_with_the_reason(
    example_repo: Path, flag: str, message: str
) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln",
            "serve",
            "--model-repository",
            str(example_repo),
            "--trace-config",
            flag,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "--trace-config" in proc.stderr and message in proc.stderr
