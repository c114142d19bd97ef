"""The physical limit of ``llm_vllm.py``'s workload on this machine: how many output tokens a
second any float32 engine could reach if every step ran at the CPU's measured peak.

    .venv/bin/python benchmarks/llm_cpu_bound.py [--model 125m] [--threads 2]

Two machine figures, measured here with ``--threads`` threads (torch, MKL):

- ``peak``: the best GFLOP/s of large float32 matrix products (the most the cores do);
- ``bandwidth``: GB/s of streaming the model's weights once through a one-row product per
  weight (what a decode step of one sequence must at least read; bigger than the caches).

Then the workload (the same 64 seeded requests as ``llm_vllm.py``), scheduled the way both
engines run it: every prompt prefilled first (compute-bound, at ``peak``), then decode steps
in which step ``s`` carries every request still generating; a step takes at least the longer
of its arithmetic at ``peak`` and one read of the weights at ``bandwidth``. Attention's
arithmetic is counted (QK and PV over each token's context); sampling, norms, RoPE and every
other element-wise operation are not (free), so the bound is generous. The output: the
bound's output tok/s, and what fraction of it a measured figure is (``--measured``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.llm_vllm import COMMON, SHAPES, make_requests


def peak_gflops(threads: int) -> float:
    torch.set_num_threads(threads)
    best = 0.0
    for _ in range(3):  # the best of three rounds: a noisy neighbour only lowers a figure
        for m, k, n in [(2048, 2048, 768), (2048, 768, 4096), (1024, 4096, 1024)]:
            a, w = torch.randn(m, k), torch.randn(n, k)
            for _ in range(2):
                F.linear(a, w)
            t0 = time.perf_counter()
            for _ in range(5):
                F.linear(a, w)
            best = max(best, 2 * m * k * n * 5 / (time.perf_counter() - t0) / 1e9)
    return best


def bandwidth_gbs(shape: dict[str, int], threads: int) -> tuple[float, int]:
    """GB/s of one-row products over every projection weight of the model, and the bytes."""
    torch.set_num_threads(threads)
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    layer = [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]
    weights = [torch.randn(n, k) for _ in range(shape["num_hidden_layers"]) for k, n in layer]
    weights.append(torch.randn(v, h))
    total = sum(w.numel() * 4 for w in weights)
    xs = {k: torch.randn(1, k) for k in (h, i)}
    best = 0.0
    for _ in range(7):
        t0 = time.perf_counter()
        for w in weights:
            F.linear(xs[w.shape[1]], w)
        best = max(best, total / (time.perf_counter() - t0) / 1e9)
    return best, total


def flops_per_token(shape: dict[str, int], context: int, logits: bool) -> float:
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = shape["num_key_value_heads"] * h // shape["num_attention_heads"]
    per_layer = 2 * (h * (h + 2 * kv) + h * h + h * 2 * i + i * h) + 4 * context * h
    return shape["num_hidden_layers"] * per_layer + (2 * h * v if logits else 0)


def bound(shape: dict[str, int], requests: list[Any], peak: float, bw: float,
          weight_bytes: int) -> dict[str, float]:  # fmt: skip
    flops_s, bytes_s = peak * 1e9, bw * 1e9
    prefill = sum(
        sum(flops_per_token(shape, c + 1, c == len(r.prompt) - 1) for c in range(len(r.prompt)))
        for r in requests
    )
    t_prefill = prefill / flops_s
    t_decode = 0.0
    longest = max(r.output_len for r in requests)
    for s in range(1, longest):  # the first output token comes from the prefill
        work = sum(
            flops_per_token(shape, len(r.prompt) + s, True) for r in requests if r.output_len > s
        )
        t_decode += max(work / flops_s, weight_bytes / bytes_s)
    tokens = sum(r.output_len for r in requests)
    return {"prefill_s": t_prefill, "decode_s": t_decode, "seconds": t_prefill + t_decode,
            "output_tokens": tokens, "output_tok_s": tokens / (t_prefill + t_decode)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="125m", choices=sorted(SHAPES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--measured", action="append", default=[], metavar="NAME=TOK_S",
                    help="a measured output tok/s to put against the bound")  # fmt: skip
    args = ap.parse_args()
    shape = {**SHAPES[args.model], **COMMON}
    requests = make_requests(args.num_requests, args.seed, shape["vocab_size"],
                             (16, 256), (16, 256))  # fmt: skip
    peak = peak_gflops(args.threads)
    bw, weight_bytes = bandwidth_gbs(shape, args.threads)
    limit = bound(shape, requests, peak, bw, weight_bytes)
    result = {"model": args.model, "threads": args.threads, "peak_gflops": round(peak, 1),
              "weights_gbs": round(bw, 1), "weight_mb": round(weight_bytes / 1e6),
              **{k: round(v, 2) for k, v in limit.items()}}  # fmt: skip
    for item in args.measured:
        name, value = item.split("=")
        result[f"{name}_of_bound"] = round(float(value) / result["output_tok_s"], 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
