"""Triton-named Prometheus families, read from the runtimes' statistics at scrape time.

Nothing is counted twice: the statistics extension and /metrics read the same counters,
and the hot path pays for them once.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.core.server import Server


class ServerCollector(Collector):
    def __init__(self, server: Server) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        labels = ["model", "version"]
        fams = {
            "success": CounterMetricFamily(
                "nv_inference_request_success",
                "Number of successful inference requests",
                labels=labels,
            ),
            "count": CounterMetricFamily(
                "nv_inference_count",
                "Number of inferences performed (batch N counts N)",
                labels=labels,
            ),
            "exec": CounterMetricFamily(
                "nv_inference_exec_count", "Number of model executions performed", labels=labels
            ),
            "duration": CounterMetricFamily(
                "nv_inference_request_duration_us",
                "Cumulative inference request duration",
                labels=labels,
            ),
            "queue": CounterMetricFamily(
                "nv_inference_queue_duration_us",
                "Cumulative inference queuing duration",
                labels=labels,
            ),
            "input": CounterMetricFamily(
                "nv_inference_compute_input_duration_us",
                "Cumulative compute input duration",
                labels=labels,
            ),
            "infer": CounterMetricFamily(
                "nv_inference_compute_infer_duration_us",
                "Cumulative compute inference duration",
                labels=labels,
            ),
            "output": CounterMetricFamily(
                "nv_inference_compute_output_duration_us",
                "Cumulative compute output duration",
                labels=labels,
            ),
        }
        failure = CounterMetricFamily(
            "nv_inference_request_failure",
            "Number of failed inference requests",
            labels=[*labels, "reason"],
        )
        pending = GaugeMetricFamily(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution",
            labels=labels,
        )
        load = GaugeMetricFamily(
            "nv_model_load_duration_secs", "Model load time in seconds", labels=labels
        )
        for rt in self.server.repository.runtimes():
            lv = [rt.name, rt.version_str]
            s = rt.stats
            fams["success"].add_metric(lv, s.success.count)
            fams["count"].add_metric(lv, s.inference_count)
            fams["exec"].add_metric(lv, s.execution_count)
            fams["duration"].add_metric(lv, (s.success.ns + s.fail.ns) // 1000)
            fams["queue"].add_metric(lv, s.queue.ns // 1000)
            fams["input"].add_metric(lv, s.compute_input.ns // 1000)
            fams["infer"].add_metric(lv, s.compute_infer.ns // 1000)
            fams["output"].add_metric(lv, s.compute_output.ns // 1000)
            failure.add_metric([*lv, "BACKEND"], s.fail.count)
            pending.add_metric(lv, rt.scheduler.pending if rt.scheduler else 0)
            load.add_metric(lv, rt.load_seconds)
        yield from fams.values()
        yield failure
        yield pending
        yield load
