"""/metrics of a real ``kiln serve`` moves with tritonclient requests."""

from __future__ import annotations

import urllib.request

import numpy as np
import tritonclient.http as httpclient
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import KilnProcess


def _scrape(server: KilnProcess) -> tuple[str, dict[str, float]]:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        text = resp.read().decode()
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("model") == "simple" and "le" not in s.labels:
                key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()))
                values[key] = s.value
    return text, values


SUCCESS = "nv_inference_request_success_total,model=simple,version=1"
COUNT = "nv_inference_count_total,model=simple,version=1"
LATENCY = "kiln_request_duration_seconds_count,model=simple,version=1"


def test_counts_move_with_requests(kiln_server: KilnProcess) -> None:
    text, before = _scrape(kiln_server)
    assert '\nnv_inference_request_success{model="simple",version="1"} ' in text
    a = np.ones((2, 16), dtype=np.int32)
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    for binary in (True, False):
        inputs = [httpclient.InferInput(n, [2, 16], "INT32") for n in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(a, binary_data=binary)
        client.infer("simple", inputs)
    _, after = _scrape(kiln_server)
    assert after[SUCCESS] - before[SUCCESS] == 2
    assert after[COUNT] - before[COUNT] == 4  # batch 2 counts 2 inferences
    assert after[LATENCY] - before[LATENCY] == 2
