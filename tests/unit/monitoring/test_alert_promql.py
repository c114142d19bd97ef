"""The PromQL subset of alert rules: parsing, errors with positions, PromQL semantics."""

from __future__ import annotations

import math
import re

import pytest

from kiln.monitoring.promql import ExprError, parse, parse_duration
from kiln.monitoring.promql_eval import evaluate, histogram_quantile
from kiln.monitoring.rules import default_rules
from kiln.monitoring.snapshot import Labels, Snapshot

MLP: Labels = (("model", "mlp"), ("version", "1"))
CNN: Labels = (("model", "cnn"), ("version", "1"))


def snap(ts: float, **metrics: dict[Labels, float]) -> Snapshot:
    return Snapshot(ts, dict(metrics))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("5m", 300), ("1h30m", 5400), ("250ms", 0.25), ("1d", 86400), ("2w", 1209600)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["5", "5 m", "1.5m", "m", "-5m", "5min", ""])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("expr", "message", "pos"),
    [
        ("nv_inference_cnt > 1", "unknown metric 'nv_inference_cnt'", 0),
        ("rate(nv_inference_count) > 1", "needs one range selector", 0),
        ("rate(nv_inference_count[5x]) > 1", "invalid duration '5x'", 23),
        ("irate(nv_inference_count[5m])", "unknown function 'irate'", 0),
        ('nv_inference_count{model=~"m.*"}', "matcher '=~' is not supported", 24),
        ("nv_inference_count >", "expected a metric, number or function", 20),
        ("(nv_inference_count > 1", "expected ')'", 23),
        ("nv_inference_count / on(model) nv_inference_exec_count", "'on' is not supported", 21),
        ("nv_inference_count $ 2", "unexpected character '$'", 19),
    ],
)
def test_parse_errors(expr: str, message: str, pos: int) -> None:
    with pytest.raises(ExprError, match=re.escape(message)) as info:
        parse(expr)
    assert info.value.pos == pos


def test_threshold_filters_and_keeps_value() -> None:
    w = [snap(0, kiln_gpu_temperature_celsius={(("gpu_uuid", "a"),): 90, (("gpu_uuid", "b"),): 60})]
    assert evaluate(parse("kiln_gpu_temperature_celsius > 85"), w) == {(("gpu_uuid", "a"),): 90}
    assert evaluate(parse("85 < kiln_gpu_temperature_celsius"), w) == {(("gpu_uuid", "a"),): 90}
    assert evaluate(parse('kiln_gpu_temperature_celsius{gpu_uuid!="a"} > 0'), w) == {
        (("gpu_uuid", "b"),): 60
    }


def test_rate_increase_and_counter_reset() -> None:
    w = [
        snap(0, nv_inference_count={MLP: 10}),
        snap(10, nv_inference_count={MLP: 30}),
        snap(20, nv_inference_count={MLP: 5}),  # restarted: counts from zero again
    ]
    assert evaluate(parse("increase(nv_inference_count[1m])"), w) == {MLP: 25}
    assert evaluate(parse("rate(nv_inference_count[1m])"), w) == {MLP: 25 / 20}
    # the window (5s) holds one sample only: no rate, as in Prometheus
    assert evaluate(parse("rate(nv_inference_count[5s])"), w) == {}


def test_ratio_sum_by_and_vector_matching() -> None:
    fail = {
        (("model", "mlp"), ("reason", "BACKEND"), ("version", "1")): 3.0,
        (("model", "mlp"), ("reason", "REJECTED"), ("version", "1")): 1.0,
    }
    w = [
        snap(
            0,
            nv_inference_request_failure={k: 0.0 for k in fail},
            nv_inference_request_success={MLP: 0, CNN: 0},
        ),
        snap(
            10, nv_inference_request_failure=fail, nv_inference_request_success={MLP: 36, CNN: 10}
        ),
    ]
    expr = parse(
        "sum by (model, version) (rate(nv_inference_request_failure[1m]))"
        " / (sum by (model, version) (rate(nv_inference_request_success[1m]))"
        " + sum by (model, version) (rate(nv_inference_request_failure[1m]))) > 0.05"
    )
    # cnn has no failure series: no match, no alert (PromQL one-to-one matching)
    assert evaluate(expr, w) == {MLP: pytest.approx(0.1)}


def test_division_by_zero_is_nan_or_inf_and_never_fires() -> None:
    w = [
        snap(
            0,
            nv_gpu_memory_used_bytes={(): 0.0, (("g", "1"),): 5.0},
            nv_gpu_memory_total_bytes={(): 0.0, (("g", "1"),): 0.0},
        )
    ]
    result = evaluate(parse("nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes"), w)
    assert isinstance(result, dict)
    assert math.isnan(result[()]) and result[(("g", "1"),)] == math.inf
    assert evaluate(parse("nv_gpu_memory_used_bytes / nv_gpu_memory_total_bytes < 1"), w) == {}


