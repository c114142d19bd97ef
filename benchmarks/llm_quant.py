"""Quantized checkpoints on CPU: weight memory and decode tokens/s per format, for one
~125M-shaped random Llama (hidden 768, 12 layers, 12 heads, MLP 3072, vocabulary 32,000).

    PYTHONPATH=src:. .venv/bin/python benchmarks/llm_quant.py --json llm_quant.json

Every format is written from the same float32 weights by the writers of tests/llm_quant.py
(the formats the hub's tools write), loaded by kiln's ``LLMEngine`` and run on the same
greedy requests: 1 and 8 sequences of a 16-token prompt and 64 new tokens (``ignore_eos``).
Weight memory is the bytes of the loaded model's parameters and buffers (the KV cache
apart); tok/s is new tokens over the ``generate`` wall time (prefill included, it is 16
tokens), best of --repeat runs. Threads: OMP_NUM_THREADS=1 unless set.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams

SHAPE = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def _base(folder: Path) -> Path:
    import transformers

    from tests.llm_models import build_tokenizer

    folder.mkdir(parents=True)
    build_tokenizer(folder)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def _weight_bytes(engine: LLMEngine) -> int:
    model = engine.runner.model
    seen: set[int] = set()
    total = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen or t is engine.runner.kv_cache:
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    # rope tables are buffers too, but the same for every format: counted alike
    return total


def _tok_s(engine: LLMEngine, batch: int, new: int, repeat: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 30000 + 100 for j in range(16)] for i in range(batch)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm
    best = 0.0
    for _ in range(repeat):
        start = time.perf_counter()
        engine.generate(prompts, params)
        best = max(best, batch * new / (time.perf_counter() - start))
    return best


def _best_us(fn: Any, n: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def kernels() -> list[dict[str, Any]]:
    """One [3072, 768] projection: float32 ``F.linear`` against torch's int8 and int4 CPU
    kernels fed float32 or bf16 activations, and W8A8 through ``torch._int_mm`` (per-token
    activation quantization included): why linear.py feeds the kernels bf16."""
    import torch.nn.functional as F

    aten = torch.ops.aten
    n, k = 3072, 768
    w = torch.randn(n, k)
    w8 = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    s = torch.rand(n)
    q4 = aten._convert_weight_to_int4pack_for_cpu(
        torch.randint(0, 16, (n, k), dtype=torch.int32), 1
    )
    sz = torch.rand(k // 128, n, 2)
    sb, szb = s.bfloat16(), sz.bfloat16()

    def int_mm(x: torch.Tensor) -> torch.Tensor:
        xs = x.abs().amax(1, keepdim=True) / 127
        xq = (x / xs).round().to(torch.int8)
        pad = max(17 - xq.shape[0], 0)  # _int_mm wants more than 16 rows
        out = torch._int_mm(F.pad(xq, (0, 0, 0, pad)), w8.t())[: x.shape[0]]
        return out.float() * xs * s

    def row(m: int) -> dict[str, Any]:
        x = torch.randn(m, k)
        xb = x.bfloat16()
        times = {
            "f32_linear_us": _best_us(lambda: F.linear(x, w)),
            "int8pack_f32_us": _best_us(lambda: aten._weight_int8pack_mm(x, w8, s)),
            "int8pack_bf16_us": _best_us(lambda: aten._weight_int8pack_mm(xb, w8, sb)),
            "int_mm_w8a8_us": _best_us(lambda: int_mm(x)),
            "int4pack_f32_us": _best_us(lambda: aten._weight_int4pack_mm_for_cpu(x, q4, 128, sz)),
            "int4pack_bf16_us": _best_us(
                lambda: aten._weight_int4pack_mm_for_cpu(xb, q4, 128, szb)
            ),
        }
        return {"rows": m, **{key: round(v) for key, v in times.items()}}

    rows = [row(m) for m in (1, 8, 64)]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def main() -> None:
    from tests import llm_quant

    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--kernels", action="store_true", help="the kernel table only")
    args = parser.parse_args()
    if args.kernels:
        report = {"torch": torch.__version__, "threads": torch.get_num_threads()}
        report["kernels"] = kernels()  # type: ignore[assignment]
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        return
    root = Path(tempfile.mkdtemp(prefix="kiln-quant-"))
    try:
        base = _base(root / "base")
        formats: dict[str, tuple[Path, dict[str, Any]]] = {
            "float32": (base, {}),
            "bfloat16 (dtype)": (base, {"dtype": "bfloat16"}),
            "float32 + fp8 KV cache": (base, {"kv_cache_dtype": "fp8"}),
            "fp8 (per-channel)": (
                llm_quant.write_fp8(base, root / "fp8", True, "compressed-tensors")[0],
                {},
            ),
            "int8 W8A16 (per-channel)": (
                llm_quant.write_int8(base, root / "int8", True, False)[0],
                {},
            ),
            "AWQ int4 g128": (llm_quant.write_awq(base, root / "awq")[0], {}),
            "GPTQ int4 g128 act-order": (
                llm_quant.write_gptq(base, root / "gptq", desc_act=True)[0],
                {},
            ),
        }
        rows = []
        for name, (folder, extra) in formats.items():
            config = EngineConfig(kv_cache_memory_bytes=256 << 20, **extra)
            engine = LLMEngine(folder, config)
            row = {
                "format": name,
                "weights_MiB": round(_weight_bytes(engine) / 2**20, 1),
                "kv_blocks": engine.runner.num_blocks,
                "tok_s_1": round(_tok_s(engine, 1, args.new_tokens, args.repeat), 1),
                "tok_s_8": round(_tok_s(engine, 8, args.new_tokens, args.repeat), 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            del engine
        report = {
            "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "rows": rows,
        }
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
