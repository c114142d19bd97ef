"""The rollout policy (server/rollout.py, rollout_policy.py, rollout_shadow.py) without a
server: parsing and its errors, the weighted draw against binomial bounds with a seeded RNG,
sticky hashing, the guard's verdicts on recorded outcomes, and the shadow comparison."""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import replace

import numpy as np
import pytest

from kiln.core.errors import KilnError, Status
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    InferOutput,
)
from kiln.server.rollout import ModelRollout, _Window, sticky_point
from kiln.server.rollout_policy import parse_policy
from kiln.server.rollout_shadow import ShadowStats, compare_outputs


def _rollout(fields: dict[str, str], loaded: set[int] = {1, 2, 3}, seed: int = 0) -> ModelRollout:  # noqa: B006
    policy = parse_policy("m", fields, loaded)
    assert policy is not None
    r = ModelRollout("m", policy, "api", random.Random(seed))
    r.set_versions(sorted(loaded))
    return r


def test_no_fields_is_no_policy() -> None:
    assert parse_policy("m", {}, {1}) is None
    assert parse_policy("m", {"traffic_split": " "}, {1}) is None


@pytest.mark.parametrize(
    ("fields", "field", "words"),
    [
        ({"traffic_split": "1:0,2:0"}, "traffic_split", "sum to a positive"),
        ({"traffic_split": "1:-1,2:5"}, "traffic_split", "negative weight"),
        ({"traffic_split": "1:90,9:10"}, "traffic_split", "version 9, which is not loaded"),
        ({"traffic_split": "1=90"}, "traffic_split", "not version:weight"),
        ({"traffic_split": "1:x"}, "traffic_split", "not a number"),
        ({"traffic_split": "1:nan"}, "traffic_split", "not a finite number"),
        ({"traffic_split": "1:1,1:2"}, "traffic_split", "twice"),
        ({"shadow": "7"}, "shadow", "version 7, which is not loaded"),
        ({"shadow": "2:1.5"}, "shadow", "fraction"),
        ({"canary": "5", "steps": "10"}, "canary", "not loaded"),
        ({"steps": "10,50"}, "steps", "'canary'"),
        ({"canary": "2", "steps": "50,10"}, "steps", "rising"),
        ({"canary": "2", "steps": "10", "max_p99_ratio": "abc"}, "max_p99_ratio", "number"),
        ({"canary": "2", "steps": "10", "max_p99_ratio": "0"}, "max_p99_ratio", "> 0"),
        ({"max_error_rate_delta": "0.1"}, "max_error_rate_delta", "canary"),
        (
            {"canary": "2", "steps": "10", "max_error_rate_delta": "3"},
            "max_error_rate_delta",
            "[0, 1]",
        ),
        ({"canary": "2", "steps": "10", "interval_secs": "-1"}, "interval_secs", ">= 0"),
        ({"sticky_key": "header"}, "sticky_key", "parameter:NAME"),
        # client-chosen sizes are bounded: a queue of copies, a step list, the guard's pace
        ({"shadow": "2", "shadow_queue_size": "1e9"}, "shadow_queue_size", "at most 4096"),
        ({"canary": "2", "steps": ",".join(["1"] * 101)}, "steps", "at most 100"),
        ({"canary": "2", "steps": "10", "interval_secs": "1e-9"}, "interval_secs", "0.25 s"),
        ({"weights": "1:1"}, "weights", "unknown"),
    ],
)
def test_bad_fields_name_model_and_field(fields: dict[str, str], field: str, words: str) -> None:
    with pytest.raises(KilnError) as err:
        parse_policy("m", fields, {1, 2, 3})
    assert err.value.status is Status.INVALID_ARG
    assert f"model 'm': rollout field '{field}'" in err.value.message
    assert words in err.value.message


def _within(count: int, n: int, p: float, sigmas: float = 4.0) -> bool:
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_split_ratios_within_binomial_bounds() -> None:
    r = _rollout({"traffic_split": "1:70,2:20,3:10"}, seed=1234)
    n = 2000
    picks = [r.pick({}, lambda v: True) for _ in range(n)]
    for version, p in ((1, 0.7), (2, 0.2), (3, 0.1)):
        assert _within(picks.count(version), n, p), (version, picks.count(version))


def test_a_version_not_ready_gets_nothing() -> None:
    r = _rollout({"traffic_split": "1:50,2:50"})
    assert {r.pick({}, lambda v: v != 2) for _ in range(200)} == {1}
    assert r.pick({}, lambda v: False) is None  # the caller falls back to the latest


