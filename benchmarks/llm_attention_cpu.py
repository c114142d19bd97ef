"""kiln's CPU decode-attention kernel (``attention_backend: cpu``) against its two floors.

    .venv/bin/python benchmarks/llm_attention_cpu.py [--window W] [--json out.json]

One decode step's attention for 64 sequences (contexts uniform in 150..420 tokens, 2 KV heads
x 2 query heads, head_dim 64, block 16: the shape of benchmarks/llm_cpu.py's model), in four
layers whose K/V pools are separate, as in the engine: a step reads every layer's whole
context once, ~18 MB a layer, so the bytes come from memory, not cache. Blocks are handed out
round-robin across sequences, as the block manager does while sequences grow.

Three timings, each the median of 7 rounds of 10 steps:

- ``kernel``: kiln's kernel (``kiln.llm.attention_cpu``), cold pools;
- ``hot``: the same kernel with every block table pointing into 4 blocks (cache-resident):
  its arithmetic alone;
- ``stream``: a loop that only reads every key and value of the same blocks (a sum), cold:
  what moving the bytes costs with this access pattern on one core;
- ``kernel xN``: the kernel with its sequences split over the machine's N cores (what the
  engine runs when torch has N threads).

If the kernel's time is near ``stream`` it is memory-bound; near ``hot`` + ``stream`` the
loads and the arithmetic do not overlap.

``--window W``: every sequence attends to its last ``W`` positions only (Mistral's sliding
window); the kernel skips the blocks before the window, ``stream`` reads what it reads, and
the MB a layer count only those bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from kiln.llm import attention_cpu

LAYERS, POOL, KV_HEADS, GROUP, BLOCK, DIM, SEQS = 4, 4096, 2, 2, 16, 64, 64


def _stream(k_cache: Any, v_cache: Any, tables: Any, context: Any, start: Any, out: Any) -> None:
    kv_heads, block_size, dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    acc = np.zeros(dim, dtype=np.float32)
    for b in range(tables.shape[0]):
        for j in range(start[b] // block_size, (context[b] + block_size - 1) // block_size):
            block = tables[b, j]
            for h in range(kv_heads):
                for t in range(block_size):
                    for d in range(dim):
                        acc[d] += k_cache[block, h, t, d] + v_cache[block, h, t, d]
    out[0, 0, :] = acc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--window", type=int, default=None, help="sliding window (tokens)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not attention_cpu.available():
        sys.exit("numba is not installed: pip install 'kiln-serve[llm]'")
    import numba

    stream = numba.njit(fastmath=True, nogil=True, boundscheck=False)(_stream)
    kernel = attention_cpu._compiled
    assert kernel is not None
    rng = np.random.default_rng(0)
    shape = (POOL, KV_HEADS, BLOCK, DIM)
    ks = [rng.standard_normal(shape, dtype=np.float32) for _ in range(LAYERS)]
    vs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(LAYERS)]
    context = rng.integers(150, 420, SEQS).astype(np.int32)
    width = int(-(-context.max() // BLOCK))
    cold = np.zeros((SEQS, width), np.int32)
    hot = np.zeros((SEQS, width), np.int32)
    handed = 0
    for j in range(width):
        for i in range(SEQS):
            if j < -(-context[i] // BLOCK):
                cold[i, j] = handed
                hot[i, j] = handed % 4
                handed += 1
    # one new token a sequence: its query heads, and its key and value (written by the kernel)
    q = rng.standard_normal((SEQS, KV_HEADS * GROUP, DIM), dtype=np.float32)
    k_new = rng.standard_normal((SEQS, KV_HEADS, DIM), dtype=np.float32)
    v_new = rng.standard_normal((SEQS, KV_HEADS, DIM), dtype=np.float32)
    rows = np.arange(SEQS, dtype=np.int64)
    window = args.window
    start = np.maximum(context - window, 0) if window else np.zeros_like(context)
    out = np.empty_like(q)
    scale = DIM**-0.5

    def attend(layer: int, tables: np.ndarray) -> None:
        kernel(q, k_new, v_new, rows, ks[layer], vs[layer], tables, context, start, scale, out)

    def attend_parallel(layer: int, tables: np.ndarray) -> None:
        args = (q, k_new, v_new, rows, ks[layer], vs[layer], tables, context, start, scale, out)
        attention_cpu._threaded(threads, *args)

    def read(layer: int, tables: np.ndarray) -> None:
        stream(ks[layer], vs[layer], tables, context, start, out)

    def step(fn: Any, tables: np.ndarray) -> None:
        for layer in range(LAYERS):
            fn(layer, tables)

    runs = {"kernel": (attend, cold), "hot": (attend, hot), "stream": (read, cold)}
    threads = os.cpu_count() or 1
    if threads > 1:  # the kernel's sequences split over every core (engine: torch's threads)
        runs[f"kernel x{threads}"] = (attend_parallel, cold)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for fn, tables in runs.values():
        step(fn, tables)  # compile, first touch
    for _ in range(args.rounds):
        for name, (fn, tables) in runs.items():
            t0 = time.perf_counter()
            for _ in range(10):
                step(fn, tables)
            times[name].append((time.perf_counter() - t0) / 10 / LAYERS)
    # the keys and values the kernel reads (from each sequence's start on)
    read_tokens = int((context - start).sum())
    layer_bytes = read_tokens * KV_HEADS * DIM * 4 * 2
    result: dict[str, Any] = {
        "machine": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count()},
        "sequences": SEQS,
        "context_tokens": int(context.sum()),
        "window": window,
        "read_tokens": read_tokens,
        "layer_mb": layer_bytes / 1e6,
    }
    print(f"{SEQS} sequences, {int(context.sum())} context tokens, window {window}, "
          f"{layer_bytes / 1e6:.1f} MB of K/V read a layer")  # fmt: skip
    for name, values in times.items():
        median = statistics.median(values)
        result[name] = {"ms_per_layer": median * 1e3, "gb_s": layer_bytes / median / 1e9}
        rate = layer_bytes / median / 1e9
        print(f"  {name:9s} {median * 1e3:6.2f} ms a layer   {rate:5.1f} GB/s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
