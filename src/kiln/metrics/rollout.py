"""``kiln_rollout_*`` and ``kiln_shadow_*``: the rollouts' state, read at scrape time; and
``kiln monitor``'s lines for them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rich.text import Text

from kiln.metrics.exposition import counter
from kiln.server.rollout import Rollouts

STATES = ("static", "stepping", "promoted", "rolled_back")


class RolloutCollector(Collector):
    def __init__(self, rollouts: Rollouts) -> None:
        self.rollouts = rollouts

    def collect(self) -> Iterator[Metric]:
        weight = GaugeMetricFamily(
            "kiln_rollout_weight",
            "Weight of a version in its model's split of requests that name no version",
            labels=["model", "version"],
        )
        state = GaugeMetricFamily(
            "kiln_rollout_state", "1 for the rollout's current state", labels=["model", "state"]
        )
        steps = counter("kiln_rollout_steps", "Guarded rollout steps, by result")
        shadow = counter("kiln_shadow_requests", "Shadow copies, by result")
        agree = counter("kiln_shadow_agreement", "Shadow answers that agree with the primary's")
        compared = counter("kiln_shadow_compared", "Shadow answers compared, by kind")
        diff = GaugeMetricFamily(
            "kiln_shadow_max_abs_diff",
            "Largest absolute difference between a shadow's and the primary's outputs",
            labels=["model", "version"],
        )
        delta = GaugeMetricFamily(
            "kiln_shadow_latency_delta_seconds",
            "Mean latency of the shadow minus the primary's, per compared request",
            labels=["model", "version"],
        )
        for model, r in sorted(list(self.rollouts.models.items())):
            for version, w in sorted(dict(r.weights).items()):
                weight.add_metric([model, str(version)], w)
            for s in STATES:
                state.add_metric([model, s], float(r.state == s))
            for result, n in dict(r.steps_total).items():
                steps.add_sample("kiln_rollout_steps_total", {"model": model, "result": result}, n)
            if r.policy.shadow is None:
                continue
            lv = {"model": model, "version": str(r.policy.shadow)}
            st = r.shadow_stats
            for result, n in (("sent", st.sent), ("dropped", st.dropped), ("error", st.errors)):
                shadow.add_sample("kiln_shadow_requests_total", {**lv, "result": result}, n)
            for kind, hit, n in (
                ("exact", st.exact, st.compared),
                ("top1", st.top1, st.top1_compared),
                ("tokens", st.token_agree, st.token_positions),  # LLM output positions
            ):
                agree.add_sample("kiln_shadow_agreement_total", {**lv, "kind": kind}, hit)
                compared.add_sample("kiln_shadow_compared_total", {**lv, "kind": kind}, n)
            diff.add_metric(list(lv.values()), st.max_abs_diff)
            if st.compared:
                delta.add_metric(list(lv.values()), st.latency_delta_sum / st.compared)
        yield from (weight, state, steps, shadow, agree, compared, diff, delta)


def rollouts_text(rollouts: list[dict[str, Any]]) -> Text:
    """``kiln monitor``'s lines for ``/api/live``'s ``rollouts`` (plain text wraps where the
    terminal is narrow: nothing is cut)."""
    text = Text()
    for r in rollouts:
        weights = " ".join(f"v{v}={w:g}" for v, w in r["weights"].items())
        style = {"rolled_back": "bold red", "promoted": "green"}.get(r["state"], "")
        text.append(f"rollout {r['model']}: ", style="bold")
        text.append(r["state"], style=style)
        text.append(f"  {weights}")
        steps = r["steps_total"]
        if r["policy"].get("canary") is not None:
            text.append(f"  steps {steps['step']} promoted {steps['promoted']}")
            text.append(f" rollbacks {steps['rollback']}")
        shadow = r.get("shadow")
        if shadow is not None:
            exact, top1 = shadow["exact_agreement"], shadow["top1_agreement"]
            tokens = shadow.get("token_agreement")
            delta = shadow["mean_latency_delta_s"]
            text.append(
                f"  shadow v{r['policy']['shadow'].split(':')[0]}: sent {shadow['sent']}"
                f" dropped {shadow['dropped']} errors {shadow['errors']}"
                f" exact {'-' if exact is None else f'{exact:.0%}'}"
                f" top1 {'-' if top1 is None else f'{top1:.0%}'}"
                + (f" tokens {tokens:.0%}" if tokens is not None else "")
                + f" max|diff| {shadow['max_abs_diff']:.3g}"
                f" Δlatency {'-' if delta is None else f'{delta * 1e3:+.2f} ms'}"
            )
        if r["events"]:
            text.append(f"\n  last: {r['events'][-1]['result']}: {r['events'][-1]['message']}")
        text.append("\n")
    return text