def test_sticky_key_same_user_same_version_users_spread() -> None:
    r = _rollout({"traffic_split": "1:50,2:50", "sticky_key": "parameter:user_id"})
    for user in ("alice", "bob", "u-17"):
        assert len({r.pick({"user_id": user}, lambda v: True) for _ in range(50)}) == 1
    n = 1000
    picks = [r.pick({"user_id": f"user-{i}"}, lambda v: True) for i in range(n)]
    assert _within(picks.count(1), n, 0.5)
    # no key: a draw, as without stickiness
    assert len({r.pick({}, lambda v: True) for _ in range(100)}) == 2


def test_sticky_point_is_stable_across_processes() -> None:
    # blake2b, not Python's salted hash: a fixed value, the same in every process
    assert (
        sticky_point("alice")
        == int.from_bytes(__import__("hashlib").blake2b(b"alice", digest_size=8).digest(), "big")
        / 2**64
    )
    assert 0 <= sticky_point("") < 1


def _feed(r: ModelRollout, version: int, n: int, secs: float, ok: bool, t: float) -> None:
    for _ in range(n):
        r.windows.setdefault(version, _Window()).add(t, secs, ok)


def test_guard_steps_up_then_promotes() -> None:
    r = _rollout(
        {"canary": "2", "primary": "1", "steps": "10,50", "interval_secs": "10",
         "min_requests": "5", "max_error_rate_delta": "0.1", "max_p99_ratio": "2"}
    )  # fmt: skip
    assert r.weights == {2: 10.0, 1: 90.0}
    _feed(r, 1, 20, 0.010, True, 104.0)
    _feed(r, 2, 20, 0.012, True, 104.0)
    assert r.evaluate(105.0, 100.0) == ""  # the interval has not passed
    assert r.evaluate(111.0, 100.0) == "step"
    assert r.weights == {2: 50.0, 1: 50.0}
    _feed(r, 1, 20, 0.010, True, 115.0)
    _feed(r, 2, 20, 0.012, True, 115.0)
    assert r.evaluate(118.0, 111.0) == ""  # samples older than the window (10 s) are gone
    assert r.evaluate(122.0, 111.0) == "promoted"
    assert r.weights == {2: 100.0, 1: 0.0} and r.state == "promoted" and not r.guarded
    assert r.steps_total == {"promoted": 1, "step": 1, "rollback": 0}


def test_guard_holds_without_enough_canary_requests() -> None:
    r = _rollout({"canary": "2", "steps": "10,50", "interval_secs": "1", "min_requests": "5"})
    _feed(r, 2, 4, 0.01, True, 100.0)
    assert r.evaluate(100.5, 0.0) == ""
    assert r.weights[2] == 10.0


def test_guard_rolls_back_on_errors_at_once() -> None:
    r = _rollout(
        {"canary": "2", "primary": "1", "steps": "10,50", "interval_secs": "60",
         "min_requests": "5", "max_error_rate_delta": "0.1"}
    )  # fmt: skip
    _feed(r, 1, 20, 0.01, True, 100.0)
    _feed(r, 2, 5, 0.01, False, 100.0)
    assert r.evaluate(101.0, 100.0) == "rollback"  # before the interval ends
    assert r.weights == {2: 0.0, 1: 100.0} and r.state == "rolled_back"
    assert "error rate" in r.events[-1]["message"]


def test_guard_rolls_back_on_p99() -> None:
    r = _rollout(
        {"canary": "2", "primary": "1", "steps": "10", "interval_secs": "60",
         "min_requests": "5", "max_p99_ratio": "1.5"}
    )  # fmt: skip
    _feed(r, 1, 20, 0.010, True, 100.0)
    _feed(r, 2, 20, 0.050, True, 100.0)
    assert r.evaluate(101.0, 100.0) == "rollback"
    assert "p99" in r.events[-1]["message"]


def _response(**outputs: np.ndarray) -> InferenceResponse:
    return InferenceResponse(
        "m", "1", outputs=[InferOutput(k, DataType.FP32, v.shape, v) for k, v in outputs.items()]
    )


def test_compare_exact_top1_and_max_abs_diff() -> None:
    stats = ShadowStats()
    a = np.array([[0.1, 0.9], [0.8, 0.2]], dtype=np.float32)
    compare_outputs(_response(y=a), _response(y=a.copy()), stats)
    b = a + np.float32(0.05)  # same argmax, not equal
    compare_outputs(_response(y=a), _response(y=b), stats)
    c = a[:, ::-1].copy()  # argmax flips
    compare_outputs(_response(y=a), _response(y=c), stats)
    assert (stats.compared, stats.exact, stats.top1, stats.top1_compared) == (0, 1, 2, 3)
    assert stats.max_abs_diff == pytest.approx(0.8, abs=1e-6)  # 0.9 - 0.1


