"""The Triton kernels (``kiln.llm.kernels``) run by Triton's interpreter on CPU tensors
(``TRITON_INTERPRET=1``), against kiln's torch formulas: paged decode attention against
``attention.attend`` over the same keys gathered per sequence, RMSNorm (alone and with the
residual add) against ``RMSNorm``'s torch path, SiLU-and-mul against ``F.silu(g) * u``, RoPE
against ``rope.rotate``. Shapes have odd lengths (contexts that end mid-page, several pages
out of order, head sizes and hidden sizes that are not powers of two) and GQA groups of 1, 4
and 7. Tolerances: float32 1e-5 (attention 2e-5); float16 one rounding step of the output
(2**-10 relative) where the kernel rounds as torch does; bfloat16 two steps (2**-6):
Triton's interpreter (3.9) rounds float32 to bfloat16 toward zero where GPUs and torch round
to nearest even, so each rounding may land one step off; attention 2e-2 (bfloat16) and 2e-3
(float16), its float32 accumulation order differing from SDPA's. On a GPU the tests in
tests/gpu compare whole models' tokens with the kernels on and off."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: kernels run on the CPU

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.llm.attention import attend
from kiln.llm.kernels import PagedDecode, interpreting, problem
from kiln.llm.kernels.decode_attention import decode_attention
from kiln.llm.kernels.elementwise import (
    fused_add_rms_norm,
    rms_norm,
    rotate_,
    silu_and_mul,
)
from kiln.llm.models.llama import RMSNorm
from kiln.llm.models.rope import RotaryEmbedding, rotate

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
#: elementwise kernels: one rounding step (two in bfloat16, see above)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6, torch.float16: 2**-10}
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def test_the_interpreter_is_on_and_the_kernels_accept_the_cpu() -> None:
    assert interpreting()
    assert problem(torch.device("cpu")) is None


def _reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      tables: list[list[int]], lens: list[int], scale: float | None,
                      softcap: float | None, window: int | None) -> torch.Tensor:  # fmt: skip
    """kiln's torch attention over each sequence's keys, gathered through its table."""
    bs, hkv, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    out = []
    for b, (table, n) in enumerate(zip(tables, lens, strict=True)):
        pages = torch.tensor(table[: -(-n // bs)])
        keys = k_cache[pages].reshape(-1, hkv, d)[:n].transpose(0, 1)[None].float()
        values = v_cache[pages].reshape(-1, hkv, d)[:n].transpose(0, 1)[None].float()
        mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
        if window is not None:
            mask[..., : max(0, n - window)] = False
        o = attend(q[b][None, :, None].float(), keys, values, mask, scale, softcap)
        out.append(o[0, :, 0])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(8, 2, 64, 16), (7, 1, 48, 16), (4, 4, 16, 8), (12, 3, 80, 32)],
    ids=["gqa4", "gqa7-dim48", "mha-bs8", "gqa4-dim80-bs32"],
)
def test_paged_decode_attention_matches_torch(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = [1, 37, block_size, 3 * block_size + 5, 70]  # odd lengths, exact pages, several
    pages = sum(-(-n // block_size) for n in lens) + 3
    # pages handed out shuffled: a table's logical order is not the physical one
    order = torch.randperm(pages, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(order[used : used + count])
        used += count
    shape = (pages, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    t = len(lens) + 2  # two flat tokens that are not decodes (rows left alone)
    q = torch.randn(t, heads, head_dim, generator=gen).to(dtype)
    starts = [0, 2, 3, 5, 6]
    meta = PagedDecode.build(tables, [n - 1 for n in lens], starts, block_size,
                             torch.device("cpu"), width=12)  # fmt: skip
    assert meta.block_table.shape == (len(lens), 12)
    for scale, softcap, window in [(None, None, None), (0.1, None, 40), (None, 30.0, None),
                                   (0.2, 5.0, 17)]:  # fmt: skip
        out = torch.full_like(q, 7.0)
        decode_attention(q, k_cache, v_cache, meta, out, scale, softcap, window)
        want = _reference_decode(q[starts], k_cache, v_cache, tables, lens, scale, softcap,
                                 window)  # fmt: skip
        got = out[starts].float()
        tol = ATTN_TOL[dtype]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        assert (out[[1, 4]] == 7.0).all()  # rows of other tokens untouched


def test_decode_attention_reads_the_torch_backend_layout_too() -> None:
    """Strides are arguments: a [pages, Hkv, block_size, D] cache viewed as [pages,
    block_size, Hkv, D] gives the same result as the flex layout."""
    gen = torch.Generator().manual_seed(1)
    flex = torch.randn(6, 16, 2, 32, generator=gen)
    portable = flex.transpose(1, 2).contiguous()  # the torch backend's layout
    q = torch.randn(2, 8, 32, generator=gen)
    meta = PagedDecode.build([[4, 1, 0], [5, 2]], [40, 17], [0, 1], 16, torch.device("cpu"))
    a, b = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, flex, flex, meta, a)
    decode_attention(q, portable.transpose(1, 2), portable.transpose(1, 2), meta, b)
    torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 200, 1000])
def test_rms_norm_and_fused_add_match_the_torch_path(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
    x = torch.randn(13, hidden, generator=gen).to(dtype)
    residual = torch.randn(13, hidden, generator=gen).to(dtype)
    with torch.no_grad():
        want = norm(x)
        want_residual = residual.clone()
        want_sum = norm.add_forward(x.clone(), want_residual)
    tol = TOL[dtype]
    torch.testing.assert_close(rms_norm(x, norm.weight, 1e-6), want, atol=tol, rtol=tol)
    got_residual = residual.clone()
    got_sum = fused_add_rms_norm(x, got_residual, norm.weight, 1e-6)
    # the residual stream's sum is rounded as torch's add_ (exactly, but for the
    # interpreter's bfloat16 rounding)
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=2**-7)
    else:
        assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got_sum, want_sum, atol=tol, rtol=tol)
    # a [T, 1, H] view (q/k norms per head) and a strided x
    torch.testing.assert_close(rms_norm(x[::2], norm.weight, 1e-6), want[::2], atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [16, 100, 1500])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, n: int) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 2 * n, generator=gen) * 3).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate).mul_(up)
    tol = TOL[dtype]
    torch.testing.assert_close(silu_and_mul(x), want, atol=tol, rtol=tol)
    assert silu_and_mul(x[:0]).shape == (0, n)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 16), (7, 1, 96), (3, 3, 128)])
def test_rope_in_place_matches_rotate(dtype: torch.dtype, heads: int, kv_heads: int,
                                      dim: int) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    rope = RotaryEmbedding(dim, 512, 10000.0, None)
    positions = torch.tensor([0, 1, 5, 77, 300, 511, 2])
    cos, sin = rope.lookup(positions, dtype)
    qkv = torch.randn(len(positions), heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    want = rotate(qkv[:, : heads + kv_heads], cos, sin)
    v = qkv[:, heads + kv_heads :].clone()
    rotate_(qkv[:, : heads + kv_heads], cos, sin)
    tol = TOL[dtype]
    torch.testing.assert_close(qkv[:, : heads + kv_heads], want, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, heads + kv_heads :], v)  # the v heads are not rotated


def test_paged_decode_tables_are_the_same_built_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small tables come from a padded list, large ones from a masked scatter: same tensor."""
    import kiln.llm.kernels as kernels

    tables = [[4, 1, 0], [5, 2], [9], [3, 6, 7, 8]]
    computed = [40, 17, 0, 63]  # pages in use: 3, 2, 1, 4
    small = PagedDecode.build(tables, computed, [0, 1, 2, 3], 16, torch.device("cpu"), width=6)
    monkeypatch.setattr(kernels, "SMALL_TABLE", 0)
    large = PagedDecode.build(tables, computed, [0, 1, 2, 3], 16, torch.device("cpu"), width=6)
    assert torch.equal(small.block_table, large.block_table)
    assert small.block_table.tolist()[3] == [3, 6, 7, 8, 0, 0]
    assert small.seq_lens.tolist() == [41, 18, 1, 64]
