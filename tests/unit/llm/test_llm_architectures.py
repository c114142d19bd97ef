"""The architectures beyond Llama/Mistral/Qwen2 (Qwen3, Mixtral, Qwen3-MoE, Gemma 2,
Gemma 3, Phi-3 / Phi-4-mini) against ``transformers``: tiny random-weight models built
here, greedy tokens identical alone and batched, on both CPU attention backends (Gemma 2's
soft-capping: the portable one, which ``auto`` picks); windows shorter than the prompts so
that local and global layers differ; LongRoPE's frequencies against transformers' own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch

from kiln.core.errors import KilnError
from kiln.llm.config import SUPPORTED_ARCHITECTURES, EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine
from kiln.llm.models.moe import MixtralForCausalLM, SparseMoe
from kiln.llm.models.rope import longrope_frequencies
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm, reference_generate

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
#: 40, 5 and 19 tokens: the first is five windows of 8 long
PROMPTS = [list(range(30, 70)), [5, 17, 42, 99, 3], list(range(7, 26))]
#: Phi-3 LongRoPE factors for a rotary dimension of 12 (head_dim 16 x 0.75)
SHORT = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5]
LONG = [1.5, 2.0, 3.0, 4.0, 6.0, 8.0]
LONGROPE = {"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}
GEMMA = dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0)

#: (builder name, transformers config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("qwen3", dict(head_dim=16)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3-moe": (
        "qwen3_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=False,
        ),
    ),
    "qwen3-moe-norm-topk": (
        "qwen3_moe",
        dict(
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
            decoder_sparse_step=2,
        ),
    ),
    "gemma2": ("gemma2", GEMMA),
    "gemma3": ("gemma3", dict(GEMMA, sliding_window_pattern=2, rope_local_base_freq=100.0)),
    "phi3": ("phi3", dict(pad_token_id=0)),
    # Phi-4-mini's shape: partial rotary and LongRoPE, every token short of the original
    # length (64): the short factors' regime
    "phi4-mini-short": (
        "phi3",
        dict(
            pad_token_id=0,
            head_dim=16,
            partial_rotary_factor=0.75,
            original_max_position_embeddings=64,
            rope_scaling=LONGROPE,
        ),
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {k: build_tiny_llm(root / k, arch, **kw) for k, (arch, kw) in MODELS.items()}


def _expected(folder: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [reference_generate(folder, p, n) for p in prompts]


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_match_transformers(models: dict[str, Path], name: str) -> None:
    folder = models[name]
    expected = _expected(folder, PROMPTS, GREEDY.max_tokens)
    backends = ["torch"] if name == "gemma2" else ["torch", "cpu"]
    if name == "gemma3":
        backends.append("flex")  # its scores' scale reaches flex_attention too (eager on CPU)
    for backend in backends:
        # blocks of 4: windows and prompts cross blocks; batched and alone
        engine = LLMEngine(folder, EngineConfig(attention_backend=backend, block_size=4))
        assert engine.runner.attention_backend == backend
        assert engine.generate(PROMPTS[:1], GREEDY) == expected[:1], backend
        assert engine.generate(PROMPTS, GREEDY) == expected, backend
        all_blocks_returned(engine)


def test_longrope_long_factors_past_the_original_length(tmp_path: Path) -> None:
    """A prompt inside the original length (32) whose output runs past it: transformers
    switches to the long factors at the step whose sequence outgrows it, as kiln does by
    position, so the tokens stay identical on both sides of the switch."""
    folder = build_tiny_llm(
        tmp_path / "phi", "phi3", pad_token_id=0, head_dim=16, partial_rotary_factor=0.75,
        original_max_position_embeddings=32, rope_scaling=LONGROPE,
    )  # fmt: skip
    # 19, 22 and 25 tokens, 20 more each (random weights leave near-ties on some paths past
    # the switch: transformers fed kiln's tokens picks each of them, its own generate may
    # not, so these prompts are ones whose greedy paths keep a clear margin)
    prompts = [PROMPTS[2], list(range(100, 122)), [5, 17, 42, 99, 3] * 5]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(folder, EngineConfig(block_size=4))
    assert engine.generate(prompts, params) == _expected(folder, prompts, 20)


@pytest.mark.parametrize("partial", [1.0, 0.75])
@pytest.mark.parametrize("factor", [None, 4.0])
def test_longrope_frequencies_match_transformers(partial: float, factor: float | None) -> None:
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    dim = int(32 * partial)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + i / 10 for i in range(dim // 2)],
        "long_factor": [2.0 + i for i in range(dim // 2)],
        "original_max_position_embeddings": 512,
        "partial_rotary_factor": partial,
    }
    if factor is not None:
        rope["factor"] = factor
    config = transformers.Phi3Config(
        hidden_size=128, num_attention_heads=4, max_position_embeddings=4096,
        original_max_position_embeddings=512, rope_parameters=rope, pad_token_id=0,
    )  # fmt: skip
    init = ROPE_INIT_FUNCTIONS["longrope"]
    ref_short, ref_scale = init(config, "cpu")
    ref_long, _ = init(config, "cpu", seq_len=513)
    short, long, scale, original = longrope_frequencies(dim, 10000.0, rope, 4096)
    assert original == 512
    assert torch.equal(short, ref_short) and torch.equal(long, ref_long)
    assert scale == pytest.approx(ref_scale, rel=1e-12)
    assert scale > 1.0  # 4096 / 512 (or the explicit factor) stretches the context


def test_gemma_layers_alternate_windows_and_local_rope(models: dict[str, Path]) -> None:
    gemma2 = ModelArgs.load(models["gemma2"])
    assert gemma2.layer_windows() == [8, None]  # sliding, global, ...
    assert gemma2.attn_logit_softcapping == 50.0
    # Gemma ties its head to the embeddings when the config does not say
    raw2 = json.loads((models["gemma2"] / "config.json").read_text())
    raw2.pop("tie_word_embeddings")
    assert ModelArgs.from_dict(raw2).tie_word_embeddings
    gemma3 = ModelArgs.load(models["gemma3"])
    assert gemma3.layer_windows() == [8, None] and gemma3.attn_logit_softcapping is None
    assert gemma3.rope_theta == 1_000_000.0
    # the Hub's older spelling of the same config reads the same
    raw = json.loads((models["gemma3"] / "config.json").read_text())
    raw.pop("rope_parameters"), raw.pop("layer_types")
    old = ModelArgs.from_dict({**raw, "rope_theta": 1e6, "rope_local_base_freq": 100.0})
    assert old.layer_windows() == [8, None]
    engine = LLMEngine(models["gemma3"], EngineConfig(attention_backend="torch"))
    local = engine.runner.model.rotary_local  # type: ignore[attr-defined]
    assert local.inv_freq[1].item() == pytest.approx(100.0 ** (-2 / 16))


def test_gemma2_soft_capping_runs_on_the_portable_backend(models: dict[str, Path]) -> None:
    """``auto`` picks the backend that caps scores; one that cannot is refused by name."""
    engine = LLMEngine(models["gemma2"], EngineConfig(block_size=4))
    assert engine.runner.attention_backend == "torch"
    with pytest.raises(KilnError, match="attention_backend 'cpu' has no attention logit soft"):
        LLMEngine(models["gemma2"], EngineConfig(attention_backend="cpu"))


def test_moe_routing_matches_a_per_token_reference() -> None:
    """The grouped computation (tokens sorted by expert, one product per expert's slice)
    against the plain per-token formula: softmax, top-k, renormalise, weighted sum."""
    torch.manual_seed(1)
    hidden, inter, experts, k = 16, 8, 5, 2
    moe = SparseMoe(hidden, inter, experts, k, normalize=True, names=("w1", "w3", "w2"))
    for p in moe.parameters():
        torch.nn.init.normal_(p)
    moe.fuse()
    assert not MixtralForCausalLM.cuda_graphs  # the slice sizes are read on the host
    x = torch.randn(7, hidden)
    got = moe(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1)
    for t in range(x.shape[0]):
        w, e = torch.topk(probs[t], k)
        w = w / w.sum()
        want = torch.zeros(hidden)
        for weight, idx in zip(w, e.tolist(), strict=True):
            gate, up = (moe.gate_up[idx] @ x[t]).chunk(2)
            want += weight * (moe.down[idx] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-5)


def test_an_unknown_architecture_is_refused_naming_the_supported_ones() -> None:
    raw = {"architectures": ["FalconForCausalLM"], "num_attention_heads": 4,
           "hidden_size": 64, "vocab_size": 10, "intermediate_size": 8,
           "num_hidden_layers": 1}  # fmt: skip
    with pytest.raises(KilnError) as err:
        ModelArgs.from_dict(raw)
    message = str(err.value)
    assert "'FalconForCausalLM' is not supported" in message
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message
    assert len(SUPPORTED_ARCHITECTURES) == 9
