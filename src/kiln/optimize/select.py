"""Pick the deployment: the best accepted candidate under the latency budget, by objective.

- ``latency``: lowest p50 at the smallest batch size; the budget bounds p99 at that size.
- ``throughput``: highest throughput at any batch size whose p99 is within the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.optimize.types import Objective, Result


@dataclass(slots=True)
class Selection:
    chosen: Result | None
    closest: Result | None  # when nothing qualifies: what came nearest, and why it missed
    why: str


def _best_batch(result: Result, budget_ms: float | None) -> tuple[int, float] | None:
    assert result.profile is not None
    fits = [b for b in result.profile.batches if budget_ms is None or b.p99_ms <= budget_ms]
    if not fits:
        return None
    best = max(fits, key=lambda b: b.throughput)
    return best.batch_size, best.throughput


def select(results: list[Result], objective: Objective, budget_ms: float | None) -> Selection:
    profiled = [r for r in results if r.status == "accepted" and r.profile is not None]
    if not profiled:
        judged = [r for r in results if r.accuracy is not None]
        closest = min(judged, key=lambda r: r.accuracy.drop if r.accuracy else 0.0, default=None)
        return Selection(None, closest, "no candidate passed the accuracy guard")
    smallest = min(b.batch_size for b in profiled[0].profile.batches)  # type: ignore[union-attr]

    def p99(r: Result) -> float:
        assert r.profile is not None
        return r.profile.at(smallest).p99_ms

    if objective == "latency":
        within = [r for r in profiled if budget_ms is None or p99(r) <= budget_ms]
        for r in profiled:
            if r not in within:
                r.status, r.reason = (
                    "over-budget",
                    (
                        f"p99 {p99(r):.3f} ms at batch {smallest} exceeds the "
                        f"{budget_ms} ms latency budget"
                    ),
                )
        if within:
            best = min(within, key=lambda r: r.profile.at(smallest).p50_ms)  # type: ignore[union-attr]
            p50 = best.profile.at(smallest).p50_ms  # type: ignore[union-attr]
            return Selection(best, None, f"lowest p50 latency at batch {smallest}: {p50:.3f} ms")
    else:
        scored = {r.candidate.name: _best_batch(r, budget_ms) for r in profiled}
        within = [r for r in profiled if scored[r.candidate.name] is not None]
        for r in profiled:
            if r not in within:
                r.status, r.reason = (
                    "over-budget",
                    (f"no batch size keeps p99 within the {budget_ms} ms latency budget"),
                )
        if within:
            best = max(within, key=lambda r: scored[r.candidate.name][1])  # type: ignore[index]
            size, rate = scored[best.candidate.name]  # type: ignore[misc]
            return Selection(best, None, f"highest throughput: {rate:.0f}/s at batch {size}")
    closest = min(profiled, key=p99)
    return Selection(
        None,
        closest,
        f"no accurate candidate meets the {budget_ms} ms latency budget "
        f"(closest: {closest.candidate.name}, p99 {p99(closest):.3f} ms at batch {smallest})",
    )
