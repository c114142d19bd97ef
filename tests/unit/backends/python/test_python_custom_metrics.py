"""Custom metrics of Python models (``pb_utils.MetricFamily``): the worker's store, what the
server reads back, and the collector that merges instances for ``/metrics``."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kiln.backends.python import pb_utils
from kiln.backends.python.custom_metrics import (
    COUNTER,
    GAUGE,
    HISTOGRAM,
    MetricError,
    MetricStore,
    read_store,
)
from kiln.metrics.custom import CustomMetricsCollector
from kiln.metrics.exposition import render


@pytest.fixture
def store(tmp_path: Path) -> MetricStore:
    return MetricStore(tmp_path)


def test_values_written_by_the_worker_read_back_by_the_server(
    store: MetricStore, tmp_path: Path
) -> None:
    store.family("requests_seen", "requests the model saw", COUNTER)
    store.family("queue_depth", "items waiting", GAUGE)
    store.family("token_latency", "seconds per token", HISTOGRAM)
    seen = store.metric("requests_seen", {"model": "m"}, None)
    depth = store.metric("queue_depth", {}, None)
    latency = store.metric("token_latency", {"model": "m"}, [0.1, 0.5])
    store.add(seen, 3)
    store.set(depth, 7.5)
    for value in (0.05, 0.2, 0.3, 2.0):
        store.observe(latency, [0.1, 0.5], value)
    snaps = {s.name: s for s in read_store(tmp_path)}
    assert snaps["requests_seen"].kind == "counter"
    assert snaps["requests_seen"].samples == [({"model": "m"}, 3.0)]
    assert snaps["queue_depth"].samples == [({}, 7.5)]
    ((labels, (buckets, total, count)),) = snaps["token_latency"].samples
    assert labels == {"model": "m"}
    assert buckets == [(0.1, 1.0), (0.5, 3.0), (math.inf, 4.0)]  # cumulative
    assert total == pytest.approx(2.55) and count == 4


def test_the_same_labels_give_the_same_metric_and_many_metrics_grow_the_file(
    store: MetricStore, tmp_path: Path
) -> None:
    store.family("per_user", "one gauge per user", GAUGE)
    assert store.metric("per_user", {"user": "a"}, None) == store.metric(
        "per_user", {"user": "a"}, None
    )
    slots = [store.metric("per_user", {"user": str(i)}, None) for i in range(600)]
    for i, slot in enumerate(slots):
        store.set(slot, i)
    (snap,) = read_store(tmp_path)
    values = {labels["user"]: value for labels, value in snap.samples}
    assert values["599"] == 599 and values["0"] == 0 and len(values) == 601  # with "a"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.family("bad-name", "", COUNTER), "not a valid Prometheus metric name"),
        (lambda s: s.family("nv_inference_count", "", COUNTER), "belong to the server"),
        (lambda s: s.family("x", "", 9), "unknown kind 9"),
        (lambda s: (s.family("x", "a", COUNTER), s.family("x", "a", GAUGE)), "already exists"),
        (lambda s: (s.family("h", "", HISTOGRAM), s.metric("h", {}, None)), "needs its buckets"),
        (lambda s: (s.family("h", "", HISTOGRAM), s.metric("h", {}, [1, 0.5])), "increasing"),
        (lambda s: (s.family("c", "", COUNTER), s.metric("c", {}, [1.0])), "only a histogram"),
        (lambda s: (s.family("c", "", COUNTER), s.metric("c", {"a-b": "1"}, None)), "label"),
    ],
)
def test_bad_families_and_metrics_are_refused_with_the_reason(
    store: MetricStore, call: Any, message: str
) -> None:
    with pytest.raises(MetricError, match=message):
        call(store)


def test_pb_utils_metric_api_as_triton_models_use_it(
    store: MetricStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pb_utils, "_metrics", store)
    family = pb_utils.MetricFamily(
        name="custom_requests", description="requests", kind=pb_utils.MetricFamily.COUNTER
    )
    counter = family.Metric(labels={"model": "m"})
    counter.increment(2)
    counter.increment(1)
    assert counter.value() == 3
    with pytest.raises(pb_utils.TritonModelException, match="cannot decrease"):
        counter.increment(-1)
    with pytest.raises(pb_utils.TritonModelException, match="set\\(\\) is for gauges"):
        counter.set(5)
    gauge = pb_utils.MetricFamily("custom_level", "level", pb_utils.MetricFamily.GAUGE).Metric()
    gauge.set(4)
    gauge.increment(-1.5)
    assert gauge.value() == 2.5
    with pytest.raises(pb_utils.TritonModelException, match="observe\\(\\) is for histograms"):
        gauge.observe(1)
    hist = pb_utils.MetricFamily("custom_h", "h", pb_utils.MetricFamily.HISTOGRAM)
    metric = hist.Metric(labels={}, buckets=[1.0])
    metric.observe(0.5)
    with pytest.raises(pb_utils.TritonModelException, match="value\\(\\) is for counters"):
        metric.value()
    with pytest.raises(pb_utils.TritonModelException, match="not a valid Prometheus"):
        pb_utils.MetricFamily("1bad", "", pb_utils.MetricFamily.GAUGE)


def _runtime(*folders: Path) -> Any:
    instances = [
        SimpleNamespace(backend=SimpleNamespace(custom_metrics=lambda f=f: read_store(f)))
        for f in folders
    ]
    return SimpleNamespace(scheduler=SimpleNamespace(instances=instances))


def test_the_collector_adds_up_instances_and_renders_valid_text(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    stores = [MetricStore(a), MetricStore(b)]
    for i, s in enumerate(stores):
        s.family("custom_seen", "requests seen", COUNTER)
        s.add(s.metric("custom_seen", {"model": "m"}, None), 2 + i)
        s.family("custom_latency", "seconds", HISTOGRAM)
        s.observe(s.metric("custom_latency", {}, [0.5]), [0.5], 0.25 * (i + 1))
    collector = CustomMetricsCollector(lambda: [_runtime(a, b), SimpleNamespace(scheduler=None)])
    text = render(collector.collect()).decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    (seen,) = parsed["custom_seen"].samples
    assert seen.labels == {"model": "m"} and seen.value == 5
    values = {(s.name, s.labels.get("le")): s.value for s in parsed["custom_latency"].samples}
    assert values[("custom_latency_bucket", "0.5")] == 2
    assert values[("custom_latency_bucket", "+Inf")] == 2
    assert values[("custom_latency_count", None)] == 2
    assert values[("custom_latency_sum", None)] == 0.75
    assert "# TYPE custom_latency histogram" in text


def test_a_restarted_worker_starts_with_no_metrics(store: MetricStore, tmp_path: Path) -> None:
    """As Triton's stub: the new worker's model registers its metrics again."""
    store.family("custom_seen", "seen", COUNTER)
    store.add(store.metric("custom_seen", {}, None), 4)
    assert [s.name for s in read_store(tmp_path)] == ["custom_seen"]
    MetricStore(tmp_path)  # what the restarted worker does first
    assert read_store(tmp_path) == []


def test_a_folder_not_written_yet_reads_as_no_metrics(tmp_path: Path) -> None:
    assert read_store(tmp_path / "missing") == []