def test_monitor_lines_keep_names_whole_at_80_columns() -> None:
    from rich.console import Console

    from kiln.metrics.rollout import rollouts_text

    r = _rollout({"canary": "2", "primary": "1", "steps": "10,50", "shadow": "3"})
    r.shadow_stats.compared = r.shadow_stats.sent = r.shadow_stats.exact = 4
    r._rollback("canary error rate 0.500 exceeds the primary's 0.000 by more than 0.1")
    console = Console(width=80, record=True, force_terminal=False)
    console.print(rollouts_text([r.to_json()]))
    out = console.export_text()
    assert "rollout m: rolled_back" in out and "v1=100 v2=0" in out
    assert "exact 100%" in out and "rollbacks 1" in out
    assert all(len(line) <= 80 for line in out.splitlines())


def test_shadow_queue_drops_when_full_copies_inputs_and_keeps_outputs() -> None:
    async def main() -> ModelRollout:
        gate = asyncio.Event()

        async def infer(req: InferenceRequest) -> InferenceResponse:
            assert req.model_version == "3"
            await gate.wait()
            return _response(y=req.inputs[0].data)

        r = _rollout({"traffic_split": "1:1", "shadow": "3", "shadow_queue_size": "1"})
        r.start(infer)
        x = np.ones(2, np.float32)
        req = InferenceRequest("m", "", inputs=[InferInput("x", DataType.FP32, (2,), x)])
        resp = _response(y=x.copy())
        for _ in range(4):  # no await between: the worker has taken none yet
            r.offer_shadow(req, 1, resp, 0.001)
        r.offer_shadow(req, 3, resp, 0.001)  # served by the shadow itself: no copy
        r.offer_shadow(replace(req, parameters={"sequence_id": 7}), 1, resp, 0.001)
        x[:] = 5  # the caller's buffer is reused
        resp.outputs = []  # the server replaces the list (classification)
        gate.set()
        while r.shadow_stats.compared < 1:
            await asyncio.sleep(0.01)
        r.stop()
        return r

    stats = asyncio.run(main()).shadow_stats
    assert (stats.sent, stats.dropped, stats.compared, stats.exact) == (1, 3, 1, 1)


def test_guard_rolls_back_when_an_alert_fires_for_the_canary() -> None:
    from kiln.monitoring.alerts import AlertEvaluator
    from kiln.monitoring.notify import Notifier, WebhookOptions
    from kiln.monitoring.rules import parse_rules
    from kiln.monitoring.snapshot import Snapshot

    rules = parse_rules(
        "groups:\n  - name: g\n    rules:\n      - alert: CanaryFails\n"
        "        expr: nv_inference_request_failure > 0\n",
        "r.yaml",
    )
    alerts = AlertEvaluator(rules, lambda: Snapshot(0, {}), Notifier(WebhookOptions()), 1, "")
    r = _rollout({"canary": "2", "primary": "1", "steps": "10,50", "interval_secs": "60"})
    r.alert_firing = alerts.firing
    failures = {"nv_inference_request_failure": {(("model", "m"), ("version", "1")): 3.0}}
    alerts.evaluate_once(Snapshot(1_700_000_000, failures))
    assert alerts.firing("m", 1) == "CanaryFails" and alerts.firing("m", 2) is None
    assert r.evaluate(100.0, 100.0) == ""  # the primary's alert is not the canary's
    failures = {"nv_inference_request_failure": {(("model", "m"), ("version", "2")): 1.0}}
    alerts.evaluate_once(Snapshot(1_700_000_001, failures))
    assert r.evaluate(100.5, 100.0) == "rollback"
    assert r.weights == {2: 0.0, 1: 100.0}
    assert r.events[-1]["message"] == "alert 'CanaryFails' is firing for version 2"


def test_llm_outputs_are_compared_token_by_token() -> None:
    from kiln.server.rollout_shadow import ShadowStats, compare_tokens

    stats = ShadowStats()
    compare_tokens({0: [1, 2, 3]}, {0: [1, 2, 3]}, stats)
    assert (stats.exact, stats.token_agree, stats.token_positions) == (1, 3, 3)
    # a shorter or diverging answer: positions up to the longer output, equal ones counted
    compare_tokens({0: [1, 2, 3, 4]}, {0: [1, 9, 3]}, stats)
    assert (stats.exact, stats.token_agree, stats.token_positions) == (1, 5, 7)
    # n = 2: every sample compared; a missing sample agrees on nothing
    compare_tokens({0: [5], 1: [6, 7]}, {0: [5]}, stats)
    assert (stats.exact, stats.token_agree, stats.token_positions) == (1, 6, 10)
    assert stats.to_json()["token_agreement"] == 0.6
