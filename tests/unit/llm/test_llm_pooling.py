"""Pooling (``runner: pooling``) against ``transformers``: the base model's
``last_hidden_state`` pooled the same way (LAST, MEAN, CLS) and L2-normalized must match
kiln's vectors, alone and batched with inputs of other lengths; the pooling pass leaves the
KV cache alone; the async engine interleaves pooling batches with generation steps."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch
import torch.nn.functional as F

from kiln.core.errors import KilnError
from kiln.llm.async_engine import AsyncEngine
from kiln.llm.config import EngineConfig, ModelArgs, PoolerConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.pooling import finish
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm, reference_generate

#: float32 on both sides; kiln fuses projections and its norm kernels differ in summation
#: order, so states agree to rounding, not bit for bit
ATOL = 1e-5
PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 70)), [250], list(range(7, 26))]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@functools.cache
def _base_model(folder: Path) -> torch.nn.Module:
    import transformers

    return transformers.AutoModel.from_pretrained(str(folder), torch_dtype=torch.float32).eval()


def reference(
    folder: Path, prompt: list[int], pooling_type: str, normalize: bool = True
) -> torch.Tensor:
    """``transformers``' ``AutoModel`` (no LM head): final-norm states, pooled."""
    model = _base_model(folder)
    with torch.no_grad():
        hidden = model(torch.tensor([prompt])).last_hidden_state[0]
    pooled = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling_type]
    return F.normalize(pooled, dim=-1) if normalize else pooled


def _engine(folder: Path, pooling_type: str = "LAST", normalize: bool = True,
            **kw: object) -> LLMEngine:  # fmt: skip
    config = EngineConfig(runner="pooling", pooler_config=PoolerConfig(pooling_type, normalize))
    for key, value in kw.items():
        setattr(config, key, value)
    return LLMEngine(folder, config)


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_batched_pooling_matches_transformers(llama: Path, pooling_type: str, backend: str) -> None:
    engine = _engine(llama, pooling_type, attention_backend=backend)
    got = finish(engine.pool(PROMPTS), None, True)
    for prompt, vector in zip(PROMPTS, got, strict=True):
        want = reference(llama, prompt, pooling_type)
        torch.testing.assert_close(vector, want, atol=ATOL, rtol=0)
        assert abs(float(vector.norm()) - 1.0) < 1e-5
    # a batch gives each input the vector it gets alone
    alone = finish(engine.pool([PROMPTS[1]]), None, True)[0]
    torch.testing.assert_close(got[1], alone, atol=ATOL, rtol=0)
    all_blocks_returned(engine)  # no KV block was taken


def test_unnormalized_and_matryoshka_cut(llama: Path) -> None:
    engine = _engine(llama, "MEAN", normalize=False)
    raw = engine.pool([PROMPTS[0]])[0]
    torch.testing.assert_close(raw, reference(llama, PROMPTS[0], "MEAN", False), atol=ATOL, rtol=0)
    cut = finish(raw[None], 16, True)[0]
    # vLLM's order: cut to the dimensions first, then normalize
    torch.testing.assert_close(cut, F.normalize(raw[:16], dim=-1))


def test_sliding_window_model_pools_within_its_window(tmp_path: Path) -> None:
    folder = build_tiny_llm(tmp_path / "mistral", "mistral", sliding_window=8)
    engine = _engine(folder, "MEAN")
    prompt = list(range(20, 60))  # five windows long
    got = finish(engine.pool([prompt]), None, True)[0]
    torch.testing.assert_close(got, reference(folder, prompt, "MEAN"), atol=ATOL, rtol=0)


def test_matryoshka_fields_are_read_from_config_json() -> None:
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 4, "vocab_size": 10}  # fmt: skip
    assert not ModelArgs.from_dict(base).is_matryoshka
    assert ModelArgs.from_dict({**base, "is_matryoshka": True}).is_matryoshka
    dims = ModelArgs.from_dict({**base, "matryoshka_dimensions": [16, 32]})
    assert dims.is_matryoshka and dims.matryoshka_dimensions == (16, 32)


