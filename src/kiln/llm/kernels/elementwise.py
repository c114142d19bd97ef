"""The small per-layer operations of a step as one Triton kernel each.

On a GPU a decode step's tensors are a few kilobytes and each torch operation on them is a
kernel launch and a pass over memory: in bfloat16, RMSNorm with the residual add is about
nine (the add, the float cast, pow, mean, the epsilon, rsqrt, the scaling, the cast back,
the weight), SiLU-and-mul two, rotate-half RoPE four (the half swap, two products, the sum).
Under CUDA graphs the launches are cheap but the passes remain; eagerly both count.

Each kernel rounds where the torch formula of ``models/llama.py`` rounds (the residual sum,
the normalised rows and each RoPE product in the model's dtype, statistics in float32), so
in bfloat16 the results differ from it only by the order of the float32 sums (RMSNorm's
mean of squares) and by fused multiply-adds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit  # type: ignore[untyped-decorator]
def _rms_norm_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    if ADD:
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        # the sum is rounded to the stream's dtype, as torch's in-place add does
        r = (r + x).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, r, mask=ok)
    else:
        r = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    h = r.to(tl.float32)
    variance = tl.sum(h * h, 0) / n
    h = h * tl.rsqrt(variance + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # weight * h.to(dtype): the normalised row is rounded before the weight multiplies it
    out = h.to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, hidden] with the hidden dimension contiguous (a view when it can)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x**2) + eps))`` over the last dimension (statistics in
    float32)."""
    rows = _rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    _launch(rows, rows, weight, out, eps, add=False)
    return out.view(x.shape)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``residual += x`` in place (``residual`` [T, hidden], its last dimension
    contiguous), then the RMSNorm of the sum, in one pass (vLLM's ``fused_add_rms_norm``)."""
    if residual.dim() != 2 or residual.stride(-1) != 1:
        raise ValueError("fused_add_rms_norm: residual must be [T, hidden], rows contiguous")
    rows = _rows(x)
    out = torch.empty(residual.shape, dtype=residual.dtype, device=residual.device)
    _launch(rows, residual, weight, out, eps, add=True)
    return out


def _launch(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor,
            eps: float, add: bool) -> None:  # fmt: skip
    n = x.shape[-1]
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x.shape[0],)](
        x,
        residual,
        weight,
        out,
        x.stride(0),
        residual.stride(0),
        out.stride(0),
        n,
        eps,
        ADD=add,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 16),
    )


@triton.jit  # type: ignore[untyped-decorator]
def _silu_and_mul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=ok, other=0.0).to(tl.float32)
    # silu rounded to the dtype, then the product: torch's F.silu then mul_
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


#: columns per program of SiLU-and-mul
SILU_BLOCK = 1024


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` for ``x`` [T, 2n] (the fused gate/up projection's
    output, vLLM's ``silu_and_mul``)."""
    rows = _rows(x)
    n = rows.shape[-1] // 2
    out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(SILU_BLOCK, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(n, block))](
            rows, out, rows.stride(0), out.stride(0), n, BLOCK=block
        )
    return out.view(*x.shape[:-1], n)


@triton.jit  # type: ignore[untyped-decorator]
def _rope_kernel(  # type: ignore[no-untyped-def]
    x_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    heads,
    HALF: tl.constexpr,
    HALF_P: tl.constexpr,
    HEADS_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P)
    i = tl.arange(0, HALF_P)
    ok = (h[:, None] < heads) & (i[None, :] < HALF)
    base = x_ptr + t * stride_xt + h[:, None] * stride_xh + i[None, :]
    x1 = tl.load(base, mask=ok, other=0.0)
    x2 = tl.load(base + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    c1 = tl.load(cos_ptr + t * stride_ct + i, mask=i < HALF, other=0.0)[None, :]
    c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=i < HALF, other=0.0)[None, :]
    s1 = tl.load(sin_ptr + t * stride_st + i, mask=i < HALF, other=0.0)[None, :]
    s2 = tl.load(sin_ptr + t * stride_st + HALF + i, mask=i < HALF, other=0.0)[None, :]
    # x * cos + swapped * signed_sin, each product and the sum rounded to the dtype, as the
    # torch formula (rope.rotate) computes them
    a1 = (x1.to(tl.float32) * c1.to(tl.float32)).to(dt).to(tl.float32)
    b1 = (x2.to(tl.float32) * s1.to(tl.float32)).to(dt).to(tl.float32)
    a2 = (x2.to(tl.float32) * c2.to(tl.float32)).to(dt).to(tl.float32)
    b2 = (x1.to(tl.float32) * s2.to(tl.float32)).to(dt).to(tl.float32)
    tl.store(base, (a1 + b1).to(dt), mask=ok)
    tl.store(base + HALF, (a2 + b2).to(dt), mask=ok)


def rotate_(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in place on ``x`` [T, heads, D] (a view with D contiguous, such as
    the q and k heads of the fused projection's output); ``cos`` and ``signed_sin``
    [T, 1, D] as ``RotaryEmbedding.lookup`` returns them. Returns ``x``."""
    tokens, heads, dim = x.shape
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or signed_sin.stride(-1) != 1:
        raise ValueError("rotate_: the head dimension must be contiguous")
    if tokens:
        half = dim // 2
        _rope_kernel[(tokens,)](
            x,
            cos,
            signed_sin,
            x.stride(0),
            x.stride(1),
            cos.stride(0),
            signed_sin.stride(0),
            heads,
            HALF=half,
            HALF_P=triton.next_power_of_2(half),
            HEADS_P=triton.next_power_of_2(heads),
        )
    return x
