"""/metrics text from a real in-process Server: Triton's exact names, counts that move."""

from __future__ import annotations

import re
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kiln.core.stats import FailureReason, ModelStats, RequestTimes, failure_reason
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.metrics.app import MetricsOptions, MetricsService
from kiln.metrics.config import MetricsConfig
from kiln.metrics.exposition import counter, render
from kiln.server.server import Server, ServerOptions

TRITON_COUNTERS = [
    "nv_inference_request_success",
    "nv_inference_request_failure",
    "nv_inference_count",
    "nv_inference_exec_count",
    "nv_inference_request_duration_us",
    "nv_inference_queue_duration_us",
    "nv_inference_compute_input_duration_us",
    "nv_inference_compute_infer_duration_us",
    "nv_inference_compute_output_duration_us",
    "nv_cache_num_hits_per_model",
    "nv_cache_num_misses_per_model",
    "nv_cache_hit_duration_per_model",
    "nv_cache_miss_duration_per_model",
]
TRITON_GAUGES = ["nv_inference_pending_request_count", "nv_model_load_duration_secs"]
SUMMARIES = [
    f"nv_inference_{p}_summary_us"
    for p in ("request", "queue", "compute_input", "compute_infer", "compute_output")
]

Start = Callable[..., Awaitable[tuple[Server, MetricsService]]]


