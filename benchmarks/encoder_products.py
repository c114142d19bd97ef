"""An encoder's matrix products on this CPU: MKL (``F.linear``) against oneDNN's packed
weights (``mkldnn._linear_pointwise``), by rows, for bert-base's four product shapes; and
SDPA's flash kernel against the spelled-out math path for attention. The figures behind
docs/design/llm-encoders.md.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/encoder_products.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((768, 2304), (768, 768), (768, 3072), (3072, 768))  # q/k/v, o, up, down


def best_seconds(fn: Callable[..., object], *args: object, rounds: int = 5) -> float:
    fn(*args)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - t0)
    return best


def _masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="512,1024,2048,4096,8192")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"{args.threads} threads; GFLOP/s, best of 5\n")  # fmt: skip
    print("| rows | product | MKL | oneDNN packed |\n|---|---|---|---|")
    for m in (int(r) for r in args.rows.split(",")):
        for k, n in SHAPES:
            x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
            flop = 2 * m * k * n
            mkl = flop / best_seconds(F.linear, x, w, b) / 1e9
            onednn = torch.ops.mkldnn._linear_pointwise
            dnn = flop / best_seconds(onednn, x, packed, b, "none", [], "") / 1e9
            print(f"| {m} | {k} -> {n} | {mkl:.0f} | {dnn:.0f} |", flush=True)
    print("\n| inputs x tokens | flash | flash, padding mask | math, padding mask |")
    print("|---|---|---|---|")
    for b, n in ((32, 64), (16, 128), (8, 256)):
        q, k, v = (torch.randn(b, 12, n, 64) for _ in range(3))
        mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
        mask[0, ..., -n // 8 :] = False

        ms = [
            1e3 * best_seconds(F.scaled_dot_product_attention, q, k, v),
            1e3 * best_seconds(_masked, q, k, v, mask),
            1e3 * best_seconds(_math, q, k, v, mask),
        ]
        print(f"| {b} x {n} | {ms[0]:.1f} ms | {ms[1]:.1f} ms | {ms[2]:.1f} ms |", flush=True)


if __name__ == "__main__":
    main()
