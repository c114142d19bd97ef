"""Triton's ``opentelemetry`` trace mode on a real ``kiln serve``: spans exported by the
OpenTelemetry SDK's OTLP/HTTP exporter to a receiver started here (an HTTP server that
decodes the OTLP protobuf), from requests sent with tritonclient carrying a client's W3C
``traceparent``."""

from __future__ import annotations

import gzip
import json
import shutil
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess
from tests.integration.test_tracing import simple_inputs

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ECHO_CONFIG = """
name: "context_echo"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "CONTEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
"""
ECHO_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for request in requests:
            context = request.trace().get_context() or ""
            tensor = pb_utils.Tensor("CONTEXT", np.array([context.encode()], dtype=object))
            out.append(pb_utils.InferenceResponse([tensor]))
        return out
"""
CLIENT_SPAN = "00f067aa0ba902b7"


class Receiver:
    """An OTLP/HTTP trace receiver: ``POST /v1/traces`` with an ExportTraceServiceRequest."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.resources: list[dict[str, str]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver.take(request, self.path)
                out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def take(self, request: Any, path: str) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                self.resources.append(attrs)
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        self.spans.append(
                            {
                                "path": path,
                                "name": span.name,
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "start": span.start_time_unix_nano,
                                "end": span.end_time_unix_nano,
                                "events": [e.name for e in span.events],
                                "attributes": {
                                    a.key: getattr(a.value, a.value.WhichOneof("value"))
                                    for a in span.attributes
                                },
                            }
                        )

    def wait_for(self, count: int, timeout: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.spans) >= count:
                    return list(self.spans)
            time.sleep(0.05)
        with self.lock:
            raise AssertionError(f"{len(self.spans)} spans after {timeout}s: {self.spans}")

    def close(self) -> None:
        self.server.shutdown()