@pytest.fixture
def simple_repo(example_repo: Path, tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    shutil.copytree(example_repo / "simple", repo / "simple")
    return repo


async def _serve(repo: Path, config: MetricsConfig) -> tuple[Server, MetricsService]:
    server = Server(ServerOptions([repo]))
    service = MetricsService(server, MetricsOptions(config, allow_gpu=False))
    service.start()  # binds the observer factory before models load, as launch.py does
    await server.start()
    return server, service


@pytest.fixture
async def serving(simple_repo: Path) -> AsyncIterator[Start]:
    started: list[tuple[Server, MetricsService]] = []

    async def start(*entries: str) -> tuple[Server, MetricsService]:
        pair = await _serve(simple_repo, MetricsConfig.parse(entries))
        started.append(pair)
        return pair

    yield start
    for server, service in started:
        await server.stop()
        service.stop()
    ModelStats.observer_factory = None


def _request(batch: int) -> InferenceRequest:
    a = np.arange(16 * batch, dtype=np.int32).reshape(batch, 16)
    return InferenceRequest(
        "simple",
        inputs=[
            InferInput("INPUT0", DataType.INT32, a.shape, a),
            InferInput("INPUT1", DataType.INT32, a.shape, a),
        ],
    )


def _families(text: str) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def _value(families: dict[str, Metric], sample: str, **labels: str) -> float:
    for s in (s for f in families.values() for s in f.samples):
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    raise KeyError(f"{sample}{labels}")


async def test_counters_use_tritons_exact_names_without_total(serving: Start) -> None:
    server, service = await serving()
    await server.infer(_request(1))
    text = service.render().decode()
    for name in TRITON_COUNTERS:
        assert f"# TYPE {name} counter\n" in text
        assert re.search(rf"^{name}\{{model=\"simple\",version=\"1\"", text, re.M), name
    for name in TRITON_GAUGES:
        assert f"# TYPE {name} gauge\n" in text
    assert "_total{" not in text.replace("process_cpu_seconds_total", "")
    reasons = re.findall(r'^nv_inference_request_failure\{.*reason="(\w+)"\} 0$', text, re.M)
    assert sorted(reasons) == ["BACKEND", "CANCELED", "OTHER", "REJECTED"]


async def test_counts_move_with_requests(serving: Start) -> None:
    server, service = await serving()
    before = _families(service.render().decode())
    assert _value(before, "nv_inference_request_success_total", model="simple") == 0
    for batch in (1, 4, 1):
        await server.infer(_request(batch))
    after = _families(service.render().decode())
    # The parser re-adds "_total" to counter samples; the raw text above has none.
    assert _value(after, "nv_inference_request_success_total", model="simple") == 3
    assert _value(after, "nv_inference_count_total", model="simple") == 6
    assert _value(after, "nv_inference_exec_count_total", model="simple") == 3
    assert _value(after, "nv_inference_request_duration_us_total", model="simple") > 0
    assert _value(after, "kiln_request_duration_seconds_count", model="simple") == 3
    assert _value(after, "kiln_request_duration_seconds_bucket", le="+Inf") == 3
    assert _value(after, "kiln_batch_size_bucket", le="1") == 2
    assert _value(after, "kiln_batch_size_bucket", le="4") == 3
    assert _value(after, "kiln_batch_size_sum", model="simple") == 6
    # Latency histogram buckets are cumulative and end at the request count.
    buckets = [
        s.value
        for s in after["kiln_request_duration_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert buckets == sorted(buckets) and buckets[-1] == 3


async def test_failures_are_counted_per_reason(serving: Start) -> None:
    server, service = await serving()
    stats = server.model("simple").stats
    for reason in (FailureReason.REJECTED, FailureReason.BACKEND, FailureReason.BACKEND):
        stats.record_failure(RequestTimes(received=0), 1000, reason)
    fams = _families(service.render().decode())
    got = {
        s.labels["reason"]: s.value
        for s in fams["nv_inference_request_failure"].samples
        if s.labels["model"] == "simple"
    }
    assert got == {"REJECTED": 1, "BACKEND": 2, "CANCELED": 0, "OTHER": 0}
    assert _value(fams, "nv_inference_request_success_total", model="simple") == 0


def test_failure_reason_maps_kiln_errors() -> None:
    from kiln.core.errors import KilnError, Status

    assert failure_reason(KilnError("x", Status.CANCELLED)) is FailureReason.CANCELED
    assert failure_reason(KilnError("x", Status.UNAVAILABLE)) is FailureReason.REJECTED
    assert failure_reason(KilnError("x", Status.INTERNAL)) is FailureReason.BACKEND
    assert failure_reason(RuntimeError("onnx")) is FailureReason.BACKEND
    assert failure_reason(KilnError("x", Status.INVALID_ARG)) is FailureReason.OTHER


async def test_summaries_and_first_response_histogram_are_opt_in(serving: Start) -> None:
    server, service = await serving()
    await server.infer(_request(1))
    text = service.render().decode()
    for name in [*SUMMARIES, "nv_inference_first_response_histogram_ms"]:
        assert name not in text

    server, service = await serving(
        "summary_latencies=true", "summary_quantiles=0.5:0.05,0.99:0.001", "histogram_latencies=1"
    )
    for _ in range(5):
        await server.infer(_request(1))
    text = service.render().decode()
    fams = _families(text)
    for name in SUMMARIES:
        assert f"# TYPE {name} summary\n" in text
        quantiles = {s.labels["quantile"] for s in fams[name].samples if "quantile" in s.labels}
        assert quantiles == {"0.5", "0.99"}
        assert _value(fams, f"{name}_count", model="simple") == 5
    p50 = _value(fams, "nv_inference_request_summary_us", quantile="0.5")
    p99 = _value(fams, "nv_inference_request_summary_us", quantile="0.99")
    assert 0 < p50 <= p99
    assert _value(fams, "nv_inference_first_response_histogram_ms_count", model="simple") == 5
    les = [
        s.labels["le"]
        for s in fams["nv_inference_first_response_histogram_ms"].samples
        if s.name.endswith("_bucket")
    ]
    assert les == ["100", "500", "2000", "5000", "+Inf"]  # Triton's default buckets


async def test_counter_latencies_false_drops_duration_counters(serving: Start) -> None:
    server, service = await serving("counter_latencies=false")
    await server.infer(_request(1))
    text = service.render().decode()
    assert "nv_inference_request_duration_us" not in text
    assert "nv_inference_queue_duration_us" not in text
    assert "nv_inference_request_success{" in text


async def test_custom_latency_buckets(serving: Start) -> None:
    server, service = await serving("latency_buckets=0.001,0.5,60")
    await server.infer(_request(1))
    fams = _families(service.render().decode())
    les = [
        s.labels["le"]
        for s in fams["kiln_request_duration_seconds"].samples
        if s.name.endswith("_bucket")
    ]
    assert les == ["0.001", "0.5", "60", "+Inf"]


async def test_process_and_host_metrics_are_exposed(serving: Start) -> None:
    _, service = await serving()
    fams = _families(service.render().decode())
    assert _value(fams, "process_resident_memory_bytes") > 0
    assert _value(fams, "process_cpu_seconds_total") > 0
    assert 0.0 <= _value(fams, "nv_cpu_utilization") <= 1.0
    total = _value(fams, "nv_cpu_memory_total_bytes")
    assert 0 < _value(fams, "nv_cpu_memory_used_bytes") <= total


def test_render_keeps_total_only_where_samples_have_it() -> None:
    ours = counter("nv_x", "help with \\ and\nnewline")
    ours.add_sample("nv_x", {"model": 'a"b'}, 2)
    theirs = Metric("process_cpu_seconds", "cpu", "counter")
    theirs.add_sample("process_cpu_seconds_total", {}, 1.5)
    text = render([ours, theirs]).decode()
    assert text == (
        "# HELP nv_x help with \\\\ and\\nnewline\n"
        "# TYPE nv_x counter\n"
        'nv_x{model="a\\"b"} 2\n'
        "# HELP process_cpu_seconds_total cpu\n"
        "# TYPE process_cpu_seconds_total counter\n"
        "process_cpu_seconds_total 1.5\n"
    )
    parsed = _families(text)
    assert parsed["nv_x"].samples[0].labels == {"model": 'a"b'}
