"""Evaluate a parsed rule expression over a window of snapshots.

Semantics follow PromQL where the subset overlaps: series match on identical label sets,
a comparison filters (keeps the left-hand value), ``x/0`` is ``+Inf`` and ``0/0`` is NaN
(and NaN compares false), ``histogram_quantile`` interpolates linearly inside a bucket.
One difference, documented in docs/monitoring.md: ``rate``/``increase`` use the first and
last sample inside the window without Prometheus's extrapolation to the window's edges.
"""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Sequence

from kiln.monitoring.promql import Aggregate, Call, Expr, Number, Selector
from kiln.monitoring.snapshot import Labels, Snapshot

Vector = dict[Labels, float]
Value = float | Vector

_ARITH: dict[str, Callable[[float, float], float]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
}
_CMP: dict[str, Callable[[float, float], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    ">": operator.gt,
    "<": operator.lt,
    ">=": operator.ge,
    "<=": operator.le,
}

_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "avg": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
    "count": lambda xs: float(len(xs)),
}


def _div(a: float, b: float) -> float:
    if b == 0:
        if a == 0 or math.isnan(a):
            return math.nan
        return math.copysign(math.inf, a)
    return a / b


def evaluate(expr: Expr, window: Sequence[Snapshot]) -> Value:
    """``window``: snapshots oldest first; the last one is "now"."""
    if isinstance(expr, Number):
        return expr.value
    if isinstance(expr, Selector):
        if not window:
            return {}
        return {
            labels: v
            for labels, v in window[-1].series(expr.metric).items()
            if _matches(labels, expr)
        }
    if isinstance(expr, Call):
        return _call(expr, window)
    if isinstance(expr, Aggregate):
        inner = evaluate(expr.expr, window)
        if not isinstance(inner, dict):
            raise ValueError(f"{expr.op}() needs a vector")
        return _aggregate(expr, inner)
    return _binary(expr.op, evaluate(expr.lhs, window), evaluate(expr.rhs, window))


def _matches(labels: Labels, sel: Selector) -> bool:
    d = dict(labels)
    return all((d.get(k, "") == v) == (op == "=") for k, op, v in sel.matchers)


def _ranges(sel: Selector, window: Sequence[Snapshot]) -> dict[Labels, list[tuple[float, float]]]:
    if not window or sel.range_s is None:
        return {}
    start = window[-1].ts - sel.range_s
    out: dict[Labels, list[tuple[float, float]]] = {}
    for snap in window:
        if snap.ts <= start:
            continue
        for labels, v in snap.series(sel.metric).items():
            if _matches(labels, sel):
                out.setdefault(labels, []).append((snap.ts, v))
    return out


def _increase(points: list[tuple[float, float]]) -> float:
    total = 0.0
    for (_, prev), (_, cur) in itertools.pairwise(points):
        total += cur - prev if cur >= prev else cur  # a counter reset (restart) starts at 0
    return total


def _call(expr: Call, window: Sequence[Snapshot]) -> Vector:
    if expr.func == "histogram_quantile":
        q = expr.args[0]
        assert isinstance(q, Number)
        buckets = evaluate(expr.args[1], window)
        if not isinstance(buckets, dict):
            raise ValueError("histogram_quantile needs a vector of buckets")
        return histogram_quantile(q.value, buckets)
    sel = expr.args[0]
    assert isinstance(sel, Selector)
    out: Vector = {}
    for labels, pts in _ranges(sel, window).items():
        if expr.func.endswith("_over_time"):
            values = [v for _, v in pts]
            out[labels] = _REDUCE[expr.func.split("_")[0]](values)
        elif len(pts) >= 2:  # a rate needs two samples, as in Prometheus
            span = pts[-1][0] - pts[0][0]
            if expr.func == "delta":
                out[labels] = pts[-1][1] - pts[0][1]
            elif expr.func == "increase":
                out[labels] = _increase(pts)
            elif span > 0:
                out[labels] = _increase(pts) / span
    return out


def histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus's estimate from cumulative ``le`` buckets, per label set without ``le``."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for labels, count in buckets.items():
        d = dict(labels)
        le = d.pop("le", None)
        if le is None:
            continue
        groups.setdefault(tuple(sorted(d.items())), []).append((float(le), count))
    out: Vector = {}
    for labels, bs in groups.items():
        out[labels] = _quantile(q, sorted(bs))
    return out


def _quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    if q < 0:
        return -math.inf
    if q > 1:
        return math.inf
    if len(buckets) < 2 or not math.isinf(buckets[-1][0]):
        return math.nan
    counts, running = [], 0.0
    for _, c in buckets:  # cumulative counts must not decrease (float noise, races)
        running = max(running, c)
        counts.append(running)
    total = counts[-1]
    if total == 0:
        return math.nan
    rank = q * total
    i = next(i for i, c in enumerate(counts) if c >= rank)
    if i == len(buckets) - 1:
        return buckets[-2][0]
    lower, below = (buckets[i - 1][0], counts[i - 1]) if i > 0 else (0.0, 0.0)
    upper = buckets[i][0]
    if i == 0 and upper <= 0:
        return upper
    inside = counts[i] - below
    return lower + (upper - lower) * ((rank - below) / inside if inside else 1.0)


def _aggregate(expr: Aggregate, inner: Vector) -> Vector:
    groups: dict[Labels, list[float]] = {}
    for labels, v in inner.items():
        if expr.without:
            key = tuple((k, x) for k, x in labels if k not in expr.grouping)
        else:
            key = tuple((k, x) for k, x in labels if k in expr.grouping)
        groups.setdefault(key, []).append(v)
    return {k: _REDUCE[expr.op](vs) for k, vs in groups.items()}


def _apply(op: str, a: float, b: float) -> float:
    return _div(a, b) if op == "/" else _ARITH[op](a, b)


def _binary(op: str, lhs: Value, rhs: Value) -> Value:
    if op in ("and", "or", "unless"):
        if not isinstance(lhs, dict) or not isinstance(rhs, dict):
            raise ValueError(f"'{op}' needs vectors on both sides")
        if op == "and":
            return {k: v for k, v in lhs.items() if k in rhs}
        if op == "unless":
            return {k: v for k, v in lhs.items() if k not in rhs}
        return {**rhs, **lhs}
    if op in _CMP:
        cmp = _CMP[op]
        if isinstance(lhs, dict):
            if isinstance(rhs, dict):
                return {k: v for k, v in lhs.items() if k in rhs and cmp(v, rhs[k])}
            return {k: v for k, v in lhs.items() if cmp(v, rhs)}
        if isinstance(rhs, dict):
            return {k: v for k, v in rhs.items() if cmp(lhs, v)}
        return float(cmp(lhs, rhs))
    if isinstance(lhs, dict):
        if isinstance(rhs, dict):
            return {k: _apply(op, v, rhs[k]) for k, v in lhs.items() if k in rhs}
        return {k: _apply(op, v, rhs) for k, v in lhs.items()}
    if isinstance(rhs, dict):
        return {k: _apply(op, lhs, v) for k, v in rhs.items()}
    return _apply(op, lhs, rhs)
