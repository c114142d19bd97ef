"""Which CPU projections should use oneDNN's packed weight (``kiln.llm.cpu_linear``)?

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/llm_cpu_gemm_policy.py [--threads 2]

One "step" of the 125 M Llama's projections (``llm_vllm.py``'s ``125m`` shape): q/k/v
(768 -> 1,280), o (768 -> 768), gate/up (768 -> 4,096) and down (2,048 -> 768) in each of 12
layers with distinct random weights (so, as in the engine, they stream from memory, not
cache), then the LM head (768 -> 32,000). For each batch of rows, three policies, median of
5 steps after 2 warm-ups, in milliseconds:

- ``mkl``: every product through ``F.linear`` (MKL's sgemm);
- ``wide``: oneDNN's packed product for the wide projections (q/k/v, gate/up, LM head) at
  2..192 rows, ``F.linear`` otherwise (cpu_linear's first policy);
- ``all``: every projection packed; wide ones from one row, o/down from two (the policy now).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

SHAPES = [(768, 1280), (768, 768), (768, 4096), (2048, 768)]  # (in, out) per layer
LAYERS = 12


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k) for k, n in SHAPES] for _ in range(LAYERS)]
    head = torch.randn(32000, 768)

    def pack(w: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(w, 64)

    packed = [[pack(w) for w in layer] for layer in weights]
    head_packed = pack(head)

    def product(policy: str, x: torch.Tensor, w: torch.Tensor, p: torch.Tensor) -> None:
        rows, wide = x.shape[0], w.shape[0] >= 1.5 * w.shape[1]
        use = {"mkl": False, "wide": wide and 2 <= rows <= 192,
               "all": rows <= 192 and (rows >= 2 or wide)}[policy]  # fmt: skip
        if use:
            torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
        else:
            F.linear(x, w)

    print(f"threads {args.threads}; ms a step (12 layers + LM head), median of 5")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (768, 2048)}
        cells = []
        for policy in ("mkl", "wide", "all"):

            def step(policy: str = policy, xs: dict[int, torch.Tensor] = xs) -> None:
                for layer, layer_packed in zip(weights, packed, strict=True):
                    for (k, _), w, p in zip(SHAPES, layer, layer_packed, strict=True):
                        product(policy, xs[k], w, p)
                product(policy, xs[768], head, head_packed)

            for _ in range(2):
                step()
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            cells.append(f"{policy} {statistics.median(times) * 1e3:7.1f}")
        print(f"rows {rows:4d}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
