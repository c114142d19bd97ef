"""vLLM's metric switches on a real (tiny) engine stepped by hand: the KV-cache residency
histograms (``--kv-cache-metrics``, sampled by ``--kv-cache-metrics-sample``), the MFU
estimates (``--enable-mfu-metrics``, vLLM's analytical model of a step's FLOPs and bytes),
``vllm:corrupted_requests`` (``VLLM_COMPUTE_NANS_IN_LOGITS``: a checkpoint with NaN
weights), and the snapshot that carries them from the engine's process to the server's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm import engine_messages as msg
from kiln.llm import sampler
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine
from kiln.llm.kv_cache_metrics import RESIDENCY_BUCKETS, KVCacheResidency
from kiln.llm.observability import ObservabilityConfig
from kiln.llm.perf_metrics import ModelShape, StepContext
from kiln.llm.sequence import SamplingParams
from kiln.llm.stats import EngineStats, RequestHistograms
from tests.llm_models import all_blocks_returned, build_tiny_llm

PROMPT = list(range(1, 10))  # 9 tokens: two full blocks of 4 are findable in the cache
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
#: the tiny model's shape (tests/llm_models.py), float32 on the CPU
D, HEADS, KV, HEAD_DIM, LAYERS, FFN, VOCAB, BYTES = 64, 4, 2, 16, 2, 128, 300, 4


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _engine(folder: Path, caching: bool = True, **switches: Any) -> LLMEngine:
    observe = ObservabilityConfig(**switches)
    config = EngineConfig(block_size=4, num_gpu_blocks=16, enable_prefix_caching=caching,
                          observability=observe)  # fmt: skip
    return LLMEngine(folder, config)


def _cycle_the_pool(engine: LLMEngine) -> None:
    """One request that needs every block of the 16: each block held before is evicted."""
    engine.generate([list(range(100, 160))], SamplingParams(max_tokens=2, ignore_eos=True))


def test_residency_is_observed_when_the_pool_hands_a_block_out_again(folder: Path) -> None:
    engine = _engine(folder, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    residency = engine.stats.kv_residency
    assert residency is not None and engine.block_manager.residency is residency
    for _ in range(3):  # the 2nd and 3rd find the first two blocks in the prefix cache
        engine.generate([PROMPT], SHORT)
    # released blocks are not evicted: nothing observed yet, every block used is followed
    assert residency.lifetime.count == 0 and residency.reuse_gap.count == 0
    held = len(residency.followed)
    assert 0 < held < engine.block_manager.num_blocks
    _cycle_the_pool(engine)
    all_blocks_returned(engine)
    # one lifetime and one idle time per evicted block; the two shared blocks were
    # accessed twice (by the 2nd and 3rd request): one reuse gap each
    assert residency.lifetime.count == residency.idle_before_evict.count == held
    assert residency.reuse_gap.count == 2
    assert residency.idle_before_evict.total <= residency.lifetime.total
    assert residency.lifetime.buckets == RESIDENCY_BUCKETS
    # the cycling request's blocks are followed now
    assert len(residency.followed) == engine.block_manager.num_blocks


def test_residency_follows_only_the_sampled_share_of_blocks(folder: Path) -> None:
    # vLLM's sampling: each allocated block is followed with probability sample_rate
    engine = _engine(folder, kv_cache_metrics=True, kv_cache_metrics_sample=1e-12)
    residency = engine.stats.kv_residency
    assert residency is not None
    for _ in range(3):
        engine.generate([PROMPT], SHORT)
    _cycle_the_pool(engine)
    assert residency.followed == {} and residency.lifetime.count == 0


def test_without_prefix_caching_no_block_is_ever_evicted_as_in_vllm(folder: Path) -> None:
    engine = _engine(folder, caching=False, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    residency = engine.stats.kv_residency
    assert residency is not None  # the families exist (vLLM creates them with the switch)
    for _ in range(3):
        engine.generate([PROMPT], SHORT)
    _cycle_the_pool(engine)
    assert residency.lifetime.count == residency.reuse_gap.count == 0


def test_a_prefix_cache_reset_forgets_the_followed_blocks(folder: Path) -> None:
    engine = _engine(folder, kv_cache_metrics=True, kv_cache_metrics_sample=1.0)
    residency = engine.stats.kv_residency
    assert residency is not None
    engine.generate([PROMPT], SHORT)
    assert residency.followed
    assert engine.block_manager.reset_prefix_cache()
    assert residency.followed == {}
    _cycle_the_pool(engine)
    assert residency.lifetime.count == 0


def test_the_switches_are_off_by_default(folder: Path) -> None:
    engine = _engine(folder)
    assert engine.stats.kv_residency is None and engine.block_manager.residency is None
    assert engine.perf is None
    engine.generate([PROMPT], SHORT)
    stats = engine.stats
    assert (stats.estimated_flops, stats.estimated_read_bytes, stats.estimated_write_bytes) == (
        0, 0, 0,
    )  # fmt: skip


def test_the_sample_rate_must_be_in_vllms_range() -> None:
    for bad in (0.0, 1.5, math.nan):
        with pytest.raises(KilnError, match=r"kv_cache_metrics_sample must be in \(0, 1\]"):
            EngineConfig(observability=ObservabilityConfig(kv_cache_metrics_sample=bad)).check()


def _expected(tokens: int, context: int, prefill: bool) -> tuple[int, int, int]:
    """vLLM's estimate of one sequence's step on the tiny dense model, spelled out."""
    T, q, kv, d, L, act = tokens, HEADS, KV, HEAD_DIM, LAYERS, BYTES
    logits = 1 if prefill else T  # a prefill's last token, every decode token
    flops = (2 * T * D * (q + 2 * kv) * d * L + 2 * T * D * q * d * L  # projections
             + 2 * (2 * q * T * context * d * L)  # QK and AV
             + 2 * D * 3 * FFN * T * L  # SwiGLU
             + 2 * logits * D * VOCAB)  # fmt: skip
    if prefill:
        attn_in = (T * q + 2 * context * kv) * d * act * L
    else:
        attn_in = T * q * d * act * L + 2 * context * kv * d * act * L
    read = (T * D * act * L + D * (q + 2 * kv) * d * act * L + attn_in
            + T * q * d * act * L + q * d * D * act * L
            + T * D * act * L + 2 * D * FFN * act * L + 2 * T * FFN * act * L
            + T * FFN * act * L + D * FFN * act * L
            + logits * D * act + D * VOCAB * act)  # fmt: skip
    write = (T * (q + 2 * kv) * d * act * L + 2 * T * kv * d * act * L + T * D * act * L
             + 2 * T * FFN * act * L + T * FFN * act * L + T * D * act * L
             + logits * VOCAB * act)  # fmt: skip
    return flops, read, write


def _totals(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.stats
    return s.estimated_flops, s.estimated_read_bytes, s.estimated_write_bytes


def test_mfu_estimates_each_step_from_the_models_shape_and_its_tokens(folder: Path) -> None:
    engine = _engine(folder, enable_mfu_metrics=True)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt: 9 tokens over a context of 9
    assert _totals(engine) == _expected(9, 9, prefill=True)
    before = _totals(engine)
    engine.step()  # one decode token over a context of 10
    grown = tuple(a - b for a, b in zip(_totals(engine), before, strict=True))
    assert grown == _expected(1, 10, prefill=False)


def test_two_sequences_in_one_step_are_billed_together(folder: Path) -> None:
    engine = _engine(folder, enable_mfu_metrics=True)
    engine.add_request("a", PROMPT, SHORT)
    engine.add_request("b", [7, 8, 9, 10, 11], SHORT)
    engine.step()
    shape = engine.perf
    assert shape is not None
    ctx = StepContext()
    ctx.add(9, 9, True)
    ctx.add(5, 5, True)
    assert _totals(engine) == shape.estimate(ctx)
    # the context product is billed per sequence, not on the step's total tokens
    assert shape.estimate(ctx) != _expected(14, 14, prefill=True)


def _args(arch: str, **extra: Any) -> ModelArgs:
    raw = {"architectures": [arch], "vocab_size": VOCAB, "hidden_size": D,
           "intermediate_size": FFN, "num_hidden_layers": 4, "num_attention_heads": HEADS,
           "num_key_value_heads": KV, "max_position_embeddings": 256, **extra}  # fmt: skip
    return ModelArgs.from_dict(raw)


def test_the_shape_reads_experts_windows_quantization_and_tensor_parallelism() -> None:
    moe = ModelShape.of(_args("MixtralForCausalLM", num_local_experts=8, num_experts_per_tok=2),
                        "bfloat16", "fp8", "awq", tp=2)  # fmt: skip
    assert (moe.num_experts, moe.experts_per_tok, moe.moe_layers) == (8, 2, 4)
    assert moe.moe_intermediate == FFN  # Mixtral's experts are intermediate_size wide
    assert (moe.weight_bytes, moe.act_bytes, moe.cache_bytes, moe.tp) == (0.5, 2, 1, 2)
    swa = ModelShape.of(_args("MistralForCausalLM", sliding_window=32), "float16")
    assert (swa.swa_layers, swa.window, swa.num_experts) == (4, 32, 0)
    # a long context costs a windowed layer its window only
    long, short = StepContext(), StepContext()
    long.add(1, 1000, False)
    short.add(1, 32, False)
    assert swa.estimate(long) == swa.estimate(short)
    # GGUF has no weight size in vLLM's table: only the unembedding is billed
    gguf = ModelShape.of(_args("LlamaForCausalLM"), "float32", quantization="gguf")
    ctx = StepContext()
    ctx.add(1, 10, False)
    assert gguf.estimate(ctx) == (2 * D * VOCAB, D * BYTES + D * VOCAB * BYTES, VOCAB * BYTES)


@pytest.fixture(scope="module")
def nan_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with one row of its output head NaN: every logits row holds a NaN."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = build_tiny_llm(tmp_path_factory.mktemp("nan"))
    (shard,) = folder.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors["lm_head.weight"][5] = torch.nan
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return folder


def test_corrupted_requests_are_counted_once_each_as_they_finish(
    nan_folder: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler, "COMPUTE_NANS", True)  # VLLM_COMPUTE_NANS_IN_LOGITS=1
    engine = _engine(nan_folder)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, n=2, ignore_eos=True))
    engine.step()
    assert engine.stats.num_corrupted_reqs == 0  # counted when they finish
    while engine.has_work():
        engine.step()
    assert engine.stats.num_corrupted_reqs == 2  # each sample is a request, as in vLLM
    clean = _engine(folder)
    clean.generate([PROMPT], SHORT)
    assert clean.stats.num_corrupted_reqs == 0
    monkeypatch.setattr(sampler, "COMPUTE_NANS", False)
    off = _engine(nan_folder)
    off.generate([PROMPT], SHORT)
    assert off.stats.num_corrupted_reqs == 0  # not looked for without the switch


def test_raise_on_logit_nans_fails_the_request_naming_it(
    nan_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sampler, "COMPUTE_NANS", True)
    monkeypatch.setattr(sampler, "RAISE_ON_NANS", True)  # VLLM_RAISE_ON_LOGIT_NANS=1
    engine = _engine(nan_folder)
    engine.add_request("poisoned", PROMPT, SHORT)
    engine.step()
    ((rid, error),) = engine.failed
    assert rid == "poisoned" and "NaNs detected in logits: {'poisoned':" in str(error)
    assert engine.stats.request_success["error"] == 1
    all_blocks_returned(engine)


def test_the_snapshot_carries_the_figures_to_the_servers_mirror(folder: Path) -> None:
    engine = _engine(folder, kv_cache_metrics=True, kv_cache_metrics_sample=1.0,
                     enable_mfu_metrics=True)  # fmt: skip
    for _ in range(3):
        engine.generate([PROMPT], SHORT)
    _cycle_the_pool(engine)
    engine.stats.num_corrupted_reqs = 3
    wire = msg.ENCODER.encode(msg.Step([], snapshot=msg.snapshot(engine)))
    snap = msg.STEP.decode(wire).snapshot
    assert snap is not None
    mirror = EngineStats(RequestHistograms.for_model(engine.config.max_model_len))
    mirror.kv_residency = KVCacheResidency(1.0)
    msg.apply_snapshot(snap, mirror, None)
    source = engine.stats.kv_residency
    assert source is not None
    for attr in ("lifetime", "idle_before_evict", "reuse_gap"):
        assert getattr(mirror.kv_residency, attr).snapshot() == getattr(source, attr).snapshot()
    assert _totals(engine) != (0, 0, 0)
    assert (mirror.estimated_flops, mirror.estimated_read_bytes,
            mirror.estimated_write_bytes) == _totals(engine)  # fmt: skip
    assert mirror.num_corrupted_reqs == 3