@pytest.fixture
def repo(example_repo: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "repo"
    shutil.copytree(example_repo, copy)
    (copy / "context_echo" / "1").mkdir(parents=True)
    (copy / "context_echo" / "config.pbtxt").write_text(ECHO_CONFIG)
    (copy / "context_echo" / "1" / "model.py").write_text(ECHO_MODEL)
    return copy


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _traceparent(span: str = CLIENT_SPAN) -> dict[str, str]:
    return {"traceparent": f"00-{TRACE_ID}-{span}-01"}


def _children(spans: list[dict[str, Any]], parent: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in spans if s["parent"] == parent["span_id"]]


def test_spans_follow_the_client_s_trace_context(
    make_server: type[KilnProcess], repo: Path, receiver: Receiver
) -> None:
    flags = ["mode=opentelemetry", "level=TIMESTAMPS", "rate=0",
             f"opentelemetry,url=127.0.0.1:{receiver.port}",
             "opentelemetry,resource=service.name=kiln-test",
             "opentelemetry,bsp_schedule_delay=100"]  # fmt: skip
    server = make_server(repo, args=[arg for f in flags for arg in ("--trace-config", f)]).start()
    http = httpclient.InferenceServerClient(server.http_url)
    # rate 0: only requests carrying a client's context are traced
    http.infer("simple", simple_inputs(httpclient), request_id="untraced")
    http.infer("simple", simple_inputs(httpclient), request_id="h1", headers=_traceparent())
    spans = receiver.wait_for(3)
    assert {s["path"] for s in spans} == {"/v1/traces"}
    assert {"service.name": "kiln-test"}.items() <= receiver.resources[0].items()

    [root] = [s for s in spans if s["name"] == "InferRequest"]
    assert root["trace_id"] == TRACE_ID and root["parent"] == CLIENT_SPAN
    assert root["events"] == ["HTTP_RECV_START", "HTTP_RECV_END", "HTTP_SEND_START",
                              "HTTP_SEND_END"]  # fmt: skip
    [model] = _children(spans, root)
    assert model["name"] == "simple" and model["trace_id"] == TRACE_ID
    assert model["attributes"]["triton.model_name"] == "simple"
    assert model["attributes"]["triton.model_version"] == 1
    assert model["attributes"]["triton.request_id"] == "h1"
    assert model["events"] == ["REQUEST_START", "QUEUE_START", "INFER_RESPONSE_COMPLETE",
                               "REQUEST_END"]  # fmt: skip
    [compute] = _children(spans, model)
    assert compute["name"] == "compute"
    assert compute["events"] == ["COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START",
                                 "COMPUTE_END"]  # fmt: skip
    # nested in time as in the tree, on the wall clock
    assert root["start"] <= model["start"] <= compute["start"] <= compute["end"]
    assert compute["end"] <= model["end"] <= root["end"]
    assert abs(root["start"] - time.time_ns()) < 60e9

    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    grpc.infer("simple", simple_inputs(grpcclient), headers=_traceparent("00f067aa0ba902b8"))
    image = httpclient.InferInput("IMAGE", [1, 28, 28, 1], "UINT8")
    image.set_data_from_numpy(np.full((1, 28, 28, 1), 7, np.uint8))
    http.infer("python_pipeline", [image], headers=_traceparent("00f067aa0ba902b9"))
    # gRPC: root, model, compute; ensemble: root, its model span, 3 x (model + compute)
    spans = receiver.wait_for(3 + 3 + 8)
    [grpc_root] = [s for s in spans if s["parent"] == "00f067aa0ba902b8"]
    assert grpc_root["events"][0] == "GRPC_WAITREAD_START"
    assert grpc_root["events"][-1] == "GRPC_SEND_END"
    [ensemble_root] = [s for s in spans if s["parent"] == "00f067aa0ba902b9"]
    [ensemble] = _children(spans, ensemble_root)
    assert ensemble["name"] == "python_pipeline" and not _children(
        [s for s in spans if s["name"] == "compute"], ensemble
    )
    steps = _children(spans, ensemble)
    assert sorted(s["name"] for s in steps) == ["cnn", "postprocess", "python_preprocess"]
    for step in steps:
        assert (
            step["attributes"]["triton.trace_parent_id"]
            == ensemble["attributes"]["triton.trace_id"]
        )
        assert [c["name"] for c in _children(spans, step)] == ["compute"]
        assert ensemble["start"] <= step["start"] <= step["end"] <= ensemble["end"]
    assert not [s for s in spans if s["attributes"].get("triton.request_id") == "untraced"]

    # a Python model sees its span's context (request.trace().get_context())
    x = httpclient.InferInput("X", [1], "INT32")
    x.set_data_from_numpy(np.array([1], np.int32))
    result = http.infer("context_echo", [x], headers=_traceparent("00f067aa0ba902ba"))
    context = json.loads(result.as_numpy("CONTEXT")[0])
    spans = receiver.wait_for(3 + 3 + 8 + 3)
    [echo] = [s for s in spans if s["name"] == "context_echo"]
    assert context["traceparent"] == f"00-{TRACE_ID}-{echo['span_id']}-01"
    no_context = http.infer("context_echo", [x])  # not traced (rate 0): no context
    assert no_context.as_numpy("CONTEXT")[0] == b""

    # as in Triton, the settings of this mode are fixed at start-up
    with pytest.raises(InferenceServerException, match="opentelemetry"):
        http.update_trace_settings(settings={"trace_rate": "1"})
    assert http.get_trace_settings()["trace_mode"] == "opentelemetry"
    assert server.stop() == 0


def test_sampled_requests_are_exported_when_the_server_stops(
    make_server: type[KilnProcess], example_repo: Path, receiver: Receiver
) -> None:
    flags = ["mode=opentelemetry", "level=TIMESTAMPS", "rate=2",
             f"opentelemetry,url=http://127.0.0.1:{receiver.port}/v1/traces"]  # fmt: skip
    server = make_server(
        example_repo, args=[arg for f in flags for arg in ("--trace-config", f)]
    ).start()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    for i in range(4):
        client.infer("simple", simple_inputs(grpcclient), request_id=f"r{i}")
    assert receiver.spans == []  # the batch processor's default delay is 5 s
    assert server.stop() == 0  # ... and stopping exports what is queued
    roots = [s for s in receiver.wait_for(6, timeout=5) if s["name"] == "InferRequest"]
    assert len(roots) == 2  # every 2nd request
    assert len({s["trace_id"] for s in roots}) == 2  # each its own trace
    models = [s for s in receiver.spans if s["name"] == "simple"]
    assert sorted(m["attributes"]["triton.request_id"] for m in models) == ["r1", "r3"]


class GrpcReceiver(Receiver):
    """An OTLP/gRPC trace receiver (TraceService/Export), vLLM's default transport."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

        self.spans, self.resources, self.lock = [], [], threading.Lock()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver.take(request, "grpc")
                return trace_service_pb2.ExportTraceServiceResponse()

        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.grpc_server)
        self.port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        self.grpc_server.start()

    def close(self) -> None:
        self.grpc_server.stop(0)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_vllms_otlp_traces_endpoint_traces_every_request(
    make_server: type[KilnProcess],
    repo: Path,
    protocol: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--otlp-traces-endpoint``, as vLLM: every request, no client context needed, over
    OTLP/gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` says HTTP; a --trace-config
    setting given as well wins (here the export delay)."""
    receiver = GrpcReceiver() if protocol == "grpc" else Receiver()
    try:
        if protocol != "grpc":
            monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
        args = ["--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}",
                "--trace-config", "opentelemetry,bsp_schedule_delay=100"]  # fmt: skip
        server = make_server(repo, args=args).start()
        http = httpclient.InferenceServerClient(server.http_url)
        for i in range(2):
            http.infer("simple", simple_inputs(httpclient), request_id=f"r{i}")
        spans = receiver.wait_for(6)  # root, model, compute for each
        assert {s["path"] for s in spans} == {"grpc" if protocol == "grpc" else "/v1/traces"}
        models = [s for s in spans if s["name"] == "simple"]
        assert sorted(m["attributes"]["triton.request_id"] for m in models) == ["r0", "r1"]
        assert len({s["trace_id"] for s in spans}) == 2
    finally:
        receiver.close()


def test_a_bad_otlp_protocol_is_refused(make_server: type[KilnProcess], repo: Path) -> None:
    server = make_server(repo, args=["--trace-config", "mode=opentelemetry",
                                     "--trace-config", "opentelemetry,protocol=udp"])  # fmt: skip
    server.start(wait_ready=False)
    assert server.proc is not None and server.proc.wait(60) != 0
    assert "protocol must be one of http/protobuf, grpc" in server.log()
