"""``n`` samples sharing their prompt's blocks (copy-on-write), the ``priority`` policy, the
block accounting under a mix of everything, and the latency histograms."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm, drain, reference_generate

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = [5, 17, 42, 99, 3, 8, 13]  # 7 tokens: the last of two 4-token blocks is partial


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(block_size=4, **kw))  # type: ignore[arg-type]


def _all_released(engine: LLMEngine) -> None:
    all_blocks_returned(engine)
    assert engine.block_manager.usage() == 0.0


# -- n > 1 ------------------------------------------------------------------------------------


def test_n_greedy_samples_share_the_prompt_and_copy_on_write(llama: Path) -> None:
    engine = _engine(llama)
    copies: list[tuple[int, int]] = []
    copy_blocks = engine.runner.copy_blocks
    engine.runner.copy_blocks = lambda c: (copies.extend(c), copy_blocks(c))[1]  # type: ignore[method-assign]
    seq = engine.add_request("r", PROMPT, replace(GREEDY, n=3))
    first = engine.step()  # the prompt, once; three first tokens from its logits
    assert [r.index for r in first] == [0, 1, 2]
    samples = [seq, *(s for s in engine.scheduler.running if s is not seq)]
    assert [s.index for s in samples] == [0, 1, 2]
    assert all(s.block_table == seq.block_table for s in samples)
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in seq.block_table)
    got = drain(engine)
    want = reference_generate(llama, PROMPT, 8)
    assert [[r.new_token_ids[0], *got[("r", r.index)]] for r in first] == [want] * 3
    # two samples copied the shared partial block; the last writer wrote in place
    assert len(copies) == 2 and len({src for src, _ in copies}) == 1
    _all_released(engine)


def test_seeded_samples_draw_with_seed_plus_index(llama: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=40, n=3)
    engine = _engine(llama)
    engine.add_request("r", PROMPT, params)
    got = drain(engine)
    for i in range(3):
        alone = SamplingParams(max_tokens=8, temperature=1.0, seed=40 + i)
        assert got[("r", i)] == _engine(llama).generate([PROMPT], alone)[0]
    assert len({tuple(v) for v in got.values()}) > 1  # distinct streams, not one copied
    _all_released(engine)


def test_n_is_bounded_by_max_num_seqs(llama: Path) -> None:
    engine = _engine(llama, max_num_seqs=2)
    with pytest.raises(KilnError, match=r"n must be between 1 and max_num_seqs \(2\), got 3"):
        engine.add_request("r", PROMPT, SamplingParams(n=3))


# -- priority ---------------------------------------------------------------------------------


def test_priority_policy_admits_by_priority_then_arrival(llama: Path) -> None:
    engine = _engine(llama, scheduling_policy="priority", max_num_seqs=1)
    for rid, priority in (("a", 3), ("b", 1), ("c", 2), ("d", 1), ("e", -5)):
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=2, temperature=0.0), priority)
    order: list[str] = []
    while engine.has_work():
        for r in engine.step():
            if r.request_id not in order:
                order.append(r.request_id)
    assert order == ["e", "b", "d", "c", "a"]


def test_fcfs_admits_in_arrival_order_and_refuses_priorities(llama: Path) -> None:
    engine = _engine(llama, max_num_seqs=1)
    for rid in "xyz":
        engine.add_request(rid, PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    assert [k[0] for k in drain(engine)] == ["x", "y", "z"]
    with pytest.raises(KilnError, match="priority 2 was given but priority scheduling is not"):
        engine.add_request("p", PROMPT, GREEDY, priority=2)


@pytest.mark.parametrize(("policy", "victim"), [("fcfs", "late"), ("priority", "early")])
def test_preemption_victim_follows_the_policy(llama: Path, policy: str, victim: str) -> None:
    # 10 blocks of 4: two 7-token prompts growing by 16 tokens each cannot both fit
    engine = _engine(llama, num_gpu_blocks=10, scheduling_policy=policy)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    early = engine.add_request("early", PROMPT, params, priority=5 if policy == "priority" else 0)
    first = engine.step()[0].new_token_ids
    late = engine.add_request("late", PROMPT[::-1], params)
    got = drain(engine)
    got[("early", 0)][:0] = first
    preempted = {s.request_id for s in (early, late) if s.num_preemptions}
    assert preempted == {victim}
    assert got[("early", 0)] == reference_generate(llama, PROMPT, 16)
    assert got[("late", 0)] == reference_generate(llama, PROMPT[::-1], 16)
    _all_released(engine)


# -- accounting and histograms ------------------------------------------------------------------


def test_accounting_survives_a_mix_of_everything(llama: Path) -> None:
    # few blocks, shared prefixes, n > 1, aborts of a sample and of a request, preemption
    engine = _engine(llama, num_gpu_blocks=14, max_num_batched_tokens=16)
    prefix = list(range(60, 76))
    sample = SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=3)
    engine.add_request("n3", [*prefix, 1, 2], sample)
    engine.add_request("g", [*prefix, 3], GREEDY)
    engine.add_request("gone", [*prefix, 4, 5, 6], GREEDY)
    engine.add_request("n2", [*prefix, 7], SamplingParams(max_tokens=10, temperature=0.0, n=2))
    live = lambda: engine.scheduler.running + list(engine.scheduler.waiting)  # noqa: E731
    step = 0
    while engine.has_work():
        engine.step()
        step += 1
        if step == 3:
            assert engine.abort("n3", 1)  # one sample
            assert engine.abort("gone")  # a whole request
        if step == 4:
            engine.add_request("late", [*prefix, 9], SamplingParams(max_tokens=4, n=2, seed=2))
        engine.block_manager.check(live())
    assert engine.block_manager.stats.hits > 0
    assert engine.scheduler.num_preemptions > 0
    _all_released(engine)
    # every sample left the engine once (vLLM counts each of n as a request): 3+1+1+2+2
    h = engine.stats.histograms
    assert h.e2e_request_latency.count == 9
    assert sum(engine.stats.request_success.values()) == 9
    assert engine.stats.request_success["abort"] == 2  # "gone" and one sample of "n3"
    assert h.params_n.count == 5  # once per request


def test_latency_histograms_count_requests_and_tokens(llama: Path) -> None:
    engine = _engine(llama)
    engine.generate([PROMPT, PROMPT[:3]], GREEDY)
    engine.add_request("n", PROMPT, replace(GREEDY, n=2))
    drain(engine)
    h = engine.stats.histograms
    # one per sample, as vLLM's parallel sampling runs each of n as a child request
    for each in (
        h.time_to_first_token,
        h.queue_time,
        h.e2e_request_latency,
        h.prefill_time,
        h.decode_time,
        h.inference_time,
        h.time_per_output_token,
        h.prompt_tokens,
    ):
        assert each.count == 4
    assert h.params_n.count == h.max_num_generation_tokens.count == 3  # once per request
    assert h.params_n.total == 1 + 1 + 2
    assert h.generation_tokens.total == 4 * 8 and h.max_num_generation_tokens.total == 3 * 8
    assert h.prompt_tokens.total == 3 * len(PROMPT) + 3
    # every token but each sample's first: 2 requests x 7 + 2 samples x 7
    assert h.inter_token_latency.count == 28
    assert engine.stats.request_success == {"stop": 0, "length": 4, "abort": 0, "error": 0}
    assert h.iteration_tokens.count == engine.stats.num_steps
    buckets, total = h.inter_token_latency.snapshot()
    assert buckets[-1] == ("+Inf", 28.0) and total > 0
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)


# -- config.pbtxt parameters ------------------------------------------------------------------


def _config(params: dict[str, str]) -> EngineConfig:
    from google.protobuf import text_format

    from kiln.backends.base import InstanceSpec
    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.llm.backend import engine_config

    text = 'name: "m" backend: "llm" ' + " ".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()
    )
    spec = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)
    config = engine_config(text_format.Parse(text, ModelConfig()), spec)
    config.check()
    return config


def test_engine_parameters_from_config_pbtxt() -> None:
    default = _config({})
    assert default.enable_prefix_caching and default.scheduling_policy == "fcfs"
    config = _config({"enable_prefix_caching": "False", "scheduling_policy": "priority"})
    assert not config.enable_prefix_caching and config.scheduling_policy == "priority"
    with pytest.raises(KilnError, match="model 'm': parameter enable_prefix_caching must be"):
        _config({"enable_prefix_caching": "sometimes"})
    with pytest.raises(KilnError, match="scheduling_policy must be one of fcfs, priority"):
        _config({"scheduling_policy": "lifo"})


# -- vLLM's admission gates: the whole prompt, and the watermark --------------------------------

LONG_PROMPT = list(range(10, 50))  # 40 tokens: 10 blocks of 4


@pytest.mark.parametrize("reserve", [True, False])
def test_a_prompt_is_admitted_only_when_all_of_it_fits(llama: Path, reserve: bool) -> None:
    """vLLM's ``scheduler_reserve_full_isl`` (on by default): with 8 tokens a step, a
    40-token prompt's first chunk fits beside a running request, the whole prompt does not;
    it waits for room instead of being admitted in chunks and preempted as both grow."""
    engine = _engine(
        llama, num_gpu_blocks=11, max_num_batched_tokens=8, scheduler_reserve_full_isl=reserve
    )
    engine.add_request("running", PROMPT, replace(GREEDY, max_tokens=16))
    engine.step()  # its prompt: 2 of the 11 blocks held
    engine.add_request("long", LONG_PROMPT, replace(GREEDY, max_tokens=4))  # 10 blocks
    engine.step()
    admitted = any(s.request_id == "long" for s in engine.scheduler.running)
    assert admitted is not reserve
    out = drain(engine)
    assert out[("long", 0)] == reference_generate(llama, LONG_PROMPT, 4)
    assert (engine.scheduler.num_preemptions > 0) is not reserve
    _all_released(engine)


def test_the_watermark_keeps_headroom_while_others_run(llama: Path) -> None:
    """vLLM's ``watermark``: a waiting request joins a running batch only if it leaves that
    share of the KV blocks free; alone, it is admitted whatever the watermark."""
    engine = _engine(llama, num_gpu_blocks=20, watermark=0.5)
    assert engine.scheduler.watermark_blocks == 10
    engine.add_request("first", LONG_PROMPT, GREEDY)  # 10 blocks + 1 for its output
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first"]
    engine.add_request("second", PROMPT, GREEDY)  # 2 blocks would leave 7 < 10 free
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["second"]
    drain(engine)  # "first" ends, then "second" runs on an idle engine
    _all_released(engine)
    with pytest.raises(KilnError, match=r"watermark must be in \[0, 1\), got 1.0"):
        _engine(llama, watermark=1.0)
