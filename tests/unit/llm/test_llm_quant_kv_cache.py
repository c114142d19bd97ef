"""``--kv-cache-dtype fp8``: the KV cache held in fp8 (a quarter of float32's bytes a
token), read by the portable attention backend; the fused CPU backend, which reads float32
only, is refused by name.

Tolerance: K and V rounded to fp8 (3 mantissa bits for e4m3, 2 for e5m2) change the
logits; on the tiny model greedy tokens stay those of ``transformers`` (checked).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm, reference_generate
from tests.unit.llm.test_llm_checkpoint import _config

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize(
    ("name", "dtype"), [("fp8", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)]
)
def test_fp8_cache_generates_the_reference_tokens(llama: Path, name: str, dtype: object) -> None:
    budget = 1 << 20
    engine = LLMEngine(llama, EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype=name))
    plain = LLMEngine(llama, EngineConfig(kv_cache_memory_bytes=budget))
    assert engine.runner.kv_cache.dtype == dtype
    assert engine.runner.attention_backend == "torch"
    # the same bytes hold four times the blocks of a float32 cache
    assert engine.runner.num_blocks == 4 * plain.runner.num_blocks
    # decode reads every earlier token's K/V from the cache: 12 steps of it
    assert engine.generate([PROMPT], GREEDY) == [reference_generate(llama, PROMPT, 12)]
    # and a prefill that continues cached blocks (the prefix cache) reads them too
    assert engine.generate([[*PROMPT, 20, 21]], GREEDY) == plain.generate(
        [[*PROMPT, 20, 21]], GREEDY
    )


def test_fp8_cache_refuses_the_float32_only_backend(llama: Path) -> None:
    with pytest.raises(KilnError, match="attention_backend 'cpu' needs dtype float32"):
        LLMEngine(llama, EngineConfig(kv_cache_dtype="fp8", attention_backend="cpu"))
    with pytest.raises(KilnError, match="kv_cache_dtype must be one of auto, fp8"):
        _config({"kv_cache_dtype": "int4"})


def test_kv_cache_dtype_parameter_and_flag() -> None:
    from kiln.cli.llm_options import ENGINE_FLAGS

    assert _config({}).kv_cache_dtype == "auto"
    assert _config({"kv_cache_dtype": "FP8_E5M2"}).kv_cache_dtype == "fp8_e5m2"
    assert ENGINE_FLAGS["kv_cache_dtype"] == "kv_cache_dtype"
