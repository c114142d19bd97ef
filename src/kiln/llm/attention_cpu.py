"""Decode attention on the CPU straight from the paged cache (``attention_backend: cpu``).

The portable backend (``attention.py``) gathers every decoding sequence's keys and values
out of their blocks into a dense tensor each layer and step, then runs SDPA over it: the
K/V bytes are read, written and read again, and on a CPU that memory traffic, not the
arithmetic, is most of a decode step (benchmarks/README.md, "LLM engine"). This kernel walks
each sequence's block table and reads every key and value once, in place, with an online
softmax (running maximum and sum, rescaled block by block), the way vLLM's CPU and GPU
paged-attention kernels do. With a sliding window each sequence's walk starts at the first
position inside its window: the blocks before it are not read at all.

It is compiled with numba (``kiln-serve[llm]``) when first used; without numba, or for a
cache dtype other than float32, the engine keeps the portable backend. Prefill chunks
still go through SDPA (``attention.py``): a prompt attends to its own new keys, which need
no gather.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

try:  # numba is in the llm extra; the portable backend works without it
    import numba
except ImportError:  # pragma: no cover - exercised where numba is not installed
    numba = None  # type: ignore[assignment]


def available() -> bool:
    return numba is not None


@dataclass(slots=True)
class FusedDecode:
    """Every decoding sequence of a step (one new token each), for the kernel."""

    #: [b] int64 index of each sequence's token among the step's flat tokens
    rows: np.ndarray
    #: [b, max blocks] int32 block table of each sequence (padded with 0, never read)
    tables: np.ndarray
    #: [b] int32 tokens in each sequence's context, the new one included
    context: np.ndarray
    #: [b] int32 first position each sequence's query sees (0 without a sliding window)
    start: np.ndarray

    @classmethod
    def build(
        cls, rows: list[tuple[int, int, list[int]]], block_size: int, window: int | None = None
    ) -> FusedDecode:
        """``rows``: (context length, flat token index, block table) per sequence;
        ``window``: the sliding window (None: the whole context)."""
        width = max(-(-ctx // block_size) for ctx, _, _ in rows)
        tables = np.zeros((len(rows), width), dtype=np.int32)
        for i, (ctx, _, table) in enumerate(rows):
            used = -(-ctx // block_size)
            tables[i, :used] = table[:used]
        return cls(
            rows=np.array([i for _, i, _ in rows], dtype=np.int64),
            tables=tables,
            context=np.array([ctx for ctx, _, _ in rows], dtype=np.int32),
            start=np.array(
                [0 if window is None else max(0, ctx - window) for ctx, _, _ in rows],
                dtype=np.int32,
            ),
        )


def _prefetch_intrinsic() -> Any:
    """``prefetch_l2(array, i)``: ask the CPU to start loading the cache line holding the
    flat (C-order) element ``i`` of ``array`` into L2 (``prefetcht1``). A hint: it never
    faults and returns nothing."""
    from llvmlite import ir
    from numba.core import cgutils, types
    from numba.extending import intrinsic

    @intrinsic
    def prefetch_l2(typingctx: Any, array: Any, index: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            byte_ptr = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(  # type: ignore[no-untyped-call]
                builder.module,
                ir.FunctionType(ir.VoidType(), [byte_ptr, i32, i32, i32]),
                "llvm.prefetch.p0i8",
            )
            address = builder.bitcast(builder.gep(data, [args[1]]), byte_ptr)
            # read (0), locality 2 (prefetcht1: L2; measured better here than L1 or
            # non-temporal), data cache (1)
            builder.call(fn, [address, i32(0), i32(2), i32(1)])
            return context.get_dummy_value()

        return types.void(array, index), codegen

    return prefetch_l2


_prefetch_l2 = _prefetch_intrinsic() if numba is not None else None

#: floats in one 64-byte cache line
_LINE = 16


def _attend(
    first: int,
    stride: int,
    q: Any,
    k_new: Any,
    v_new: Any,
    rows: Any,
    k_cache: Any,
    v_cache: Any,
    tables: Any,
    context: Any,
    start: Any,
    scale: float,
    out: Any,
) -> None:
    """Sequences ``first``, ``first + stride``, ... of the step (a thread's share; all of
    them for ``0, 1``). ``q`` [T, H, D] and ``k_new``/``v_new`` [T, Hkv, D]: the step's new
    tokens (strided views are fine); sequence ``b``'s token is row ``rows[b]``. Caches
    [blocks, Hkv, bs, D]; ``out`` [T, H, D] gets the rows of the decoding tokens. Query
    head ``h * G + g`` reads KV head ``h``. Sequence ``b`` attends to positions
    ``start[b] .. context[b] - 1`` (a sliding window; ``start`` 0: all of them): its walk
    begins in the block holding ``start[b]``.

    First each sequence's new key and value go into their slot of its last block (so a
    decode-only step needs no separate cache write). Then, for each (sequence, KV head):
    the G query heads sharing that KV head read each key and value row once; softmax is
    online (running max ``m`` and sum ``l``, the accumulator rescaled when the max grows),
    so nothing of size context is materialised.

    The K/V bytes come from memory, not cache (a step reads every layer's whole context),
    and waiting for them was as long as the arithmetic. So while the G query heads work on
    one (block, head), the kernel prefetches the next one's keys (during the first query
    head's pass) and values (during the last one's), a few cache lines per key row: the
    loads overlap the arithmetic, and few are in flight at once (microbenchmark in
    benchmarks/llm_attention_cpu.py)."""
    b_count = rows.shape[0]
    kv_heads, block_size, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // kv_heads
    for b in range(first, b_count, stride):
        last = context[b] - 1
        slot_block = tables[b, last // block_size]
        for h in range(kv_heads):
            for d in range(dim):
                k_cache[slot_block, h, last % block_size, d] = k_new[rows[b], h, d]
                v_cache[slot_block, h, last % block_size, d] = v_new[rows[b], h, d]
    head_floats = block_size * dim  # one head's keys (or values) in one block
    block_floats = kv_heads * head_floats
    k_flat = k_cache.reshape(-1)
    v_flat = v_cache.reshape(-1)
    lines_per_row = max(dim // _LINE, 1)
    scores = np.empty((group, block_size), dtype=np.float32)
    # this (sequence, KV head)'s query rows, contiguous: ``q`` may be a strided view, and a
    # dot product over a stride LLVM cannot see is not vectorised
    query = np.empty((group, dim), dtype=np.float32)
    acc = np.empty((group, dim), dtype=np.float32)
    m = np.empty(group, dtype=np.float32)
    l_sum = np.empty(group, dtype=np.float32)
    for b in range(first, b_count, stride):
        n = context[b]
        token = rows[b]
        blocks = (n + block_size - 1) // block_size
        begin = start[b]
        j0 = begin // block_size  # the first block inside the window
        for h in range(kv_heads):
            for g in range(group):
                m[g] = -np.inf
                l_sum[g] = 0.0
                for d in range(dim):
                    acc[g, d] = 0.0
                    query[g, d] = q[token, h * group + g, d] * scale
            for j in range(j0, blocks):
                block = tables[b, j]
                # what this loop reads next: this head's next block, else the next head's
                # first block, else the next sequence's
                if j + 1 < blocks:
                    upcoming = tables[b, j + 1] * block_floats + h * head_floats
                elif h + 1 < kv_heads:
                    upcoming = tables[b, j0] * block_floats + (h + 1) * head_floats
                elif b + stride < b_count:
                    upcoming = tables[b + stride, start[b + stride] // block_size] * block_floats
                else:
                    upcoming = -1
                # this block's rows in the window: [low, count) (low > 0 only in the first)
                low = max(begin - j * block_size, 0)
                count = min(block_size, n - j * block_size)
                for g in range(group):
                    top = m[g]
                    # counted from 0, not ``range(low, count)``: that form ran the whole
                    # kernel ~10% slower (numba's index code no longer simplified)
                    for i in range(count - low):
                        t = low + i
                        if upcoming >= 0 and g == 0:
                            row = upcoming + t * dim
                            for c in range(lines_per_row):
                                _prefetch_l2(k_flat, row + c * _LINE)
                        if upcoming >= 0 and g == group - 1:
                            row = upcoming + t * dim
                            for c in range(lines_per_row):
                                _prefetch_l2(v_flat, row + c * _LINE)
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += query[g, d] * k_cache[block, h, t, d]
                        scores[g, t] = s
                        if s > top:
                            top = s
                    if upcoming >= 0 and (g == 0 or g == group - 1):
                        # a partly filled last block, or the window's first: the rows the
                        # loop above did not visit
                        for u in range(count, block_size + low):
                            row = upcoming + (u - block_size if u >= block_size else u) * dim
                            for c in range(lines_per_row):
                                if g == 0:
                                    _prefetch_l2(k_flat, row + c * _LINE)
                                if g == group - 1:
                                    _prefetch_l2(v_flat, row + c * _LINE)
                    # the first block: m is -inf and the (empty) accumulator stays 0
                    correction = math.exp(m[g] - top) if m[g] > -np.inf else np.float32(0.0)
                    l_sum[g] *= correction
                    for d in range(dim):
                        acc[g, d] *= correction
                    for i in range(count - low):
                        t = low + i
                        p = np.float32(math.exp(scores[g, t] - top))
                        l_sum[g] += p
                        for d in range(dim):
                            acc[g, d] += p * v_cache[block, h, t, d]
                    m[g] = top
            for g in range(group):
                inverse = np.float32(1.0) / l_sum[g]
                for d in range(dim):
                    out[token, h * group + g, d] = acc[g, d] * inverse


# fastmath lets LLVM vectorise the dot products (reassociation); nogil lets the server's
# event loop run while a step computes; cache: compiled once per machine, not per start.
_jit = (
    numba.njit(fastmath=True, nogil=True, cache=True, boundscheck=False)
    if numba is not None
    else None
)
_attend_compiled = _jit(_attend) if _jit is not None else None


def _serial(
    q: Any, k_new: Any, v_new: Any, rows: Any, k_cache: Any, v_cache: Any, tables: Any,
    context: Any, start: Any, scale: float, out: Any,
) -> None:  # fmt: skip
    _attend_compiled(0, 1, q, k_new, v_new, rows, k_cache, v_cache, tables, context, start,
                     scale, out)  # fmt: skip


_compiled = _jit(_serial) if _jit is not None else None

#: Deal each step's sequences round-robin over as many Python threads as torch's matrix
#: products use (the kernel releases the GIL; contexts are mixed, so each thread gets a
#: similar share of the bytes). Not numba's ``parallel=True``: its OpenMP runtime is not
#: torch's, and the two teams' idle threads spun against each other (3x the CPU a decode
#: step; docs/design/llm-cpu-threads.md). These threads sleep between steps. None: when
#: torch's own OpenMP workers stop spinning soon after a region (``_openmp_yields``), as in
#: the engine process; with libgomp's default ~3 ms of spinning a helper would fight torch's
#: idle worker for the core (measured slower in-process).
PARALLEL: bool | None = None
#: fewer decoding sequences than this stay on the calling thread (the hand-off costs more)
MIN_PARALLEL = 4
_POOL_LOCK = threading.Lock()
_pool: ThreadPoolExecutor | None = None


#: ``_openmp_yields()``, read once (libgomp read the environment once, when torch loaded)
_YIELDS: bool | None = None


def _openmp_yields() -> bool:
    """This process's GNU OpenMP settings put a waiting worker to sleep within ~1 ms
    (``OMP_WAIT_POLICY=PASSIVE`` or a ``GOMP_SPINCOUNT`` of at most 100,000)."""
    global _YIELDS
    if _YIELDS is None:
        _YIELDS = _read_openmp_env()
    return _YIELDS


def _read_openmp_env() -> bool:
    spin = os.environ.get("GOMP_SPINCOUNT", "").strip()
    if spin.isdigit():
        return int(spin) <= 100_000
    return os.environ.get("OMP_WAIT_POLICY", "").strip().upper() == "PASSIVE"


def _workers(helpers: int) -> ThreadPoolExecutor:
    """The shared helper threads, at least ``helpers`` of them."""
    global _pool
    with _POOL_LOCK:
        if _pool is None or _pool._max_workers < helpers:
            old, _pool = _pool, ThreadPoolExecutor(helpers, thread_name_prefix="kiln-attention")
            if old is not None:
                old.shutdown(wait=False)
        return _pool


def _threaded(threads: int, *args: Any) -> None:
    """The kernel over ``threads`` threads: the caller computes sequences 0, threads, ...;
    helpers the others. Each thread owns its sequences' rows of ``out`` and cache slots."""
    pool = _workers(threads - 1)
    jobs = [pool.submit(_attend_compiled, first, threads, *args) for first in range(1, threads)]
    try:
        _attend_compiled(0, threads, *args)
    finally:
        for job in jobs:
            job.result()