def test_pooler_config_json_and_bad_values() -> None:
    assert PoolerConfig.from_json('{"pooling_type": "mean", "normalize": false}') == PoolerConfig(
        "MEAN", False
    )
    with pytest.raises(KilnError, match="pooling_type must be one of LAST, MEAN, CLS"):
        PoolerConfig("ALL")
    with pytest.raises(KilnError, match="field 'step_tag_id' is not supported"):
        PoolerConfig.from_json('{"step_tag_id": 3}')
    with pytest.raises(KilnError, match="runner must be one of generate, pooling"):
        EngineConfig(runner="embed").check()


def test_pooling_interleaves_with_generation(llama: Path) -> None:
    """A pooling request and a generation request at once: both complete, the tokens are
    still those of ``transformers``, and pooling batches stay within the token budget."""
    engine = _engine(llama, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want_tokens = reference_generate(llama, PROMPTS[0], 10)
    many = [PROMPTS[i % len(PROMPTS)] for i in range(12)]
    sizes: list[int] = []
    real = engine.pool

    def recording(prompts: list[list[int]], tokens: bool = False) -> torch.Tensor:
        sizes.append(sum(len(p) for p in prompts))
        return real(prompts, tokens)

    engine.pool = recording  # type: ignore[method-assign]
    async_engine = AsyncEngine(engine, "t")

    async def main() -> tuple[list[torch.Tensor], list[int]]:
        async def generate() -> list[int]:
            out: list[int] = []
            async for r in async_engine.generate(PROMPTS[0], params):
                out.extend(r.new_token_ids)
            return out

        return await asyncio.gather(async_engine.pool(many), generate())

    try:
        pooled, tokens = asyncio.run(main())
    finally:
        async_engine.close()
    assert tokens == want_tokens
    assert len(pooled) == len(many)
    for prompt, vector in zip(many, pooled, strict=True):
        torch.testing.assert_close(
            F.normalize(vector, dim=-1), reference(llama, prompt, "LAST"), atol=ATOL, rtol=0
        )
    # several batches, each within the token budget
    assert len(sizes) > 1 and all(s <= 48 for s in sizes)
    assert engine.stats.num_prompt_tokens >= sum(len(p) for p in many)


async def test_token_embed_gives_every_tokens_state_in_both_engine_paths(llama: Path) -> None:
    """vLLM's ``token_embed``: each input's [length, hidden] final states, as
    ``transformers``' ``last_hidden_state``; the async engine keeps pooled and per-token
    jobs in batches of their own kind, and splits the rows by input."""
    engine = _engine(llama)
    flat = engine.pool(PROMPTS, tokens=True)
    assert flat.shape == (sum(len(p) for p in PROMPTS), 64)
    model = _base_model(llama)
    at = 0
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(flat[at : at + len(prompt)], want, atol=ATOL, rtol=0)
        at += len(prompt)
    async_engine = AsyncEngine(engine)
    try:
        tokens, pooled = await asyncio.gather(
            async_engine.pool(PROMPTS, tokens=True), async_engine.pool(PROMPTS)
        )
    finally:
        async_engine.close()
    assert [t.shape[0] for t in tokens] == [len(p) for p in PROMPTS]
    torch.testing.assert_close(torch.cat(tokens), flat, atol=ATOL, rtol=0)
    assert [v.shape for v in pooled] == [torch.Size([64])] * len(PROMPTS)
    torch.testing.assert_close(pooled[1], engine.pool([PROMPTS[1]])[0], atol=ATOL, rtol=0)


def test_token_embed_of_an_encoder_and_not_of_a_classifier(tmp_path: Path) -> None:
    from tests.llm_models import (
        build_tiny_classifier,
        build_tiny_encoder,
        encoder_inputs,
        reference_encoder,
    )

    folder = build_tiny_encoder(tmp_path / "bert")
    texts = ["hello world", "the quick brown fox jumps over the lazy dog", "kiln"]
    ids = [e.ids for e in encoder_inputs(folder, texts)]
    flat = LLMEngine(folder, EngineConfig(max_num_batched_tokens=8)).pool(ids, tokens=True)
    want = torch.cat(reference_encoder(folder, texts))  # the inputs in order, whatever
    torch.testing.assert_close(flat, want, atol=1e-4, rtol=0)  # the length-sorted batches
    classifier = LLMEngine(build_tiny_classifier(tmp_path / "cls"), EngineConfig())
    with pytest.raises(KilnError, match="no per-token embeddings"):
        classifier.pool([[1, 2, 3]], tokens=True)
