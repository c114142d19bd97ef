"""``kiln_rollout_*`` and ``kiln_shadow_*``: the rollouts' state, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

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
            ):
                agree.add_sample("kiln_shadow_agreement_total", {**lv, "kind": kind}, hit)
                compared.add_sample("kiln_shadow_compared_total", {**lv, "kind": kind}, n)
            diff.add_metric(list(lv.values()), st.max_abs_diff)
            if st.compared:
                delta.add_metric(list(lv.values()), st.latency_delta_sum / st.compared)
        yield from (weight, state, steps, shadow, agree, compared, diff, delta)
