"""The client's side of system shared memory: one POSIX object holding every tensor.

Inputs are written once before measuring; outputs (when their sizes are known) get a shared
area the server overwrites on every response, as perf_analyzer does. The object is created
under ``/dev/shm`` (what ``shm_open`` uses) and removed when the run ends.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np

from kiln.bench.bodies import Placement, ShmSlot, raw_bytes
from kiln.bench.inputs import ModelSpec

SHM_ROOT = Path("/dev/shm")
_ITEM_BYTES = {"BOOL": 1, "UINT8": 1, "INT8": 1, "UINT16": 2, "INT16": 2, "FP16": 2,
               "BF16": 2, "UINT32": 4, "INT32": 4, "FP32": 4, "UINT64": 8, "INT64": 8,
               "FP64": 8}  # fmt: skip


def output_sizes(spec: ModelSpec, batch_size: int) -> dict[str, int] | None:
    """Byte size of every output at this batch size, or None when one cannot be known."""
    sizes: dict[str, int] = {}
    for out in spec.outputs:
        dims = out.shape[1:] if spec.max_batch_size else out.shape
        if out.datatype not in _ITEM_BYTES or any(d < 0 for d in dims):
            return None  # BYTES or variable dims: the outputs travel in the response
        n = int(np.prod(dims)) * (batch_size if spec.max_batch_size else 1)
        sizes[out.name] = n * _ITEM_BYTES[out.datatype]
    return sizes


class ClientRegion:
    """One shared memory object laid out as: each entry's inputs, then the outputs."""

    def __init__(
        self,
        spec: ModelSpec,
        entries: list[dict[str, np.ndarray]],
        batch_size: int,
        root: Path = SHM_ROOT,
    ) -> None:
        self.name = f"kiln_bench_{os.getpid()}_{spec.name}"
        self.key = "/" + self.name
        self.path = root / self.name
        types = {t.name: t.datatype for t in spec.inputs}
        blobs = [{n: raw_bytes(types[n], a) for n, a in e.items()} for e in entries]
        outputs = output_sizes(spec, batch_size) or {}
        self.byte_size = max(
            1, sum(len(b) for e in blobs for b in e.values()) + sum(outputs.values())
        )
        self.placements: list[Placement] = []
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, self.byte_size)
            self._map = mmap.mmap(fd, self.byte_size)
        finally:
            os.close(fd)
        offset = 0
        for entry in blobs:
            placement = Placement()
            for name, blob in entry.items():
                self._map[offset : offset + len(blob)] = blob
                placement.inputs[name] = ShmSlot(self.name, offset, len(blob))
                offset += len(blob)
            self.placements.append(placement)
        for name, size in outputs.items():
            for placement in self.placements:
                placement.outputs[name] = ShmSlot(self.name, offset, size)
            offset += size

    def close(self) -> None:
        self._map.close()
        self.path.unlink(missing_ok=True)
