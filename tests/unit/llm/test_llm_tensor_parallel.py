"""Tensor parallelism on the CPU: 2 ranks over gloo (rank 0 in this process, one worker
process) give the same tokens as one rank, for every split the loader does (GQA, one KV head
replicated, q/k/v/o biases, Phi-3's fused projections), through batching, chunked prefill,
prefix caching, copy-on-write and seeded sampling; what cannot be split is refused before
any process starts; a dead worker fails the requests, naming the model, and a reload works."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError, Status
from kiln.llm import model_json
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.parallel.comm import decode_copies, decode_step, encode_copies, encode_step
from kiln.llm.parallel.driver import DriverRunner
from kiln.llm.parallel.shard import Shard
from kiln.llm.sequence import SamplingParams
from kiln.llm.spec_config import SpeculativeConfig
from tests.llm_models import all_blocks_returned, build_tiny_llm, drain, reference_generate

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
#: a prompt longer than a step's token budget (chunked prefill) and two short ones
PROMPTS = [list(range(3, 40)), [5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]]
SHARED = list(range(40, 66))
GEMMA = dict(
    head_dim=16, sliding_window=8, query_pre_attn_scalar=24, pad_token_id=0
)  # the prefix-cache prompts share these 26 tokens (6 blocks)


def _config(tp: int, **overrides: Any) -> EngineConfig:
    base: dict[str, Any] = dict(
        tensor_parallel_size=tp,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=16,
        kv_cache_memory_bytes=1 << 20,
        served_model_name="tiny-tp",
    )
    base.update(overrides)
    return EngineConfig(**base)


def _workload(engine: LLMEngine) -> dict[str, Any]:
    """Everything compared between one rank and two."""
    out: dict[str, Any] = {}
    for i, prompt in enumerate(PROMPTS):  # one batch, chunked prefill of the first
        engine.add_request(f"batch-{i}", prompt, GREEDY)
    out["batch"] = drain(engine)
    # n > 1 forks the prompt's last, partial block: a copy-on-write copy on every rank
    engine.add_request("seeded", [7, 8, 9, 10, 11, 12], SamplingParams(
        max_tokens=8, temperature=0.9, top_p=0.95, seed=7, n=3, ignore_eos=True))  # fmt: skip
    engine.add_request("greedy-n", [21, 22, 23], SamplingParams(
        max_tokens=6, temperature=0.0, n=2, ignore_eos=True))  # fmt: skip
    out["sampled"] = drain(engine)
    engine.add_request("first", [*SHARED, 1, 2], GREEDY)
    out["first"] = drain(engine)
    cached = engine.stats.num_prompt_tokens_cached
    engine.add_request("second", [*SHARED, 3, 4, 5], GREEDY)  # its prefix from the cache
    out["second"] = drain(engine)
    out["cached"] = engine.stats.num_prompt_tokens_cached - cached
    all_blocks_returned(engine)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    return {
        # 4 query heads over 2 KV heads: one KV head a rank
        "llama-gqa": build_tiny_llm(root / "gqa"),
        # one KV head for 4 query heads: replicated on both ranks; o_proj's bias on rank 0
        "llama-mqa-bias": build_tiny_llm(root / "mqa", num_key_value_heads=1, attention_bias=True),
        "qwen2": build_tiny_llm(root / "qwen2", arch="qwen2"),
        # q/k/v and gate/up fused in the checkpoint: sliced part by part
        "phi3": build_tiny_llm(root / "phi3", arch="phi3", pad_token_id=0),
        # per-head q/k norms (replicated: a head's norm weight is shared by every head)
        "qwen3": build_tiny_llm(root / "qwen3", arch="qwen3", head_dim=16),
        # tied embeddings (rank 0's head), soft-capping, a window on every other layer
        "gemma2": build_tiny_llm(root / "gemma2", arch="gemma2", **GEMMA),
    }


@pytest.mark.parametrize(
    "name", ["llama-gqa", "llama-mqa-bias", "qwen2", "phi3", "qwen3", "gemma2"]
)
def test_two_ranks_give_one_ranks_tokens(models: dict[str, Path], name: str) -> None:
    folder = models[name]
    single = LLMEngine(folder, _config(1))
    expected = _workload(single)
    single.close()
    engine = LLMEngine(folder, _config(2))
    try:
        assert isinstance(engine.runner, DriverRunner)
        got = _workload(engine)
    finally:
        engine.close()
    assert got == expected
    assert got["cached"] >= 24  # the prefix cache served the shared blocks on both
    if name == "llama-gqa":  # and one rank is transformers' (as test_llm_engine checks)
        assert got["batch"][("batch-1", 0)] == reference_generate(folder, PROMPTS[1], 10)


def test_ngram_speculation_over_two_ranks_keeps_the_greedy_tokens(
    models: dict[str, Path],
) -> None:
    # the verifying step's drafts reach the workers in the step message like any token
    prompt = [5, 6, 7, 8] * 4
    single = LLMEngine(models["llama-gqa"], _config(1))
    single.add_request("r", prompt, GREEDY)
    expected = drain(single)
    single.close()
    spec = SpeculativeConfig("ngram", 3, None, 4, 1)
    engine = LLMEngine(models["llama-gqa"], _config(2, speculative_config=spec))
    try:
        engine.add_request("r", prompt, GREEDY)
        assert drain(engine) == expected
        assert engine.spec_stats is not None and engine.spec_stats.num_drafts > 0
    finally:
        engine.close()


def test_each_rank_holds_its_shard_of_weights_and_kv_cache(models: dict[str, Path]) -> None:
    engine = LLMEngine(models["llama-gqa"], _config(2))
    try:
        runner = engine.runner
        assert isinstance(runner, DriverRunner)
        attn = runner.model.attention_layers()[0]
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)  # of 4 and 2
        assert attn.qkv_proj is not None and attn.qkv_proj.weight.shape == ((2 + 2) * 16, 64)
        assert runner.kv_cache.shape[3] == 1  # [K/V, layers, blocks, kv heads, ...]
        assert runner.model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)  # of 128
        assert runner.model.lm_head.weight.shape == (300, 64)  # rank 0's alone
        pids = runner.worker_pids
        assert len(pids) == 1 and psutil.Process(pids[0]).is_running()
    finally:
        engine.close()
    # close stops the workers: none left behind
    assert not psutil.pid_exists(pids[0]) or psutil.Process(pids[0]).status() == "zombie"


def test_kv_heads_fewer_than_ranks_are_replicated() -> None:
    # vLLM's rule: rank r reads KV head r * kv // n; its query heads all map to that head
    shards = [Shard(r, 4, num_heads=8, num_kv_heads=2, intermediate_size=64, head_dim=4)
              for r in range(4)]  # fmt: skip
    assert [s.kv_head_start for s in shards] == [0, 0, 1, 1]
    assert {s.local_kv_heads for s in shards} == {1}
    for s in shards:
        first_query = s.rank * s.local_heads
        assert first_query // (8 // 2) == s.kv_head_start
    assert shards[3].ranges("o_proj", "weight") == (1, [(24, 32)])
    assert shards[3].ranges("qkv_proj", "weight") == (0, [(24, 32), (36, 40), (44, 48)])


def test_step_message_round_trips() -> None:
    step = encode_step([[3, 4], [], [9]], [5, 0, 2], [1, 7, 1], list(range(9)), list(range(9)))
    assert decode_step(step) == (
        [[3, 4], [], [9]], [5, 0, 2], [1, 7, 1], list(range(9)), list(range(9)))  # fmt: skip
    assert len(step) == 8 * (3 + 3 + 3 + 3 + 3 + 18)  # int64s: no pickle per token
    assert decode_copies(encode_copies([(1, 2), (3, 4)])) == [(1, 2), (3, 4)]


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _with_config(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of ``folder`` (weights linked) whose config.json has ``changes``."""
    copy = tmp_path / "model"
    copy.mkdir()
    for f in folder.iterdir():
        (copy / f.name).symlink_to(f)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (copy / "config.json").unlink()
    (copy / "config.json").write_text(json.dumps(raw))
    return copy


