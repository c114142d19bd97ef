"""Paged attention against a dense per-sequence reference, on random K/V in randomly placed
blocks: decodes of varied context lengths (several decode groups, padded rows masked; or
all of them in the ``cpu`` backend's kernel, which reads the blocks in place), a fresh
prompt, and a prompt chunk that continues a cached prefix; with and without a sliding
window."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.llm import attention
from kiln.llm.attention import AttentionMetadata, KVWorkspace, cache_shape, paged_attention

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 96
CPU = torch.device("cpu")


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int,
           window: int | None = None) -> torch.Tensor:  # fmt: skip
    """One sequence: ``q`` [n, H, D] at positions offset.., ``k``/``v`` [offset + n, Hkv, D];
    the query at i sees the keys at j <= i, and i - window < j with a window."""
    n, total = q.shape[0], k.shape[0]
    q_pos, k_pos = torch.arange(offset, offset + n)[:, None], torch.arange(total)[None, :]
    keep = k_pos <= q_pos
    if window is not None:
        keep &= k_pos > q_pos - window
    rep = H // HKV
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.repeat_interleave(rep, dim=1).transpose(0, 1),
        v.repeat_interleave(rep, dim=1).transpose(0, 1),
        attn_mask=keep,
    )
    return o.transpose(0, 1)


#: (tokens already cached, new tokens): 7 decodes, a fresh prompt, a continued chunk; the
#: decodes first or interleaved with the prompts; or decodes alone (then the cpu kernel
#: writes their keys and values into the cache itself, with no separate copy)
DECODES_FIRST = [(1, 1), (3, 1), (4, 1), (5, 1), (9, 1), (17, 1), (30, 1), (0, 6), (8, 5)]
INTERLEAVED = [(1, 1), (3, 1), (0, 6), (4, 1), (5, 1), (9, 1), (8, 5), (17, 1), (30, 1)]
DECODES_ONLY = [(1, 1), (3, 1), (4, 1), (5, 1), (9, 1), (17, 1), (30, 1)]


@pytest.mark.parametrize(
    "shapes", [DECODES_FIRST, INTERLEAVED, DECODES_ONLY], ids=["first", "interleaved", "only"]
)
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "cpu-kernel"])
@pytest.mark.parametrize("window", [None, 5, 8], ids=["full", "window5", "window8"])
def test_paged_attention_matches_dense_attention(
    monkeypatch: pytest.MonkeyPatch, fused: bool, shapes: list[tuple[int, int]], window: int | None
) -> None:
    """A window of 5 (8) tokens, blocks of 4: decodes skip whole blocks and start mid-block
    (on a block boundary), the 6-token prompt is longer than 5, the chunk after 8 cached
    tokens skips its first block."""
    torch.manual_seed(0)
    rng = random.Random(0)
    # small groups, so that this handful of decodes makes several of them
    monkeypatch.setattr(attention, "MAX_GROUP_SEQS", 3)
    k_cache = torch.zeros(cache_shape(NUM_BLOCKS, BS, HKV, D))
    v_cache = torch.zeros_like(k_cache)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables, full_k, full_v = [], [], []
    for cached, new in shapes:
        table = [free.pop() for _ in range(-(-(cached + new) // BS))]
        keys, values = torch.randn(cached + new, HKV, D), torch.randn(cached + new, HKV, D)
        for p in range(cached):  # the earlier steps' keys, written where the table says
            k_cache[table[p // BS], :, p % BS] = keys[p]
            v_cache[table[p // BS], :, p % BS] = values[p]
        if fused and new == 1 and window is not None:
            # what the kernel must not read: NaN would reach its output
            for p in range(max(0, cached + 1 - window)):
                k_cache[table[p // BS], :, p % BS] = float("nan")
                v_cache[table[p // BS], :, p % BS] = float("nan")
        tables.append(table)
        full_k.append(keys)
        full_v.append(values)
    q = torch.randn(sum(n for _, n in shapes), H, D)
    k = torch.cat([keys[c:] for keys, (c, _) in zip(full_k, shapes, strict=True)])
    v = torch.cat([values[c:] for values, (c, _) in zip(full_v, shapes, strict=True)])
    meta = AttentionMetadata.build(
        tables, [c for c, _ in shapes], [n for _, n in shapes], BS, CPU, HKV, KVWorkspace(),
        fused_decode=fused, window=window,
    )  # fmt: skip
    starts = [sum(n for _, n in shapes[:i]) for i in range(len(shapes))]
    decoding = [start for start, (c, n) in zip(starts, shapes, strict=True) if n == 1 and c]
    if fused:
        assert meta.fused is not None and meta.fused.tables.shape[0] == 7 and not meta.decodes
        assert meta.fused.rows.tolist() == decoding
        # decodes alone: no cache rows to copy, the kernel writes them
        assert (meta.kv_rows.numel() == 0) == (shapes is DECODES_ONLY)
    else:
        assert len(meta.decodes) >= 3 and meta.fused is None
        if window is not None:  # no group gathers more blocks than a window spans
            assert max(g.width for g in meta.decodes) <= -(-window // BS) + 1
    assert len(meta.prefills) == len(shapes) - 7
    if meta.prefills:
        # the prompt longer than a window of 5 is banded, not is_causal; the chunk's first
        # query (position 8) sees from position 4, the start of its second block
        assert [p.mask is None for p in meta.prefills] == [window != 5, False]
        assert [p.first_key for p in meta.prefills] == [0, 4 if window == 5 else 0]
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    start = 0
    for (cached, new), keys, values, table in zip(shapes, full_k, full_v, tables, strict=True):
        want = _dense(q[start : start + new], keys, values, cached, window)
        torch.testing.assert_close(out[start : start + new], want, rtol=1e-5, atol=1e-5)
        # the new tokens' K/V were written into the sequence's blocks
        for p in range(cached, cached + new):
            assert torch.equal(k_cache[table[p // BS], :, p % BS], keys[p])
            assert torch.equal(v_cache[table[p // BS], :, p % BS], values[p])
        start += new


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_decode_groups_take_attention_output_in_any_layout(
    monkeypatch: pytest.MonkeyPatch, window: int | None
) -> None:
    """CUDA's attention kernels may return an output whose strides ``view`` cannot merge
    (found on an H100): the same values in such a layout give the same answer."""
    real = F.scaled_dot_product_attention

    def strided(*args: object, **kwargs: object) -> torch.Tensor:
        o = real(*args, **kwargs)  # type: ignore[arg-type]
        return o.transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(F, "scaled_dot_product_attention", strided)
    test_paged_attention_matches_dense_attention(monkeypatch, False, INTERLEAVED, window)


def test_workspace_grows_and_is_reused() -> None:
    ws = KVWorkspace()
    ws.reserve(10, BS, D, torch.float32, CPU)
    first = ws.keys
    assert first.shape[0] >= 10 and first.shape[1:] == (BS, D)
    ws.reserve(8, BS, D, torch.float32, CPU)
    assert ws.keys is first  # big enough: kept
    ws.reserve(first.shape[0] + 1, BS, D, torch.float32, CPU)
    assert ws.keys.shape[0] > first.shape[0] and ws.values.shape == ws.keys.shape


def _decodes(seed: int, count: int) -> tuple[list[int], list[list[int]], AttentionMetadata]:
    """``count`` sequences of random context, one new token each, in random blocks: their
    contexts, block tables and the ``cpu`` kernel's metadata."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    contexts = [rng.randint(1, 60) for _ in range(count)]
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + 1) // BS))] for c in contexts]
    meta = AttentionMetadata.build(
        tables, contexts, [1] * count, BS, CPU, HKV, KVWorkspace(), fused_decode=True
    )
    return contexts, tables, meta


