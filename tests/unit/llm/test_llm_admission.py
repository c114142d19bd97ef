"""vLLM's admission limits, ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``:
what is counted, when a request is refused (503, vLLM's message), and that every way a
request ends gives its share back."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kiln.core.errors import KilnError, Status
from kiln.llm.admission import QUEUE_FULL, TOKENS_FULL, Admission

pytest.importorskip("transformers")

from kiln.llm.async_engine import AsyncEngine
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _refused(admission: Admission, n: int, prompt_len: int) -> str:
    with pytest.raises(KilnError) as info:
        admission.admit(n, prompt_len)
    assert info.value.status is Status.UNAVAILABLE  # 503: retry elsewhere
    return str(info.value)


def test_requests_count_their_samples() -> None:
    admission = Admission(max_reqs=3, max_tokens=None)
    first = admission.admit(2, 10)  # n = 2: two slots, as vLLM counts them
    assert _refused(admission, 2, 1) == QUEUE_FULL
    admission.check(1)
    second = admission.admit(1, 1)
    assert _refused(admission, 1, 1) == QUEUE_FULL
    admission.release(first)
    admission.release(first)  # twice: nothing more given back
    assert admission.slots == 1
    admission.release(second)
    assert (admission.slots, admission.prefill_tokens) == (0, 0)
    assert _refused(Admission(0, None), 1, 1) == QUEUE_FULL  # 0: every request refused


def test_prompt_tokens_count_until_the_first_output() -> None:
    admission = Admission(max_reqs=None, max_tokens=100)
    big = admission.admit(1, 500)  # the backlog was empty: a long prompt alone runs
    assert admission.prefill_tokens == 500
    assert _refused(admission, 1, 1) == TOKENS_FULL
    admission.prefilled(big)  # its first output: out of the backlog, still in flight
    assert (admission.slots, admission.prefill_tokens) == (1, 0)
    pair = admission.admit(2, 60)  # n = 2: its prompt counts twice, as vLLM's children
    assert admission.prefill_tokens == 120
    with pytest.raises(KilnError, match="prefill token backlog"):
        admission.check()
    admission.release(pair)  # aborted before its first output
    admission.release(big)
    assert (admission.slots, admission.prefill_tokens) == (0, 0)


async def test_the_engine_refuses_past_the_limits_and_gives_back_on_every_end(
    folder: Path,
) -> None:
    engine = LLMEngine(folder, EngineConfig(block_size=4, max_num_queued_reqs=2))
    async_engine = AsyncEngine(engine)
    try:
        first = async_engine.generate([1, 2, 3], LONG)
        await first.__anext__()  # running: one slot
        second = async_engine.generate([4, 5], SamplingParams(max_tokens=2))
        started = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)  # admitted: two slots
        assert async_engine.admission.slots == 2
        with pytest.raises(KilnError) as info:
            await async_engine.generate([6], LONG).__anext__()
        assert info.value.status is Status.UNAVAILABLE and str(info.value) == QUEUE_FULL
        await started
        async for _ in second:  # ends by itself: its slot is given back
            pass
        assert async_engine.admission.slots == 1
        await first.aclose()  # the client left: its slot is given back
        assert async_engine.admission.slots == 0
        out = [o async for o in async_engine.generate([8], SamplingParams(max_tokens=2))]
        assert out[-1].finished and async_engine.admission.slots == 0
    finally:
        async_engine.close()


async def test_the_prefill_backlog_refuses_new_requests_until_outputs_come(
    folder: Path,
) -> None:
    engine = LLMEngine(folder, EngineConfig(block_size=4, max_num_queued_tokens=4))
    async_engine = AsyncEngine(engine)
    try:
        first = async_engine.generate([1, 2, 3, 4, 5], LONG)
        pending = asyncio.ensure_future(first.__anext__())
        await asyncio.sleep(0)  # admitted: its 5 prompt tokens are the backlog
        assert async_engine.admission.prefill_tokens == 5
        with pytest.raises(KilnError, match="prefill token backlog"):
            await async_engine.generate([9], LONG).__anext__()
        await pending  # its first output: the backlog is empty again
        assert async_engine.admission.prefill_tokens == 0
        second = async_engine.generate([9], SamplingParams(max_tokens=1))
        assert [o.finished async for o in second] == [True]
        await first.aclose()
        assert async_engine.admission.slots == 0
    finally:
        async_engine.close()


def test_refusals_are_counted_per_reason() -> None:
    """``vllm:admission_rejections``' counts, by vLLM's two reasons."""
    admission = Admission(max_reqs=1, max_tokens=5)
    assert admission.rejections == {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
    ticket = admission.admit(1, 10)
    _refused(admission, 1, 1)
    with pytest.raises(KilnError):
        admission.check()
    admission.prefilled(ticket)
    admission.max_reqs = None
    admission.admit(1, 10)
    _refused(admission, 1, 1)
    assert admission.rejections == {"max_num_queued_reqs": 2, "max_num_queued_tokens": 1}


async def test_pooling_prompts_count_against_the_limits(folder: Path) -> None:
    """Each pooled prompt takes a slot and its tokens stay in the backlog until the vectors
    come, as vLLM runs each prompt as a request of the same engine."""
    engine = LLMEngine(folder, EngineConfig(block_size=4, max_num_queued_reqs=2))
    async_engine = AsyncEngine(engine)
    admission = async_engine.admission
    try:
        first = async_engine.generate([1, 2, 3], LONG)
        await first.__anext__()  # running: one slot
        with pytest.raises(KilnError) as info:
            await async_engine.pool([[4, 5], [6, 7]])  # two more slots: one too many
        assert info.value.status is Status.UNAVAILABLE and str(info.value) == QUEUE_FULL
        assert admission.rejections["max_num_queued_reqs"] == 1
        job = asyncio.ensure_future(async_engine.pool([[4, 5, 6]]))
        await asyncio.sleep(0)  # admitted: its slot and its three tokens are counted
        assert (admission.slots, admission.prefill_tokens) == (2, 3)
        [vector] = await job
        assert vector.ndim == 1
        assert (admission.slots, admission.prefill_tokens) == (1, 0)  # given back
        await first.aclose()
        assert admission.slots == 0
    finally:
        async_engine.close()
