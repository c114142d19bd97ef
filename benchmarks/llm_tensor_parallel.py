"""Tensor parallelism's cost per step on the CPU (gloo): decode steps of a small random
Llama with 1 and 2 ranks, in one run, as a ratio. On the CPU both ranks share the host's
cores, so this measures the overhead (two all-reduces a layer, the step message), not a
speed-up: that needs GPUs, where each rank has its own (docs/scaling.md).

    PYTHONPATH=src .venv/bin/python benchmarks/llm_tensor_parallel.py [--layers 8 --hidden 512]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm


def _decode_ms(folder: Path, tp: int, batch: int, tokens: int) -> float:
    """Mean milliseconds of a decode step of ``batch`` sequences (prefill excluded)."""
    engine = LLMEngine(
        folder,
        EngineConfig(tensor_parallel_size=tp, dtype="float32", kv_cache_memory_bytes=64 << 20),
    )
    try:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"r{i}", [5 + i, 6, 7, 8, 9, 10, 11, 12], params)
        engine.step()  # the prefill
        start, steps = time.perf_counter(), 0
        while engine.has_work():
            engine.step()
            steps += 1
        return (time.perf_counter() - start) / steps * 1e3
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    a = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_llm(
            Path(tmp) / "m",
            hidden_size=a.hidden,
            intermediate_size=4 * a.hidden,
            num_hidden_layers=a.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
        )
        one = _decode_ms(folder, 1, a.batch, a.tokens)
        two = _decode_ms(folder, 2, a.batch, a.tokens)
    print(f"load average {os.getloadavg()[0]:.1f}; {a.layers} layers, hidden {a.hidden}, "
          f"batch {a.batch}")  # fmt: skip
    print(f"decode step: 1 rank {one:.2f} ms, 2 ranks (gloo) {two:.2f} ms, ratio {two / one:.2f}")


if __name__ == "__main__":
    main()
