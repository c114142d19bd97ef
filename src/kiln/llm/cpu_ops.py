"""Fused float32 CPU kernels for the small per-layer operations of a step (numba).

On a CPU a decode step's tensors are small ([batch, hidden], tens of kilobytes) and each
torch operation on them costs more in dispatch and memory passes than in arithmetic: the
residual add and RMSNorm of one layer are five operations (add, pow, mean, rsqrt, two
multiplications). ``add_rms_norm`` does them in one pass over each row, the way vLLM's
``fused_add_rms_norm`` does: the residual stream is updated in place and the normalised
rows are written out. ``rotate_`` applies RoPE to the fused q/k/v projection's output in
place (bit-identical to the torch formula).

Each row is computed on its own, in a fixed order, so a token's result does not depend on
how many other tokens share its step (a decode and a prefill agree bit for bit). The sum of
squares is accumulated in float64, so the result is at least as accurate as torch's float32
mean; it is not bit-identical to it (torch sums in a different order), which moves a
logit by about one float32 rounding step (tested against ``transformers``).

Used by the Llama skeleton on CPU float32 when numba is installed (``kiln-serve[llm]``);
elsewhere the model keeps torch's operations.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

try:  # numba is in the llm extra; the torch path works without it
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


def _rms_norm_rows(x: Any, residual: Any, add: bool, weight: Any, eps: float, out: Any) -> None:
    """Row by row: with ``add``, ``residual += x`` first (in place); then ``out = weight *
    residual / sqrt(mean(residual**2) + eps)``. Without ``add`` ``x`` is not read and
    ``residual`` (the rows to normalise) is not written."""
    rows, size = residual.shape
    for r in range(rows):
        total = 0.0
        for i in range(size):
            value = residual[r, i]
            if add:
                value += x[r, i]
                residual[r, i] = value
            total += np.float64(value) * np.float64(value)
        scale = np.float32(1.0 / np.sqrt(np.float32(total / size) + np.float32(eps)))
        for i in range(size):
            out[r, i] = weight[i] * (residual[r, i] * scale)


def _rotate(x: Any, cos: Any, signed_sin: Any, heads: int) -> None:
    """Rotate-half RoPE in place on heads ``0..heads`` of ``x`` [T, H, D]; ``cos`` and
    ``signed_sin`` [T, D] (``RotaryEmbedding.lookup``'s, the sin's first half negated)."""
    tokens, _, dim = x.shape
    half = dim // 2
    for t in range(tokens):
        for h in range(heads):
            for i in range(half):
                first = x[t, h, i]
                second = x[t, h, i + half]
                # the formula's own two products and one sum, in its order: no fused
                # multiply-add (this function is compiled without fastmath), so the bits
                # are torch's ``x * cos + rotate_half(x) * sin``
                x[t, h, i] = first * cos[t, i] + second * signed_sin[t, i]
                x[t, h, i + half] = second * cos[t, i + half] + first * signed_sin[t, i + half]


# fastmath lets LLVM vectorise the sums (reassociation); the order it picks is fixed by the
# compiled loop and the row length, so a row's result still does not depend on its step
_jit = (
    numba.njit(nogil=True, cache=True, boundscheck=False, fastmath=True)
    if numba is not None
    else None
)
_rms_norm_compiled = _jit(_rms_norm_rows) if _jit is not None else None
_rotate_compiled = (
    numba.njit(nogil=True, cache=True, boundscheck=False)(_rotate) if numba is not None else None
)


def usable(x: torch.Tensor) -> bool:
    """These kernels apply: numba is installed and ``x`` is a float32 CPU tensor."""
    return numba is not None and x.dtype == torch.float32 and x.device.type == "cpu"


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` (in place) and return the RMS-normalised ``residual``; 2-D float32
    CPU tensors, ``residual`` contiguous and owned by the caller."""
    assert _rms_norm_compiled is not None, "cpu_ops needs numba"
    out = torch.empty_like(residual)
    _rms_norm_compiled(
        x.contiguous().numpy(), residual.numpy(), True, weight.detach().numpy(), eps, out.numpy()
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    assert _rms_norm_compiled is not None, "cpu_ops needs numba"
    rows = x.contiguous().numpy()
    out = torch.empty_like(x)
    _rms_norm_compiled(rows, rows, False, weight.detach().numpy(), eps, out.numpy())
    return out


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int) -> None:
    """``rope.rotate`` in place on the first ``heads`` heads of ``x`` [T, H, D] (a fresh
    projection output): one pass, no temporaries."""
    assert _rotate_compiled is not None, "cpu_ops needs numba"
    t, d = x.shape[0], x.shape[2]
    _rotate_compiled(x.numpy(), cos.reshape(t, d).numpy(), signed_sin.reshape(t, d).numpy(), heads)


def warm_up() -> None:
    """Compile (or load from numba's cache) before the first request waits for it."""
    if numba is None:
        return
    x = torch.ones(1, 4)
    add_rms_norm(x, x.clone(), torch.ones(4), 1e-6)
    rms_norm(x, torch.ones(4), 1e-6)
    rotate_(torch.ones(1, 3, 4), torch.ones(1, 1, 4), torch.ones(1, 1, 4), 2)
