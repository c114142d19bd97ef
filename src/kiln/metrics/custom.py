"""Python models' own metrics (``pb_utils.MetricFamily``) on ``/metrics``.

Each Python-backend instance keeps its families in its worker's folder
(``backends/python/custom_metrics.py``); this collector reads them at scrape time and
merges them by family name over every instance of every model, as Triton shares one family
between all the models that create it. Samples with the same labels from several instances
are added up (give each instance a label of its own, e.g. ``args["model_instance_name"]``,
to keep them apart).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import Metric

from kiln.backends.python.custom_metrics import FamilySnapshot

log = logging.getLogger(__name__)


def _bound(bound: float) -> str:
    """A bucket's ``le`` as Prometheus' Go client writes it: ``8``, ``0.5``, ``+Inf``."""
    if math.isinf(bound):
        return "+Inf"
    return str(int(bound)) if bound.is_integer() and abs(bound) < 1e15 else repr(bound)


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


class CustomMetricsCollector:
    def __init__(self, runtimes: Callable[[], list[Any]]) -> None:
        self._runtimes = runtimes
        self._warned: set[str] = set()

    def _snapshots(self) -> Iterator[FamilySnapshot]:
        for runtime in self._runtimes():
            for instance in getattr(runtime.scheduler, "instances", None) or ():
                read = getattr(instance.backend, "custom_metrics", None)
                if read is not None:
                    yield from read()

    def collect(self) -> Iterator[Metric]:
        families: dict[str, FamilySnapshot] = {}
        merged: dict[str, dict[tuple[tuple[str, str], ...], tuple[dict[str, str], Any]]] = {}
        for snap in self._snapshots():
            known = families.get(snap.name)
            if known is None:
                families[snap.name] = snap
                merged[snap.name] = {}
            elif known.kind != snap.kind:
                if snap.name not in self._warned:
                    self._warned.add(snap.name)
                    log.warning(
                        "custom metric family '%s' is a %s in one model and a %s in another: "
                        "only the first is shown",
                        snap.name,
                        known.kind,
                        snap.kind,
                    )
                continue
            samples = merged[snap.name]
            for labels, value in snap.samples:
                key = _key(labels)
                if key not in samples:
                    samples[key] = (labels, value)
                elif snap.kind == "histogram":
                    (old, old_sum, old_count), (new, new_sum, new_count) = samples[key][1], value
                    if [b for b, _ in old] == [b for b, _ in new]:  # the same buckets
                        buckets = [(b, c + d) for (b, c), (_, d) in zip(old, new, strict=True)]
                        samples[key] = (labels, (buckets, old_sum + new_sum, old_count + new_count))
                else:
                    samples[key] = (labels, samples[key][1] + value)
        for name, snap in families.items():
            metric = Metric(name, snap.description, snap.kind)
            for labels, value in merged[name].values():
                if snap.kind != "histogram":
                    metric.add_sample(name, labels, value)
                    continue
                buckets, total, count = value
                for bound, cumulative in buckets:
                    le = _bound(bound)
                    metric.add_sample(name + "_bucket", {**labels, "le": le}, cumulative)
                metric.add_sample(name + "_sum", labels, total)
                metric.add_sample(name + "_count", labels, count)
            yield metric
