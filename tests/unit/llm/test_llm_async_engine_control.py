"""The development operations through the engine's thread (``AsyncEngine.control``, the
engine of ``--no-enable-multiprocessing``): a stream ended by an abort pause, a request
held through a sleep and served after the wake, a wait pause answered once drained."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError
from kiln.llm.async_engine import AsyncEngine
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def engine(folder: Path) -> AsyncEngine:
    async_engine = AsyncEngine(LLMEngine(folder, EngineConfig(block_size=4, num_gpu_blocks=64)))
    yield async_engine
    async_engine.close()


async def tokens(engine: AsyncEngine, prompt: list[int]) -> tuple[list[int], str | None]:
    got: list[int] = []
    reason = None
    async for out in engine.generate(prompt, GREEDY):
        got += out.new_token_ids
        reason = out.finish_reason
    return got, reason


async def test_an_abort_pause_ends_a_stream_with_abort(engine: AsyncEngine) -> None:
    reasons = []
    async for out in engine.generate([1, 2, 3], LONG):
        if not reasons:
            assert await engine.control("pause", {"mode": "abort"}) == {}
        reasons.append(out.finish_reason)
    assert reasons[-1] == "abort"
    assert (await engine.control("state", {}))["paused"]
    await engine.control("resume", {})


async def test_a_request_arriving_asleep_is_served_after_the_wake(engine: AsyncEngine) -> None:
    want = await tokens(engine, [4, 5, 6, 7, 8])
    assert await engine.control("sleep", {"level": 2, "mode": "abort"}) == {}
    held = asyncio.ensure_future(tokens(engine, [4, 5, 6, 7, 8]))
    assert (await engine.control("state", {}))["sleeping"]
    assert not held.done()
    with pytest.raises(KilnError, match="wake it"):
        await engine.control("resume", {})
    assert await engine.control("wake_up", {"tags": None}) == {"fully_awake": True}
    assert await held == want


async def test_a_wait_pause_answers_once_drained(engine: AsyncEngine) -> None:
    stream = asyncio.ensure_future(tokens(engine, [1, 2]))
    await asyncio.sleep(0)
    assert await engine.control("pause", {"mode": "wait"}) == {}
    got, reason = await stream
    assert reason == "length" and len(got) == GREEDY.max_tokens