@pytest.mark.parametrize(
    ("tp", "changes", "reason"),
    [
        (3, {}, "model 'tiny-tp': tensor_parallel_size 3: num_attention_heads 4 is not "
                "divisible by 3"),
        (2, {"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16},
         "num_key_value_heads 3 is not divisible by 2"),
        (4, {"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16},
         "4 is not a multiple of num_key_value_heads 3"),
        (2, {"intermediate_size": 129}, "intermediate_size 129 is not divisible by 2"),
        (2, {"architectures": ["MixtralForCausalLM"], "num_local_experts": 2},
         "MixtralForCausalLM's experts are not split over ranks"),
        (2, {"quantization_config": {"quant_method": "fp8"}},
         "quantized weights are not split over ranks yet"),
    ],
)  # fmt: skip
def test_refused_at_load_before_any_process_starts(
    models: dict[str, Path], tmp_path: Path, tp: int, changes: dict[str, Any], reason: str
) -> None:
    folder = _with_config(models["llama-gqa"], tmp_path, **changes) if changes else None
    before = _children()
    with pytest.raises(KilnError) as info:
        LLMEngine(folder or models["llama-gqa"], _config(tp))
    assert info.value.status is Status.INVALID_ARG
    assert reason in info.value.message
    assert f"tensor_parallel_size {tp}" in info.value.message
    assert _children() == before


def test_size_below_one_is_refused(models: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(KilnError, match="tensor_parallel_size must be at least 1, got 0"):
        LLMEngine(models["llama-gqa"], _config(0))
    version = tmp_path / "1"
    version.mkdir()
    (version / "model.json").write_text(
        json.dumps({"model": str(models["llama-gqa"]), "tensor_parallel_size": 2})
    )
    assert model_json.load("m", version).engine.tensor_parallel_size == 2


@pytest.fixture
def engine(models: dict[str, Path]) -> Iterator[LLMEngine]:
    engine = LLMEngine(models["llama-gqa"], _config(2))
    yield engine
    engine.close()


def test_dead_worker_fails_requests_naming_the_model_and_a_reload_serves(
    models: dict[str, Path], engine: LLMEngine
) -> None:
    runner = engine.runner
    assert isinstance(runner, DriverRunner)
    engine.add_request("before", PROMPTS[1], GREEDY)
    assert drain(engine)[("before", 0)]
    pid = runner.worker_pids[0]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while runner.workers[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.add_request("a", PROMPTS[1], GREEDY)
    engine.add_request("b", PROMPTS[2], GREEDY)
    drain(engine)  # every request of the step failed: none hangs
    failed = dict(engine.failed)
    assert set(failed) == {"a", "b"}
    message = str(failed["a"])
    assert "model 'tiny-tp'" in message
    assert "tensor-parallel worker rank 1 of 2 was killed by signal 9" in message
    all_blocks_returned(engine)
    engine.add_request("after", PROMPTS[1], GREEDY)  # still refused, not hung
    drain(engine)
    assert [rid for rid, _ in engine.failed] == ["after"]
    engine.close()
    again = LLMEngine(models["llama-gqa"], _config(2))  # the reload
    try:
        again.add_request("reloaded", PROMPTS[1], GREEDY)
        assert drain(again) == {("reloaded", 0): reference_generate(
            models["llama-gqa"], PROMPTS[1], 10)}  # fmt: skip
        # a worker killed in the middle of a step, between two all-reduces: rank 0's
        # collective fails at once (gloo sees the peer gone) instead of waiting
        runner = again.runner
        assert isinstance(runner, DriverRunner)
        pid = runner.worker_pids[0]

        def kill_worker(module: Any, inputs: Any) -> None:
            os.kill(pid, signal.SIGKILL)
            runner.workers[0].wait()

        runner.model.model.layers[1].register_forward_pre_hook(kill_worker)
        again.add_request("mid-step", PROMPTS[1], GREEDY)
        drain(again)
        assert [rid for rid, _ in again.failed] == ["mid-step"]
        assert "tensor-parallel worker rank 1 of 2 was killed by signal 9" in str(
            again.failed[0][1]
        )
    finally:
        again.close()