def warm_up() -> None:
    """Compile (or load from numba's cache) before the first request waits for it."""
    if _compiled is None:
        return
    # the layouts of a real step: q, k and v are strided views of the fused projection's
    # output (one compiled specialisation per layout). Two tokens: a [1, 1, D] slice would
    # count as contiguous, compile the contiguous variant, and leave the strided one to the
    # first request (seconds)
    qkv = np.zeros((2, 3, 8), dtype=np.float32)
    cache = np.ones((1, 1, 4, 8), dtype=np.float32)
    rows = np.zeros(1, np.int64)
    tables = np.zeros((1, 1), np.int32)
    out = np.zeros((2, 1, 8), dtype=np.float32)
    args = (qkv[:, :1], qkv[:, 1:2], qkv[:, 2:], rows, cache, cache.copy(), tables,
            np.ones(1, np.int32), np.zeros(1, np.int32), 1.0, out)  # fmt: skip
    _compiled(*args)
    _attend_compiled(0, 1, *args)  # the entry the helper threads call


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    fused: FusedDecode,
    out: torch.Tensor,
    scale: float | None = None,
) -> None:
    """Attention of every decoding sequence's new token, after writing its key and value into
    the cache. ``q`` [T, H, D], ``k``/``v`` [T, Hkv, D] (the step's new tokens, strided views
    allowed), caches [num_blocks, Hkv, block_size, D] float32; results go into the decoding
    rows of ``out`` ([T, H, D], contiguous)."""
    assert _compiled is not None, "needs numba"
    assert out.is_contiguous()
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[2])
    args = (q.numpy(), k.numpy(), v.numpy(), fused.rows, k_cache.numpy(), v_cache.numpy(),
            fused.tables, fused.context, fused.start, scale, out.numpy())  # fmt: skip
    # as many threads as torch's matrix products use (OMP_NUM_THREADS / torch.set_num_threads)
    sequences = fused.rows.shape[0]
    parallel = _openmp_yields() if PARALLEL is None else PARALLEL
    threads = min(torch.get_num_threads(), sequences) if parallel else 1
    if threads > 1 and sequences >= MIN_PARALLEL:
        _threaded(threads, *args)
    else:
        _compiled(*args)
