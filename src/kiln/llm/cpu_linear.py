"""oneDNN matrix products for the CPU's decode-sized batches (float32).

``F.linear`` on the CPU is MKL's sgemm, which packs the weight again on every call; for a
few to ~100 rows against a wide weight that repacking is a large share of the product. vLLM's
CPU build runs its projections through oneDNN with the weight reordered once, at load time,
into the blocked layout its kernels read (``onednn_mm``). torch ships the same: the weight
reordered once (``mkldnn._reorder_linear_weight``) and the product by
``mkldnn._linear_pointwise``. Measured on the 2-vCPU AVX2 EPYC (benchmarks/README.md,
"CPU per-token compute"): 1.2-1.6x faster than ``F.linear`` for 8..128 rows on the wide
projections (fused q/k/v, fused gate/up, the LM head), but 0.85x for one row and
0.9-0.95x for long prefills, and no gain on the narrow ones (o_proj, down_proj).

So ``PackedLinear`` keeps the dense weight too and picks per call: oneDNN for
``MIN_ROWS..MAX_ROWS`` rows (from one row for the wide projections, ``out_features >= WIDE *
in_features``, whose single-row product oneDNN also runs faster), ``F.linear`` otherwise.
Every projection is packed, the narrow ones (o_proj, down_proj) too: with two threads on
this machine their packed product was 1.1-3x MKL's for 2..64 rows (with one thread, equal
from 16 rows). The copy costs the weights' bytes once more.

The two libraries sum in different orders: a logit moves by float32 rounding, as with
any other kernel change (tested against ``transformers``).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: rows from which oneDNN's packed product beats MKL's sgemm on a narrow projection (one
#: row: MKL's gemv is as fast); a wide one uses it from one row
MIN_ROWS = 2
#: rows up to which it does (a prefill chunk's thousands of rows: MKL's is faster)
MAX_ROWS = 192
#: projections at least this many times wider than tall (q/k/v, gate/up, LM head) use the
#: packed product for one row too
WIDE = 1.5
#: batch-invariant mode (``batch_invariant``): every product runs on tiles of this many rows
#: (the last one padded with zeros), so a row's result never depends on the rows beside it
#: (docs/design/batch-invariance.md)
TILE_ROWS = 16


def available() -> bool:
    """torch has oneDNN (``USE_MKLDNN``) and its packed linear ops."""
    return (
        torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` (its ``weight`` and ``bias`` are the original's, shared) with a
    oneDNN copy of the weight for decode-sized batches."""

    packed: torch.Tensor
    #: the fewest rows the packed product is used for
    min_rows: int
    #: the most (an encoder's: no bound, ``pack(max_rows=...)``)
    max_rows: int
    #: > 0: batch-invariant, every product on tiles of this many rows
    tile: int = 0

    @classmethod
    def wrap(cls, linear: nn.Linear, max_rows: int = MAX_ROWS) -> PackedLinear:
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        # the hint is the batch the blocked layout is tuned for: a full decode batch
        with torch.no_grad():
            new.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 64)
        new.min_rows = 1 if new.out_features >= WIDE * new.in_features else MIN_ROWS
        new.max_rows = max_rows
        return new

    def packs(self, x: torch.Tensor) -> bool:
        """Whether the product of ``x`` runs on the packed weight."""
        rows = x.shape[0] if x.dim() == 2 else x.numel() // self.in_features
        return self.min_rows <= rows <= self.max_rows and x.dtype == self.weight.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile:
            return self._tiled(x)
        if self.packs(x):
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, self.packed, self.bias, "none", [], ""
            )
            return out
        return F.linear(x, self.weight, self.bias)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        """One kernel, one shape for every row: oneDNN's product of ``tile`` rows at a time
        sums each row in the same order whatever the other rows hold or how many there
        are (MKL's and oneDNN's own choices by row count do not)."""
        rows = x.reshape(-1, self.in_features)
        n, tile = rows.shape[0], self.tile
        pad = -n % tile
        if pad:
            rows = torch.cat([rows, rows.new_zeros(pad, self.in_features)])
        product = torch.ops.mkldnn._linear_pointwise
        out = torch.cat(
            [product(rows[i : i + tile], self.packed, self.bias, "none", [], "")
             for i in range(0, n + pad, tile)]
        )  # fmt: skip
        return out[:n].reshape(*x.shape[:-1], self.out_features)


def pack(model: nn.Module, max_rows: int = MAX_ROWS, tile: int = 0) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` (CPU, float32) for a
    ``PackedLinear`` sharing its parameters, used up to ``max_rows`` rows (``tile``: for
    every product, on tiles of that many rows); the number swapped."""
    if not available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            if child.weight.dtype != torch.float32:  # bf16 without AVX512-BF16: not measured
                continue
            packed = PackedLinear.wrap(child, max_rows)
            packed.tile = tile
            setattr(parent, name, packed)
            swapped += 1
    if swapped:
        log.info("llm: %d projections use oneDNN's packed weights for small batches", swapped)
    return swapped
