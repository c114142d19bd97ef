"""``--metrics-config KEY=VALUE`` settings, with Triton's keys and defaults.

Triton's keys: ``counter_latencies`` (default true), ``summary_latencies`` (false),
``summary_quantiles`` (``q:err,...``), ``histogram_latencies`` (false). kiln adds
``latency_buckets`` (seconds, for ``kiln_request_duration_seconds``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

# Triton's default quantiles, as ``quantile: allowed error`` pairs.
DEFAULT_QUANTILES: tuple[tuple[float, float], ...] = (
    (0.5, 0.05),
    (0.9, 0.01),
    (0.95, 0.001),
    (0.99, 0.001),
    (0.999, 0.0001),
)
# Seconds: from sub-millisecond CPU models to multi-second LLM requests.
DEFAULT_LATENCY_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
# Triton's default buckets for nv_inference_first_response_histogram_ms.
DEFAULT_FIRST_RESPONSE_BUCKETS_MS: tuple[float, ...] = (100.0, 500.0, 2000.0, 5000.0)


class MetricsConfigError(ValueError):
    """A ``--metrics-config`` entry kiln cannot use; the message names key and value."""


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    counter_latencies: bool = True
    summary_latencies: bool = False
    summary_quantiles: tuple[tuple[float, float], ...] = DEFAULT_QUANTILES
    histogram_latencies: bool = False
    latency_buckets: tuple[float, ...] = DEFAULT_LATENCY_BUCKETS
    first_response_buckets_ms: tuple[float, ...] = DEFAULT_FIRST_RESPONSE_BUCKETS_MS

    @classmethod
    def parse(cls, entries: Iterable[str]) -> MetricsConfig:
        values: dict[str, object] = {}
        for entry in entries:
            key, sep, raw = entry.partition("=")
            key, raw = key.strip(), raw.strip()
            if not sep or not key:
                raise MetricsConfigError(f"--metrics-config '{entry}': expected KEY=VALUE")
            parser = _PARSERS.get(key)
            if parser is None:
                known = ", ".join(sorted(_PARSERS))
                raise MetricsConfigError(
                    f"--metrics-config: unknown key '{key}' (known keys: {known})"
                )
            values[key] = parser(key, raw)
        return cls(**values)  # type: ignore[arg-type]


def _bool(key: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise MetricsConfigError(f"--metrics-config {key}={raw}: expected true or false")


def _quantiles(key: str, raw: str) -> tuple[tuple[float, float], ...]:
    pairs = []
    for item in raw.strip("\"'").split(","):
        q_raw, sep, err_raw = item.strip().partition(":")
        try:
            q, err = float(q_raw), float(err_raw)
        except ValueError:
            q = err = math.nan
        if not sep or not (0.0 <= q <= 1.0) or not (0.0 <= err <= 1.0):
            raise MetricsConfigError(
                f"--metrics-config {key}={raw}: '{item}' is not <quantile>:<error> "
                "with both in [0, 1] (e.g. 0.5:0.05,0.99:0.001)"
            )
        pairs.append((q, err))
    return tuple(sorted(pairs))


def _buckets(key: str, raw: str) -> tuple[float, ...]:
    try:
        bounds = tuple(float(b) for b in raw.strip("\"'").split(","))
    except ValueError:
        bounds = ()
    if (
        not bounds
        or any(not math.isfinite(b) or b <= 0 for b in bounds)
        or list(bounds) != sorted(set(bounds))
    ):
        raise MetricsConfigError(
            f"--metrics-config {key}={raw}: expected increasing positive numbers "
            "separated by commas (e.g. 0.001,0.01,0.1,1)"
        )
    return bounds


_PARSERS = {
    "counter_latencies": _bool,
    "summary_latencies": _bool,
    "summary_quantiles": _quantiles,
    "histogram_latencies": _bool,
    "latency_buckets": _buckets,
}
