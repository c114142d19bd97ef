"""Custom metrics of Python models: Triton's ``pb_utils.MetricFamily`` / ``Metric``.

A model creates families and metrics in its worker process; the server exposes them on
``/metrics`` next to its own. Nothing goes over the worker's pipe: each worker has a folder
in /dev/shm (made by the server) with two files that only the worker writes:

- ``manifest.json``: the families (name, description, kind) and their metrics (labels,
  buckets, first value slot), replaced whole (write + rename) when one is added;
- ``values.bin``: float64 slots the worker updates in place (one per counter or gauge; a
  histogram has one per bucket, one for +Inf, then its sum and its count).

The server reads both when it is scraped. An update is one aligned 8-byte store, so a
scrape sees each value either before or after it, never torn. A restarted worker starts
with an empty manifest, as Triton's stub does: its model registers its metrics again in
``initialize``.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
VALUES = "values.bin"
KINDS = ("counter", "gauge", "histogram")
COUNTER, GAUGE, HISTOGRAM = 0, 1, 2
_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_INITIAL_SLOTS = 512
RESERVED_PREFIXES = ("nv_", "kiln_", "process_")


class MetricError(ValueError):
    """A family or metric that cannot be made; ``pb_utils`` raises it as
    ``TritonModelException``."""


def metric_slots(kind: int, buckets: list[float] | None) -> int:
    return len(buckets or ()) + 3 if kind == HISTOGRAM else 1


class MetricStore:
    """The worker's side: registers families and metrics, updates their values."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._lock = threading.Lock()  # model threads update metrics too
        self._families: dict[str, dict[str, Any]] = {}
        self._used = 0
        self._fd = os.open(folder / VALUES, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self._size = 0
        self._map: mmap.mmap | None = None
        self._values = np.zeros(0)
        self._grow(_INITIAL_SLOTS)
        self._write_manifest()

    def _grow(self, slots: int) -> None:
        size = slots * 8
        os.ftruncate(self._fd, size)  # new bytes read as 0
        old = self._map
        self._map = mmap.mmap(self._fd, size)
        self._values = np.ndarray((slots,), np.float64, buffer=self._map)
        self._size = size
        if old is not None:
            # A value() reading the old view right now keeps it; it goes with that read.
            with contextlib.suppress(BufferError):
                old.close()

    def _write_manifest(self) -> None:
        tmp = self.folder / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps({"families": list(self._families.values())}))
        os.replace(tmp, self.folder / MANIFEST)

    # ---- registration ------------------------------------------------------------------
    def family(self, name: str, description: str, kind: int) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise MetricError(
                f"metric family name {name!r} is not a valid Prometheus metric name "
                "([a-zA-Z_:][a-zA-Z0-9_:]*)"
            )
        if name.startswith(RESERVED_PREFIXES):
            raise MetricError(
                f"metric family name '{name}': the prefixes {', '.join(RESERVED_PREFIXES)} "
                "belong to the server's own metrics"
            )
        if kind not in (COUNTER, GAUGE, HISTOGRAM):
            raise MetricError(f"metric family '{name}': unknown kind {kind!r}")
        with self._lock:
            known = self._families.get(name)
            if known is not None:
                if known["kind"] != KINDS[kind] or known["description"] != description:
                    raise MetricError(
                        f"metric family '{name}' already exists as a {known['kind']} with "
                        f"description {known['description']!r}"
                    )
                return
            self._families[name] = {
                "name": name, "description": str(description), "kind": KINDS[kind], "metrics": []
            }  # fmt: skip
            self._write_manifest()

    def metric(self, family: str, labels: dict[str, str], buckets: list[float] | None) -> int:
        """A metric of ``family`` with ``labels``; its first value slot."""
        for key in labels:
            if not isinstance(key, str) or not _LABEL.match(key) or key.startswith("__"):
                raise MetricError(f"metric family '{family}': invalid label name {key!r}")
        with self._lock:
            entry = self._families[family]
            kind = KINDS.index(entry["kind"])
            if kind == HISTOGRAM:
                if not buckets:
                    raise MetricError(f"histogram '{family}': a metric needs its buckets")
                bounds = [float(b) for b in buckets]
                if any(math.isnan(b) for b in bounds) or bounds != sorted(set(bounds)):
                    raise MetricError(
                        f"histogram '{family}': buckets must be distinct numbers in "
                        f"increasing order, not {buckets!r}"
                    )
            elif buckets is not None:
                raise MetricError(f"metric family '{family}': only a histogram has buckets")
            else:
                bounds = None
            wanted = {str(k): str(v) for k, v in labels.items()}
            for known in entry["metrics"]:
                if known["labels"] == wanted:
                    if known["buckets"] != bounds:
                        raise MetricError(
                            f"histogram '{family}' already has a metric with labels {wanted} "
                            "and other buckets"
                        )
                    return int(known["slot"])  # Triton: the same labels, the same metric
            slot = self._used
            self._used += metric_slots(kind, bounds)
            if self._used * 8 > self._size:
                self._grow(max(self._used, 2 * self._size // 8))
            entry["metrics"].append({"labels": wanted, "buckets": bounds, "slot": slot})
            self._write_manifest()
            return slot

    # ---- values ------------------------------------------------------------------------
    def add(self, slot: int, value: float) -> None:
        with self._lock:
            self._values[slot] += value

    def set(self, slot: int, value: float) -> None:
        with self._lock:
            self._values[slot] = value

    def get(self, slot: int) -> float:
        return float(self._values[slot])

    def observe(self, slot: int, buckets: list[float], value: float) -> None:
        index = next((i for i, bound in enumerate(buckets) if value <= bound), len(buckets))
        with self._lock:
            values = self._values
            values[slot + index] += 1
            values[slot + len(buckets) + 1] += value
            values[slot + len(buckets) + 2] += 1


# ---- the server's side ---------------------------------------------------------------
@dataclass(slots=True)
class FamilySnapshot:
    name: str
    description: str
    kind: str
    # (labels, value) for counters and gauges; (labels, cumulative bucket counts keyed by
    # upper bound incl. +Inf, sum, count) for histograms
    samples: list[tuple[dict[str, str], Any]] = field(default_factory=list)


def read_store(folder: Path) -> list[FamilySnapshot]:
    """What one worker's folder holds now; nothing when it has not written it yet."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        values = np.fromfile(folder / VALUES, dtype=np.float64)
    except (OSError, ValueError):
        return []
    out = []
    for family in manifest.get("families", []):
        snap = FamilySnapshot(family["name"], family["description"], family["kind"])
        for metric in family["metrics"]:
            slot, buckets = metric["slot"], metric["buckets"]
            if family["kind"] != "histogram":
                if slot < len(values):
                    snap.samples.append((metric["labels"], float(values[slot])))
                continue
            n = len(buckets)
            if slot + n + 3 > len(values):
                continue
            counts = np.cumsum(values[slot : slot + n + 1])
            bounds = [*buckets, math.inf]
            cumulative = list(zip(bounds, counts.tolist(), strict=True))
            total, count = float(values[slot + n + 1]), float(values[slot + n + 2])
            snap.samples.append((metric["labels"], (cumulative, total, count)))
        out.append(snap)
    return out
