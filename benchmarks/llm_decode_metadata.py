"""Host CPU time to build one decode step's attention metadata, as CUDA-graph replay does
each step (``DecodeGraphs._metadata``: block tables padded to the most pages a sequence can
hold), for the ``flex`` backend (a BlockMask per step) and the ``triton`` backend (block
tables and lengths for kiln's decode kernel, no BlockMask). Runs on the CPU (the work is the
host's); the cache is the 1.1B benchmark model's 4 GiB (4,097 pages of 16 tokens),
contexts of 384 tokens, one intra-op thread.

    python benchmarks/llm_decode_metadata.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kiln.llm.attention_flex import FlexMetadata


def build_ms(batch: int, triton_decode: bool, context: int, pages: int, reps: int) -> float:
    """Median CPU milliseconds of one build, over ``reps`` builds."""
    width = 2048 // 16  # max_model_len 2048: the graphs' padded width
    used = -(-context // 16)
    tables = [list(range(i * used, (i + 1) * used)) for i in range(batch)]
    computed = [context - 1] * batch
    cpu = torch.device("cpu")
    times = []
    for _ in range(reps + 3):
        start = time.process_time()
        FlexMetadata.build(tables, computed, [1] * batch, 16, pages, cpu,
                           max_pages_per_seq=width, triton_decode=triton_decode)  # fmt: skip
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=384)
    ap.add_argument("--pages", type=int, default=4097)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print("| batch | flex ms CPU / step | triton ms CPU / step | ratio |\n|--:|--:|--:|--:|")
    for batch in (1, 8, 64):
        flex = build_ms(batch, False, args.context, args.pages, args.reps)
        triton = build_ms(batch, True, args.context, args.pages, args.reps)
        print(f"| {batch} | {flex:.3f} | {triton:.3f} | {flex / triton:.1f}x |")


if __name__ == "__main__":
    main()
