"""GGUF 4-bit files kept 4-bit: kiln's reading of Q4_0 / Q4_1 / Q4_K blocks against the
``gguf`` package's dequantizer, and a Q4_0 / Q4_1 file's logits against ``transformers``
loading the same file (dequantized).

Kept 4-bit when served in bfloat16 (the kernel's activation dtype); a float32 model
dequantizes at load, exactly as before. Tolerance: the bf16 model against float32
``transformers``: logits within 3% of their range; greedy tokens identical.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import numpy as np  # noqa: E402

from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.cpu_linear import PackedLinear  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.quantization import gguf_blocks  # noqa: E402
from kiln.llm.quantization.linear import Int4Linear  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402
from tests.llm_quant import kiln_logits  # noqa: E402
from tests.unit.llm.test_llm_gguf import _write_gguf  # noqa: E402

DENSE = (torch.nn.Linear, PackedLinear)

T = gguf.GGMLQuantizationType
PROMPT = [1, 5, 17, 42, 99, 3, 250, 7, 8, 9, 10]


def _blocks(kind: str, rows: int, k: int) -> np.ndarray:
    gen = np.random.default_rng(0)
    if kind != "Q4_K":
        return gguf.quants.quantize(gen.standard_normal((rows, k)).astype("float32"), T[kind])
    # no Q4_K quantizer in the gguf package: random blocks with finite d and dmin
    values, size = gguf_blocks.BLOCKS[kind]
    raw = gen.integers(0, 256, (rows, k // values, size), dtype=np.uint8)
    raw[..., 0:4] = gen.uniform(0.001, 0.05, (rows, k // values, 2)).astype("<f2").view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_blocks_read_as_the_gguf_package_dequantizes(kind: str) -> None:
    raw = _blocks(kind, 8, 512)
    q, scale, offset = gguf_blocks.to_int4(torch.from_numpy(raw), kind, 512)
    got = (q.float() - 8) * scale.repeat_interleave(32, 0).t() + offset.repeat_interleave(32, 0).t()
    want = torch.from_numpy(gguf.quants.dequantize(raw, T[kind]).astype("float32"))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_a_4bit_file_stays_4bit_and_matches_transformers(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"tiny.{kind}.gguf"
    _write_gguf(build_tiny_llm(tmp_path / "hf"), path, matrices=kind)
    # float32 (the CPU default) keeps the exact dequantized weights; bfloat16 the blocks
    exact = LLMEngine(path, EngineConfig(kv_cache_memory_bytes=1 << 22))
    # a dense float32 projection (oneDNN's packed copy on a CPU float32 model: cpu_linear)
    assert type(exact.runner.model.model.layers[0].mlp.down_proj) in DENSE
    engine = LLMEngine(path, EngineConfig(kv_cache_memory_bytes=1 << 22, dtype="bfloat16"))
    layer = engine.runner.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert engine.runner.quantization is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, torch_dtype=torch.float32
    ).eval()
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
        tokens = ref.generate(
            torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, pad_token_id=0
        )[0, len(PROMPT) :].tolist()
    got = kiln_logits(engine, PROMPT)
    assert float((got - want).abs().max()) <= 0.03 * float(want.max() - want.min())
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate([PROMPT], greedy) == [tokens]
