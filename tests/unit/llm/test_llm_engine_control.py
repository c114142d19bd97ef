"""The engine side of vLLM's development operations (``kiln.llm.engine_control``): pause
modes, sleep levels and the memory they release, wake tags, prefix-cache reset, abort, and
the refusals, on a real (tiny) engine stepped by hand."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.engine_control import PENDING, EngineControl, PauseState
from kiln.llm.sequence import SamplingParams
from tests.llm_models import all_blocks_returned, build_tiny_llm

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def engine(folder: Path) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(block_size=4, num_gpu_blocks=64))


def run_all(engine: LLMEngine, control: EngineControl) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_work() and control.may_step():
        for r in engine.step():
            out.setdefault(r.request_id, []).extend(r.new_token_ids)
    return out


def reference(engine: LLMEngine) -> list[int]:
    engine.add_request("ref", PROMPT, GREEDY)
    control = EngineControl(engine)
    tokens = run_all(engine, control)["ref"]
    assert engine.block_manager.reset_prefix_cache()
    return tokens


def test_pause_abort_ends_every_request_with_abort_and_holds_new_ones(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=20, n=2, temperature=1.0))
    engine.add_request("b", [3, 4, 5], GREEDY)
    engine.step()
    assert control.run("t", "pause", {"mode": "abort"}) == {}
    ends = {(o.request_id, o.index): o for o in control.finished}
    assert set(ends) == {("a", 0), ("a", 1), ("b", 0)}
    assert all(o.finished and o.finish_reason == "abort" for o in ends.values())
    assert not engine.has_work()
    all_blocks_returned(engine)
    assert engine.stats.request_success["abort"] == 3
    # a request arriving while paused is held, and joins at the resume
    assert control.holds_requests
    control.hold("c", 1, 3, "the add command")
    assert control.run("t", "state", {})["paused"] is True
    assert control.run("t", "resume", {}) == {}
    assert control.released == ["the add command"]
    assert control.pause_state is PauseState.UNPAUSED


def test_pause_wait_completes_once_the_engine_drained(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    assert control.run("token", "pause", {"mode": "wait"}) is PENDING
    assert control.may_step()  # in-flight requests go on
    assert control.poll() == []
    with pytest.raises(KilnError, match="still waiting"):
        control.run("t2", "resume", {})
    tokens = run_all(engine, control)["a"]
    assert len(tokens) == GREEDY.max_tokens
    assert control.poll() == [("token", {})]
    assert control.holds_requests


def test_pause_keep_freezes_and_resume_continues_with_the_same_tokens(engine: LLMEngine) -> None:
    want = reference(engine)
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    got = [t for o in engine.step() + engine.step() for t in o.new_token_ids]
    assert control.run("t", "pause", {"mode": "keep"}) == {}
    assert not control.may_step() and engine.has_work()  # frozen in place, blocks kept
    assert control.finished == []
    control.run("t", "resume", {})
    got += run_all(engine, control)["a"]
    assert got == want


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_releases_memory_and_wake_gives_the_same_tokens(
    engine: LLMEngine, level: int
) -> None:
    want = reference(engine)
    control = EngineControl(engine)
    engine.add_request("warm", PROMPT, GREEDY)
    run_all(engine, control)
    assert engine.block_manager.cached  # the prompt's blocks are cached
    runner = engine.runner
    assert control.run("t", "sleep", {"level": level}) == {}
    assert runner.kv_cache.numel() == 0
    assert hasattr(runner, "model") == (level == 1)  # level 2 dropped the weights (CPU: 1 kept)
    assert control.sleeping_tags == {"weights", "kv_cache"}
    assert control.state() == {"paused": True, "sleeping": True, "level": level,
                               "tags": ["kv_cache", "weights"],
                               "weight_version": "default"}  # fmt: skip
    with pytest.raises(KilnError, match="wake it"):
        control.run("t", "resume", {})
    # one tag at a time: not fully awake until both are back
    assert control.run("t", "wake_up", {"tags": ["kv_cache"]}) == {"fully_awake": False}
    assert runner.kv_cache.numel() > 0
    assert control.run("t", "wake_up", {"tags": ["weights"]}) == {"fully_awake": True}
    assert control.may_step() and not control.holds_requests
    assert not engine.block_manager.cached  # the prefix cache is empty after a wake
    engine.add_request("again", PROMPT, GREEDY)
    assert run_all(engine, control)["again"] == want


def test_a_request_kept_through_a_sleep_is_recomputed_after_the_wake(engine: LLMEngine) -> None:
    want = reference(engine)
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    got = [t for o in engine.step() + engine.step() for t in o.new_token_ids]
    control.run("t", "sleep", {"level": 2, "mode": "keep"})
    assert control.finished == [] and engine.has_work()
    assert [s.request_id for s in engine.scheduler.waiting] == ["a"]  # its blocks went
    all_blocks_returned(engine)
    assert control.run("t", "wake_up", {"tags": None}) == {"fully_awake": True}
    got += run_all(engine, control)["a"]
    assert got == want


def test_sleep_level_0_pauses_and_scheduling_tag_wakes(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    control.run("t", "sleep", {"level": 0})
    assert control.state()["sleeping"] and engine.runner.kv_cache.numel() > 0
    assert control.run("t", "wake_up", {"tags": ["scheduling"]}) == {"fully_awake": True}
    assert not control.state()["sleeping"]


def test_a_wake_tag_that_is_not_asleep_wakes_nothing(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    control.run("t", "pause", {"mode": "abort"})
    control.run("t", "release_kv_cache_memory", {})
    assert control.sleeping_tags == {"kv_cache"}
    assert control.run("t", "wake_up", {"tags": ["weights"]}) == {"fully_awake": False}
    assert control.sleeping_tags == {"kv_cache"}
    assert control.run("t", "wake_up", {"tags": ["kv_cache"]}) == {"fully_awake": True}


def test_reset_prefix_cache_refuses_while_blocks_are_held_unless_told(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    assert control.run("t", "reset_prefix_cache", {}) == {"success": False}
    assert engine.block_manager.cached  # nothing changed
    assert control.run("t", "reset_prefix_cache", {"reset_running_requests": True}) == {
        "success": True
    }
    assert not engine.block_manager.cached
    run_all(engine, control)  # the preempted request is recomputed
    engine.add_request("b", PROMPT, GREEDY)
    outputs: list[RequestOutput] = engine.step()
    assert outputs[0].num_cached_tokens > 0  # cached again by "a"
    run_all(engine, control)
    assert control.run("t", "reset_prefix_cache", {}) == {"success": True}
    engine.add_request("c", PROMPT, GREEDY)
    assert engine.step()[0].num_cached_tokens == 0


def test_abort_by_id_ends_only_those(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", [5, 6, 7], GREEDY)
    engine.step()
    assert control.run("t", "abort", {"request_ids": ["a", "nobody"]}) == {"aborted": 2}
    assert [(o.request_id, o.finish_reason) for o in control.finished] == [("a", "abort")]
    assert [s.request_id for s in engine.scheduler.running] == ["b"]


@pytest.mark.parametrize(
    ("op", "args", "match"),
    [
        ("pause", {"mode": "later"}, "mode must be one of abort, wait, keep"),
        ("sleep", {"level": 3}, "level must be 0, 1 or 2"),
        ("sleep", {"level": True}, "level must be 0, 1 or 2"),
        ("wake_up", {"tags": ["gpu"]}, "tags must be among"),
        ("release_kv_cache_memory", {}, "needs a completed pause"),
        ("format_disk", {}, "unknown engine operation"),
    ],
)
def test_refusals_change_nothing(engine: LLMEngine, op: str, args: dict, match: str) -> None:
    control = EngineControl(engine)
    with pytest.raises(KilnError, match=match):
        control.run("t", op, args)
    assert control.pause_state is PauseState.UNPAUSED and not control.sleeping_tags
    assert engine.runner.kv_cache.numel() > 0


def test_a_wait_pause_after_a_keep_lets_the_kept_requests_run_out(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    control.run("t", "pause", {"mode": "keep"})
    assert not control.may_step()
    assert control.run("w", "pause", {"mode": "wait"}) is PENDING  # vLLM: the last mode wins
    assert control.may_step()
    run_all(engine, control)
    assert control.poll() == [("w", {})]


def test_an_abort_ends_a_wait_pause_that_is_still_draining(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    assert control.run("w", "pause", {"mode": "wait"}) is PENDING
    assert control.run("t", "abort", {"request_ids": None}) == {"aborted": 1}
    assert control.poll() == [("w", {})]


def test_a_wait_pause_is_refused_while_kept_requests_sleep(engine: LLMEngine) -> None:
    control = EngineControl(engine)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    control.run("t", "sleep", {"level": 1, "mode": "keep"})
    with pytest.raises(KilnError, match="cannot drain while the engine is asleep"):
        control.run("t", "pause", {"mode": "wait"})
    assert not control.pending