def test_cpu_kernel_splits_its_sequences_over_torchs_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With torch on two threads the kernel deals the sequences to two Python threads (it
    releases the GIL; by default only where torch's OpenMP workers yield soon: test at the
    end); each row is computed by the same code either way, so the results are the same
    bits, and every sequence's new K/V is written once."""
    from kiln.llm import attention_cpu

    monkeypatch.setattr(attention_cpu, "PARALLEL", True)
    dealt: list[int] = []
    threaded = attention_cpu._threaded

    def spy(threads: int, *args: Any) -> None:
        dealt.append(threads)
        threaded(threads, *args)

    monkeypatch.setattr(attention_cpu, "_threaded", spy)
    contexts, tables, meta = _decodes(3, 9)
    cache = torch.randn(cache_shape(NUM_BLOCKS, BS, HKV, D))
    q = torch.randn(len(contexts), H, D)
    k, v = torch.randn(len(contexts), HKV, D), torch.randn(len(contexts), HKV, D)
    outs, caches = [], []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            k_cache, v_cache = cache.clone(), cache.clone() * 2
            outs.append(paged_attention(q, k, v, k_cache, v_cache, meta))
            caches.append((k_cache, v_cache))
    finally:
        torch.set_num_threads(threads)
    assert dealt == [2]  # one thread, then two
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    for i, (c, table) in enumerate(zip(contexts, tables, strict=True)):
        assert torch.equal(caches[1][0][table[c // BS], :, c % BS], k[i])


def test_two_engines_can_run_the_threaded_kernel_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two LLM models step on their own engine threads: concurrent calls of the threaded
    kernel must each get their own right answer."""
    from kiln.llm import attention_cpu

    monkeypatch.setattr(attention_cpu, "PARALLEL", True)
    contexts, _, meta = _decodes(4, 8)
    jobs = []
    for _ in range(2):
        cache = torch.randn(cache_shape(NUM_BLOCKS, BS, HKV, D))
        q = torch.randn(len(contexts), H, D)
        k, v = torch.randn(len(contexts), HKV, D), torch.randn(len(contexts), HKV, D)
        jobs.append((q, k, v, cache))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = [paged_attention(q, k, v, c.clone(), c.clone(), meta) for q, k, v, c in jobs]
        got: list[list[torch.Tensor]] = [[], []]

        def run(i: int) -> None:
            torch.set_num_threads(2)  # per thread, as each engine thread has
            q, k, v, c = jobs[i]
            for _ in range(20):
                got[i].append(paged_attention(q, k, v, c.clone(), c.clone(), meta))

        workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(threads)
    for i in range(2):
        assert len(got[i]) == 20 and all(torch.equal(out, want[i]) for out in got[i])


def test_warm_up_compiles_what_a_real_step_calls() -> None:
    """The engine warms the kernel up at load: a real step (q, k, v strided views of the
    fused projection) must not compile anything more, or the first request waits seconds."""
    from kiln.llm import attention_cpu

    attention_cpu.warm_up()
    assert attention_cpu._compiled is not None
    before = len(attention_cpu._compiled.signatures)
    torch.manual_seed(5)
    contexts = [3, 9, 17]
    tables = [[i * 8 + j for j in range(8)] for i in range(len(contexts))]
    qkv = torch.randn(len(contexts), H + 2 * HKV, D)  # one token each, q/k/v fused
    q, k, v = qkv[:, :H], qkv[:, H : H + HKV], qkv[:, H + HKV :]
    cache = torch.randn(cache_shape(NUM_BLOCKS, BS, HKV, D))
    meta = AttentionMetadata.build(
        tables, contexts, [1] * len(contexts), BS, CPU, HKV, KVWorkspace(), fused_decode=True
    )
    _attend_on(1, q, k, v, cache, meta)
    assert len(attention_cpu._compiled.signatures) == before


ONE_RUNTIME = """
import sys, torch
from pathlib import Path
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
import numba

torch.set_num_threads(2)
engine = LLMEngine(Path(sys.argv[1]), EngineConfig(num_gpu_blocks=32, attention_backend="cpu"))
out = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0))
assert [len(o) for o in out] == [4, 4]
try:
    print("layer", numba.threading_layer())
except ValueError:
    print("layer none")
print("gomp", sorted({l.split()[-1] for l in open("/proc/self/maps") if "libgomp" in l}))
"""


def test_two_torch_threads_start_no_second_openmp_runtime(tmp_path: Path) -> None:
    """numba's parallel layer is a second libgomp beside torch's: the two teams' idle threads
    spin against each other (docs/design/llm-cpu-threads.md). With torch on two threads the
    engine decodes (warm-up included) without ever starting numba's thread team."""
    import subprocess
    import sys

    from tests.llm_models import build_tiny_llm

    folder = build_tiny_llm(tmp_path / "m")
    done = subprocess.run(
        [sys.executable, "-c", ONE_RUNTIME, str(folder)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "2"},
    )
    assert done.returncode == 0, done.stderr
    assert "layer none" in done.stdout
    gomp = done.stdout.split("gomp", 1)[1]
    assert gomp.count("libgomp") <= 1, gomp


@pytest.mark.parametrize(
    ("env", "threaded"),
    [
        ({}, False),  # libgomp's default: its idle worker spins ~3 ms, a helper would fight it
        ({"OMP_WAIT_POLICY": "PASSIVE"}, True),  # the engine process's setting
        ({"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": "10000"}, True),
        ({"GOMP_SPINCOUNT": "10000"}, True),
        ({"GOMP_SPINCOUNT": "300000"}, False),
        ({"OMP_WAIT_POLICY": "ACTIVE"}, False),
    ],
)
def test_the_kernel_takes_helper_threads_where_openmp_yields(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], threaded: bool
) -> None:
    from kiln.llm import attention_cpu

    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(attention_cpu, "_YIELDS", None)  # read again from this environment
    dealt: list[int] = []
    monkeypatch.setattr(attention_cpu, "_threaded", lambda threads, *a: dealt.append(threads))
    contexts, _, meta = _decodes(5, 8)
    cache = torch.randn(cache_shape(NUM_BLOCKS, BS, HKV, D))
    q = torch.randn(len(contexts), H, D)
    k, v = torch.randn(len(contexts), HKV, D), torch.randn(len(contexts), HKV, D)
    _attend_on(2, q, k, v, cache, meta)
    assert dealt == ([2] if threaded else [])


def _attend_on(
    threads: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
    meta: AttentionMetadata,
) -> None:  # fmt: skip
    """One decode attention with torch on ``threads`` threads (restored after)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        paged_attention(q, k, v, cache.clone(), cache.clone(), meta)
    finally:
        torch.set_num_threads(before)