def test_and_unless_or() -> None:
    w = [
        snap(
            0,
            kiln_model_ready={MLP: 0, CNN: 1},
            nv_inference_pending_request_count={MLP: 4, CNN: 9},
        )
    ]
    pending, ready = "nv_inference_pending_request_count", "kiln_model_ready"
    assert evaluate(parse(f"{pending} and {ready} == 0"), w) == {MLP: 4}
    assert evaluate(parse(f"{pending} unless {ready} == 0"), w) == {CNN: 9}
    assert evaluate(parse(f"{ready} == 0 or {pending} > 5"), w) == {MLP: 0, CNN: 9}


def _buckets(counts: list[float]) -> dict[Labels, float]:
    bounds = ["0.1", "0.5", "1", "+Inf"]
    return {(*MLP[:1], ("le", le), *MLP[1:]): c for le, c in zip(bounds, counts, strict=True)}


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # 100 observations: 50 <= 0.1, 40 in (0.1, 0.5], 10 in (0.5, 1]
    result = histogram_quantile(0.5, _buckets([50, 90, 100, 100]))
    assert result == {MLP: pytest.approx(0.1)}
    assert histogram_quantile(0.7, _buckets([50, 90, 100, 100]))[MLP] == pytest.approx(0.3)
    assert histogram_quantile(0.99, _buckets([50, 90, 100, 100]))[MLP] == pytest.approx(0.95)
    # the rank falls in +Inf: the highest finite bound
    assert histogram_quantile(0.99, _buckets([0, 0, 0, 10]))[MLP] == 1.0
    assert math.isnan(histogram_quantile(0.5, _buckets([0, 0, 0, 0]))[MLP])


def test_histogram_quantile_over_a_rate_window() -> None:
    name = "kiln_request_duration_seconds_bucket"
    w = [
        snap(0, **{name: _buckets([100, 100, 100, 100])}),
        snap(10, **{name: _buckets([100, 100, 200, 200])}),
    ]
    expr = parse(f"histogram_quantile(0.5, sum by (model, version, le) (rate({name}[1m])))")
    # in the window every new request fell in (0.5, 1]: the median is its middle
    assert evaluate(expr, w) == {MLP: pytest.approx(0.75)}


def test_rules_may_name_the_llm_engine_series() -> None:
    tiny: Labels = (("model_name", "tiny"),)
    usage = parse("vllm:kv_cache_usage_perc > 0.9")
    assert evaluate(usage, [snap(0, **{"vllm:kv_cache_usage_perc": {tiny: 0.95}})]) == {tiny: 0.95}
    name = "vllm:time_to_first_token_seconds_bucket"
    fast, inf = (("le", "0.1"), *tiny), (("le", "+Inf"), *tiny)
    ttft = [snap(0, **{name: {fast: 0, inf: 0}}), snap(10, **{name: {fast: 4, inf: 4}})]
    p99 = parse(f"histogram_quantile(0.99, sum by (model_name, le) (rate({name}[1m])))")
    assert evaluate(p99, ttft) == {tiny: pytest.approx(0.099)}


def test_the_llm_default_rules_fire_on_llm_trouble_only() -> None:
    rules = {r.name: r.expr for r in default_rules() if r.name.startswith("KilnLLM")}
    tiny: Labels = (("engine", "0"), ("model_name", "tiny"))
    model: Labels = (("model_name", "tiny"),)

    def window(slow: bool, usage: float, preempted: float, waiting: float) -> list[Snapshot]:
        # 30 first tokens in a minute, all within 0.5 s, or all in (2.5 s, 5 s]
        def at(ts: float, n: float) -> Snapshot:
            fast = 0 if slow else n
            counts = {"0.5": fast, "2.5": fast, "5.0": n, "+Inf": n}
            buckets = {(*tiny, ("le", le)): c for le, c in counts.items()}
            return snap(
                ts,
                **{
                    "vllm:time_to_first_token_seconds_bucket": buckets,
                    "vllm:kv_cache_usage_perc": {tiny: usage},
                    "vllm:num_preemptions_total": {tiny: preempted * ts},
                    "vllm:num_requests_waiting": {tiny: waiting},
                },
            )

        return [at(0, 0), at(60, 30)]

    calm = window(False, usage=0.3, preempted=0, waiting=2)
    assert all(evaluate(expr, calm) == {} for expr in rules.values())
    trouble = window(True, usage=0.95, preempted=0.5, waiting=25)
    fired = {name: evaluate(expr, trouble) for name, expr in rules.items()}
    assert fired["KilnLLMTimeToFirstTokenHigh"] == {model: pytest.approx(4.975)}
    assert fired["KilnLLMKVCachePressure"] == {tiny: 0.95}
    assert fired["KilnLLMPreemptions"] == {model: pytest.approx(0.5)}
    assert fired["KilnLLMWaitingQueueHigh"] == {model: 25}
