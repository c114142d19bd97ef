"""Speculative decoding (n-gram prompt lookup) on CPU: tok/s and TPOT with and without,
kiln's ``LLMEngine`` in-process, greedy, on a workload where lookup has something to find.

    PYTHONPATH=src .venv/bin/python benchmarks/llm_spec_decode.py --json spec.json

The model is Llama-shaped with random weights built here (no download), in two variants:
``looping``, its output layer scaled up as the tests' models are, whose greedy outputs
settle into repeating spans (the part of a "summarise / repeat the input" workload that
n-gram lookup exploits), and ``plain`` (the output layer as initialised), whose outputs
rarely repeat: what speculation costs when lookup proposes little that is accepted.
Prompts are a random span written twice (the input repeated). Every request has a fixed
output length (``ignore_eos``), so every configuration produces the same tokens (checked:
greedy speculation must not change one). The acceptance rate is what this model and workload
give, reported as measured; real models copying real text accept differently.

Threads: OMP_NUM_THREADS=1 by default (the machine is shared; see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def run(folder: Path, spec: str | None, prompts: list[list[int]], out_len: int) -> dict[str, Any]:
    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import SamplingParams
    from kiln.llm.spec_config import SpeculativeConfig

    config = EngineConfig(max_num_seqs=64, enable_prefix_caching=False)
    config.speculative_config = SpeculativeConfig.from_json(spec) if spec else None
    engine = LLMEngine(folder, config)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0][:8]], SamplingParams(max_tokens=4, temperature=0.0))  # warm
    seqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    steps = engine.stats.num_steps
    start = time.perf_counter()
    while engine.has_work():
        for r in engine.step():
            outputs[r.request_id].extend(r.new_token_ids)
    elapsed = time.perf_counter() - start
    tpots = [
        (s.last_token_time - s.first_token_time) / (s.num_output_tokens - 1)
        for s in seqs
        if s.first_token_time is not None and s.last_token_time is not None
    ]
    stats = engine.spec_stats
    tokens = sum(len(o) for o in outputs.values())
    result: dict[str, Any] = {
        "spec": spec,
        "requests": len(prompts),
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "tok_s": round(tokens / elapsed, 1),
        "tpot_ms_mean": round(1000 * statistics.mean(tpots), 2),
        "steps": engine.stats.num_steps - steps,
        # how repetitive the outputs are: what n-gram lookup can find in them
        "distinct_output_tokens_mean": round(
            statistics.mean(len(set(o)) for o in outputs.values()), 1
        ),
        "outputs": [outputs[f"r{i}"] for i in range(len(prompts))],
    }
    if stats is not None:
        result["acceptance_rate"] = round(
            stats.num_accepted_tokens / max(stats.num_draft_tokens, 1), 3
        )
        result["accepted_per_pos"] = stats.accepted_per_pos
        result["mean_tokens_per_verify"] = round(
            1 + stats.num_accepted_tokens / max(stats.num_drafts, 1), 2
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--span", type=int, default=48, help="tokens of input, written twice")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--models", nargs="+", default=["looping", "plain"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from tests.llm_models import build_tiny_llm

    rng = random.Random(0)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for variant in args.models:
            folder = build_tiny_llm(Path(tmp) / variant, **SHAPE)
            if variant == "plain":
                _unscale_lm_head(folder)
            print(f"model {variant}")
            results += _sweep(folder, variant, args, rng)
    if args.json:
        meta = {"machine": platform.platform(), "cpus": os.cpu_count(),
                "omp_threads": os.environ["OMP_NUM_THREADS"], "shape": SHAPE}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1))


def _unscale_lm_head(folder: Path) -> None:
    """Undo the tests' x8 on the output layer (see tests/llm_models.py)."""
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] / 8.0
    save_file(tensors, str(path), metadata={"format": "pt"})


def _sweep(
    folder: Path, variant: str, args: argparse.Namespace, rng: random.Random
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for n in args.concurrency:
        prompts = []
        for _ in range(n):
            span = [rng.randrange(10, SHAPE["vocab_size"]) for _ in range(args.span)]
            prompts.append(span + span)
        base = run(folder, None, prompts, args.output_len)
        base["model"] = variant
        results.append(base)
        print(f"concurrency {n:3d}  off   {base['tok_s']:8.1f} tok/s  "
              f"TPOT {base['tpot_ms_mean']:7.2f} ms  steps {base['steps']}  "
              f"distinct output tokens {base['distinct_output_tokens_mean']}")  # fmt: skip
        for k in args.k:
            spec = json.dumps(
                {"method": "ngram", "num_speculative_tokens": k,
                 "prompt_lookup_max": 4, "prompt_lookup_min": 1}
            )  # fmt: skip
            r = run(folder, spec, prompts, args.output_len)
            assert r["outputs"] == base["outputs"], "greedy speculation changed a token"
            r["model"] = variant
            results.append(r)
            print(f"concurrency {n:3d}  k={k}   {r['tok_s']:8.1f} tok/s  "
                  f"TPOT {r['tpot_ms_mean']:7.2f} ms  steps {r['steps']}  "
                  f"acceptance {r['acceptance_rate']:.2f}  "
                  f"tokens/verify {r['mean_tokens_per_verify']}  "
                  f"speedup {r['tok_s'] / base['tok_s']:.2f}x")  # fmt: skip
    for r in results:
        del r["outputs"]
    return results


if __name__ == "__main__":
    main()
