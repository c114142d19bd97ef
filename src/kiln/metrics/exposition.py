"""Prometheus text format 0.0.4, with counter names exactly as the collector gives them.

``prometheus_client.generate_latest`` renames every counter family to ``<name>_total``.
Triton's counters (``nv_inference_request_success``, ``nv_energy_consumption``, ...) carry
no such suffix, and dashboards and alert rules written for Triton query those exact
names, so kiln writes the format itself: a counter's ``# TYPE`` line uses the name its
samples use (``process_cpu_seconds_total`` keeps its suffix; Triton's names keep none).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.core import Metric

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def counter(name: str, documentation: str) -> Metric:
    """A counter family whose samples are named ``name`` (add them with ``add_sample``)."""
    return Metric(name, documentation, "counter")


def _escape_help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape_label(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _value(v: float) -> str:
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return repr(float(v))


def _type_name(metric: Metric) -> str:
    if metric.type == "counter" and any(s.name == metric.name + "_total" for s in metric.samples):
        return metric.name + "_total"
    return metric.name


_TYPES = {"unknown": "untyped", "info": "gauge", "stateset": "gauge"}


def render(metrics: Iterable[Metric]) -> bytes:
    lines: list[str] = []
    for metric in metrics:
        name = _type_name(metric)
        lines.append(f"# HELP {name} {_escape_help(metric.documentation)}\n")
        lines.append(f"# TYPE {name} {_TYPES.get(metric.type, metric.type)}\n")
        for s in metric.samples:
            if s.name.endswith("_created"):
                continue  # OpenMetrics-only; the 0.0.4 text format has no place for it
            if s.labels:
                labels = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in s.labels.items())
                lines.append(f"{s.name}{{{labels}}} {_value(s.value)}\n")
            else:
                lines.append(f"{s.name} {_value(s.value)}\n")
    return "".join(lines).encode("utf-8")
