"""vLLM's ``vllm:*`` families on a real ``kiln serve`` with a random-weight LLM, driven by
the real ``openai`` client: every family with vLLM's type, labels and buckets, and values
that agree with the usage the responses report; then a real Prometheus scraping kiln
evaluates the LLM alert rules of ``deploy/prometheus``."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.llm.stats import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS  # noqa: E402
from tests.conftest import KilnProcess, free_port  # noqa: E402
from tests.integration.deploy_helpers import metric_names_in, scrape_names  # noqa: E402
from tests.integration.test_prometheus import (  # noqa: E402
    _get_json,
    _query,
    _start_prometheus,
    _wait,
)
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402

CONFIG = llm_config(
    block_size="4", max_num_seqs="8", num_gpu_blocks="96", enable_prefix_caching="true"
)
ROOT = Path(__file__).resolve().parents[2]
DEPLOY_RULES = ROOT / "deploy" / "prometheus" / "kiln-alerts.yml"
IGNORE_EOS = {"ignore_eos": True}
# vLLM's v1 families (prometheus_client's family names: counters without ``_total``)
GAUGES = {
    "num_requests_running", "num_requests_waiting", "num_requests_waiting_by_reason",
    "engine_sleep_state", "kv_cache_usage_perc", "cache_config_info",
}  # fmt: skip
COUNTERS = {
    "prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
    "prompt_tokens_by_source", "prompt_tokens_cached", "prompt_tokens_cached_by_source",
    "generation_tokens", "request_success", "admission_rejections",
}  # fmt: skip
PER_REQUEST = (  # one observation per finished request
    "time_to_first_token_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_inference_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens",
    "request_generation_tokens", "request_prefill_kv_computed_tokens",
    "request_max_num_generation_tokens", "request_params_n", "request_params_max_tokens",
    "request_num_preemptions",
)  # fmt: skip
HISTOGRAMS = {*PER_REQUEST, "inter_token_latency_seconds", "iteration_tokens_total"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _families(server: KilnProcess) -> dict[str, Any]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}


def _value(families: dict[str, Any], sample: str, **labels: str) -> float:
    family = sample.removesuffix("_total").removesuffix("_bucket")
    family = family.removesuffix("_count").removesuffix("_sum")
    found = [
        s.value
        for s in families[family].samples
        if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (sample, labels, found)
    return float(found[0])


def _grew(before: dict[str, Any], after: dict[str, Any], sample: str, **labels: str) -> float:
    return _value(after, sample, **labels) - _value(before, sample, **labels)


def _les(families: dict[str, Any], name: str) -> list[str]:
    return [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]


def test_families_carry_vllms_names_types_labels_and_buckets(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body=IGNORE_EOS)
    families = _families(server)
    expected = {
        **{f"vllm:{n}": "gauge" for n in GAUGES},
        **{f"vllm:{n}": "counter" for n in COUNTERS},
        **{f"vllm:{n}": "histogram" for n in HISTOGRAMS},
    }
    assert {name: families[name].type for name in expected if name in families} == expected
    for family in families.values():
        for s in family.samples:
            assert s.labels["model_name"] == "tiny", s
            # vLLM's frontend counts admission refusals: no engine label, as vLLM's
            engine = None if family.name == "vllm:admission_rejections" else "0"
            assert s.labels.get("engine") == engine, s
    refused = {s.labels["reason"]: s.value for s in families["vllm:admission_rejections"].samples}
    assert refused == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
    tiers = {s.labels["source"] for s in families["vllm:prompt_tokens_cached_by_source"].samples}
    assert tiers == {"device", "host", "p2p", "disk", "external_unspecified"}
    reasons = {s.labels["finished_reason"] for s in families["vllm:request_success"].samples}
    assert reasons == {"stop", "length", "abort", "error"}
    sources = {s.labels["source"] for s in families["vllm:prompt_tokens_by_source"].samples}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}
    floats = lambda bounds: [repr(float(b)) for b in bounds] + ["+Inf"]  # noqa: E731
    assert _les(families, "vllm:time_to_first_token_seconds") == floats(TTFT_BUCKETS)
    assert _les(families, "vllm:inter_token_latency_seconds") == floats(ITL_BUCKETS)
    assert _les(families, "vllm:e2e_request_latency_seconds") == floats(REQUEST_BUCKETS)
    # token counts: vLLM's 1-2-5 series up to max_model_len (the model's 256 positions)
    assert _les(families, "vllm:request_prompt_tokens") == floats((1, 2, 5, 10, 20, 50, 100, 200))
    assert _les(families, "vllm:request_params_n") == floats((1, 2, 5, 10, 20))
    assert _les(families, "vllm:request_num_preemptions") == floats((1, 2, 3, 4, 5, 10, 20))
    [info] = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert (info.labels["block_size"], info.labels["num_gpu_blocks"]) == ("4", "96")
    assert info.labels["kv_cache_size_tokens"] == "384"
    assert info.labels["enable_prefix_caching"] == "True"
    assert _value(families, "vllm:engine_sleep_state", sleep_state="awake") == 1


def test_switched_families_follow_vllms_switches_when_they_are_off(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    """Without --kv-cache-metrics, VLLM_COMPUTE_NANS_IN_LOGITS and a tool-call parser vLLM
    has no residency histograms, no corrupted_requests, no parser counter; its MFU counters
    exist (its logger creates them always) and stay 0 without --enable-mfu-metrics."""
    client.completions.create(model="tiny", prompt="hello", max_tokens=2, extra_body=IGNORE_EOS)
    families = _families(server)
    absent = {"vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
              "vllm:kv_block_reuse_gap_seconds", "vllm:corrupted_requests",
              "vllm:tool_call_parser_invocations"}  # fmt: skip
    assert absent.isdisjoint(families)
    for name in ("estimated_flops_per_gpu", "estimated_read_bytes_per_gpu",
                 "estimated_write_bytes_per_gpu"):  # fmt: skip
        assert families[f"vllm:{name}"].type == "counter"
        assert _value(families, f"vllm:{name}_total", model_name="tiny", engine="0") == 0


def test_values_agree_with_the_usage_of_the_responses(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    before = _families(server)
    usages: list[tuple[int, int, int]] = []  # (prompt, completion, max_tokens)
    for prompt, max_tokens in (("the quick brown fox", 5), ("a sequence of tokens", 3)):
        done = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=max_tokens, extra_body=IGNORE_EOS
        )
        assert done.choices[0].finish_reason == "length" and done.usage is not None
        usages.append((done.usage.prompt_tokens, done.usage.completion_tokens, max_tokens))
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=4,
        extra_body=IGNORE_EOS,
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    usages.append((chat.usage.prompt_tokens, chat.usage.completion_tokens, 4))
    after = _families(server)
    grew = lambda sample, **labels: _grew(before, after, sample, **labels)  # noqa: E731
    requests = len(usages)
    prompt = sum(p for p, _, _ in usages)
    generated = sum(c for _, c, _ in usages)
    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:generation_tokens_total") == generated
    assert grew("vllm:request_success_total", finished_reason="length") == requests
    for reason in ("stop", "abort", "error"):
        assert grew("vllm:request_success_total", finished_reason=reason) == 0
    for name in PER_REQUEST:
        assert grew(f"vllm:{name}_count") == requests, name
        assert grew(f"vllm:{name}_bucket", le="+Inf") == requests, name
    assert grew("vllm:inter_token_latency_seconds_count") == generated - requests
    assert grew("vllm:request_prompt_tokens_sum") == prompt
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_max_num_generation_tokens_sum") == generated
    assert grew("vllm:request_params_max_tokens_sum") == sum(m for _, _, m in usages)
    assert grew("vllm:request_params_n_sum") == requests
    cached = grew("vllm:prompt_tokens_cached_total")
    assert grew("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    hits = grew("vllm:prefix_cache_hits_total")
    assert grew("vllm:prompt_tokens_cached_by_source_total", source="device") == hits
    assert grew("vllm:prompt_tokens_cached_by_source_total", source="host") == 0
    assert grew("vllm:request_num_preemptions_sum") == 0  # the cache had room for all
    assert grew("vllm:prompt_tokens_by_source_total", source="local_compute") == prompt - cached
    assert grew("vllm:request_prefill_kv_computed_tokens_sum") == prompt - cached
    # every scheduled token: the prompts not found in the cache, then one per later token
    assert grew("vllm:iteration_tokens_total_sum") == prompt - cached + generated - requests
    assert grew("vllm:iteration_tokens_total_count") > 0
    assert _value(after, "vllm:num_requests_running") == 0
    assert _value(after, "vllm:num_requests_waiting") == 0
    assert _value(after, "vllm:kv_cache_usage_perc") == 0
    assert _value(after, "vllm:time_to_first_token_seconds_sum") > 0


def test_request_success_counts_stop_strings_and_aborts(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="hello world", temperature=0)
    text = client.completions.create(max_tokens=12, extra_body=IGNORE_EOS, **kw).choices[0].text
    stop = text[len(text) // 4 : len(text) // 4 + 2]  # greedy again: it reappears early on
    before = _families(server)
    done = client.completions.create(max_tokens=40, stop=[stop], extra_body=IGNORE_EOS, **kw)
    assert done.choices[0].finish_reason == "stop" and done.usage is not None
    stream = client.completions.create(
        model="tiny", prompt="a long story", max_tokens=200, stream=True, extra_body=IGNORE_EOS
    )
    for _ in stream:
        break  # the first chunk, then the client leaves: the engine aborts the request
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _families(server)
        if _grew(before, after, "vllm:request_success_total", finished_reason="abort"):
            break
        time.sleep(0.1)
    grew = lambda sample, **labels: _grew(before, after, sample, **labels)  # noqa: E731
    assert grew("vllm:request_success_total", finished_reason="stop") == 1
    assert grew("vllm:request_success_total", finished_reason="abort") == 1
    assert grew("vllm:request_success_total", finished_reason="length") == 0
    assert grew("vllm:e2e_request_latency_seconds_count") == 2
    # the engine may sample a few tokens before the stop string's abort reaches it
    assert grew("vllm:generation_tokens_total") >= done.usage.completion_tokens
    assert _value(after, "vllm:num_requests_running") == 0


def test_the_helm_charts_llm_autoscaling_metric_is_exported(server: KilnProcess) -> None:
    """The Prometheus Adapter rule behind the chart's ``targetLLMRequestsWaitingPerPod``
    reads a series this server exports."""
    rules = yaml.safe_load((ROOT / "deploy" / "helm" / "kiln" / "adapter-rules.yaml").read_text())
    [rule] = [r for r in rules["rules"] if r["name"]["as"] == "vllm_num_requests_waiting"]
    names = metric_names_in(rule["seriesQuery"]) | metric_names_in(rule["metricsQuery"])
    assert names == {"vllm:num_requests_waiting"}
    assert names <= scrape_names(server.metrics_url)


def test_the_llm_alert_rules_name_only_exported_series(server: KilnProcess) -> None:
    scraped = scrape_names(server.metrics_url)
    doc = yaml.safe_load(DEPLOY_RULES.read_text())
    llm = [r for g in doc["groups"] for r in g["rules"] if r["alert"].startswith("KilnLLM")]
    assert len(llm) == 4
    for rule in llm:
        names = metric_names_in(str(rule["expr"]))
        assert names and names <= scraped, (rule["alert"], names - scraped)


def test_prometheus_evaluates_the_llm_alert_rules(
    server: KilnProcess, client: openai.OpenAI, tmp_path: Path
) -> None:
    """Prometheus loads deploy/prometheus's rules and, with the TTFT rule's threshold at 0,
    fires it for the model from kiln's scraped histogram."""
    doc = yaml.safe_load(DEPLOY_RULES.read_text())
    [ttft] = [r for g in doc["groups"] for r in g["rules"]
              if r.get("alert") == "KilnLLMTimeToFirstTokenHigh"]  # fmt: skip
    assert str(ttft["expr"]).endswith(" > 2")
    eager = {**ttft, "alert": "TestTtftAboveZero", "expr": ttft["expr"][: -len("2")] + "0"}
    eager["for"] = "0s"
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump({"groups": [{"name": "test", "rules": [eager]}]}))
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files: ['{DEPLOY_RULES}', '{rules}']\n"
        "scrape_configs:\n"
        "  - job_name: kiln\n"
        "    scrape_interval: 1s\n"
        "    scrape_timeout: 1s\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{server.metrics_port}']\n"
    )
    port = free_port()
    base, log = f"http://127.0.0.1:{port}", tmp_path / "prometheus.log"
    proc = _start_prometheus(tmp_path, config, port)
    try:
        _wait(
            lambda: _query(base, 'vllm:num_requests_running{model_name="tiny"}') or None,
            60, "first scrape", proc, log,
        )  # fmt: skip

        def firing() -> list[dict[str, Any]] | None:
            # first tokens keep arriving while Prometheus scrapes: rate() sees them
            client.completions.create(
                model="tiny", prompt="hello", max_tokens=2, extra_body=IGNORE_EOS
            )
            alerts = _get_json(f"{base}/api/v1/alerts")["data"]["alerts"]
            hit = [a for a in alerts if a["labels"]["alertname"] == "TestTtftAboveZero"]
            return hit if hit and hit[0]["state"] == "firing" else None

        [alert] = _wait(firing, 60, "the TTFT alert firing", proc, log)
        assert alert["labels"]["model_name"] == "tiny"
        assert 0 < float(alert["value"]) < 2  # the tiny model answers in well under 2 s
        groups = _get_json(f"{base}/api/v1/rules")["data"]["groups"]
        health = {r["name"]: r["health"] for g in groups for r in g["rules"]}
        llm = {name: h for name, h in health.items() if name.startswith("KilnLLM")}
        assert llm == dict.fromkeys(
            ("KilnLLMTimeToFirstTokenHigh", "KilnLLMKVCachePressure", "KilnLLMPreemptions",
             "KilnLLMWaitingQueueHigh"), "ok",
        )  # fmt: skip
        firing_now = {a["labels"]["alertname"] for a in _get_json(f"{base}/api/v1/alerts")[
            "data"]["alerts"]}  # fmt: skip
        assert not firing_now & set(llm)  # the real thresholds: a healthy model is quiet
    finally:
        proc.terminate()
        proc.wait(15)
