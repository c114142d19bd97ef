"""A real Prometheus server scrapes kiln; its HTTP API returns kiln's figures.

Needs the Debian package ``prometheus`` (installed by ``scripts/system-deps.sh``).
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import KilnProcess, free_port

PROMETHEUS = Path("/usr/bin/prometheus")
REQUESTS = 7


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def _start_prometheus(tmp_path: Path, config: Path, port: int) -> subprocess.Popen[bytes]:
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [
            str(PROMETHEUS),
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    return proc


@contextlib.contextmanager
def _scraping(
    tmp_path: Path, kiln: KilnProcess
) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """A Prometheus scraping ``kiln`` every second: (its base URL, the process, its log)."""
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: kiln\n"
        "    scrape_interval: 1s\n"
        "    scrape_timeout: 1s\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{kiln.metrics_port}']\n"
    )
    proc = _start_prometheus(tmp_path, config, port)
    try:
        yield f"http://127.0.0.1:{port}", proc, tmp_path / "prometheus.log"
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait(
    predicate: Any, timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}:\n{log.read_text()}")
        result = predicate()
        if result is not None:
            return result
        time.sleep(0.25)
    raise TimeoutError(f"{what} not seen within {timeout}s:\n{log.read_text()[-3000:]}")


def _query(base: str, promql: str) -> list[dict[str, Any]] | None:
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        body = _get_json(url)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None
    assert body["status"] == "success", body
    return body["data"]["result"]  # type: ignore[no-any-return]


def _infer(server: KilnProcess, n: int) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    for _ in range(n):
        inputs = [
            httpclient.InferInput("INPUT0", [1, 16], "INT32"),
            httpclient.InferInput("INPUT1", [1, 16], "INT32"),
        ]
        for i in inputs:
            i.set_data_from_numpy(a)
        client.infer("simple", inputs)


def _histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's interpolation, computed from kiln's own exposition for comparison."""
    buckets = sorted(buckets)
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def test_prometheus_scrapes_kiln_counts_and_latency_histogram(
    example_repo: Path, make_server: type[KilnProcess], tmp_path: Path
) -> None:
    kiln = make_server(example_repo, args=["--metrics-interval-ms", "200"]).start()
    with _scraping(tmp_path, kiln) as (base, proc, log):
        # Prometheus is up and has scraped kiln at least once (count 0) before requests.
        _wait(
            lambda: _query(base, 'nv_inference_count{model="simple"}') or None,
            60,
            "first scrape",
            proc,
            log,
        )
        _infer(kiln, REQUESTS)

        def count_reached() -> list[dict[str, Any]] | None:
            result = _query(base, 'nv_inference_count{model="simple",version="1"}')
            if result and float(result[0]["value"][1]) == REQUESTS:
                return result
            return None

        result = _wait(count_reached, 30, f"nv_inference_count == {REQUESTS}", proc, log)
        assert result[0]["metric"]["job"] == "kiln"
        assert result[0]["metric"]["__name__"] == "nv_inference_count"
        success = _query(base, 'nv_inference_request_success{model="simple"}')
        assert success and float(success[0]["value"][1]) == REQUESTS

        # p99 from kiln's latency histogram, through PromQL, equals the same interpolation
        # done on kiln's own /metrics (the counts no longer move).
        promql = (
            "histogram_quantile(0.99, sum by (le) "
            '(kiln_request_duration_seconds_bucket{model="simple"}))'
        )
        p99 = _query(base, promql)
        assert p99, promql
        with urllib.request.urlopen(kiln.metrics_url, timeout=5) as resp:
            fams = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
        buckets = [
            (float(s.labels["le"]), s.value)
            for s in fams["kiln_request_duration_seconds"].samples
            if s.name.endswith("_bucket") and s.labels["model"] == "simple"
        ]
        assert buckets[-1][1] == REQUESTS
        expected = _histogram_quantile(0.99, buckets)
        assert expected > 0
        assert math.isclose(float(p99[0]["value"][1]), expected, rel_tol=1e-9)


METRICS_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        labels = {"model": args["model_name"]}
        self.seen = pb_utils.MetricFamily(
            name="custom_requests_seen", description="requests this model saw",
            kind=pb_utils.MetricFamily.COUNTER).Metric(labels=labels)
        self.size = pb_utils.MetricFamily(
            name="custom_input_size", description="elements per request",
            kind=pb_utils.MetricFamily.HISTOGRAM).Metric(labels=labels, buckets=[2, 8, 32])

    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            self.seen.increment(1)
            self.size.observe(x.size)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return responses
"""

METRICS_CONFIG = """
name: "py_metrics"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""


def test_prometheus_scrapes_a_python_model_s_custom_metrics(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    """``pb_utils.MetricFamily`` counters and histograms reach Prometheus like kiln's own."""
    repo = tmp_path / "models"
    (repo / "py_metrics" / "1").mkdir(parents=True)
    (repo / "py_metrics" / "1" / "model.py").write_text(METRICS_MODEL)
    (repo / "py_metrics" / "config.pbtxt").write_text(METRICS_CONFIG)
    kiln = make_server(repo).start()
    client = httpclient.InferenceServerClient(kiln.http_url)
    for size in (1, 4, 4, 16, 64):
        x = httpclient.InferInput("X", [size], "FP32")
        x.set_data_from_numpy(np.ones(size, np.float32))
        assert client.infer("py_metrics", [x]).as_numpy("Y").shape == (size,)
    with _scraping(tmp_path, kiln) as (base, proc, log):

        def value(promql: str) -> float | None:
            result = _query(base, promql)
            return float(result[0]["value"][1]) if result else None

        seen = _wait(
            lambda: value('custom_requests_seen{model="py_metrics",job="kiln"}'),
            60,
            "custom_requests_seen",
            proc,
            log,
        )
        assert seen == 5
        assert value('custom_input_size_count{model="py_metrics"}') == 5
        assert value('custom_input_size_sum{model="py_metrics"}') == 89
        assert value('custom_input_size_bucket{model="py_metrics",le="8"}') == 3
        assert value('custom_input_size_bucket{model="py_metrics",le="+Inf"}') == 5
