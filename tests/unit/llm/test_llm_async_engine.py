"""The engine's thread: streaming to asyncio, aborting on early exit, the queue bound."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.core.errors import KilnError, Status
from kiln.llm.async_engine import AsyncEngine
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sequence import SamplingParams
from kiln.llm.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.llm_models import build_tiny_llm

LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


async def test_leaving_a_stream_early_frees_its_blocks(folder: Path) -> None:
    engine = LLMEngine(folder, EngineConfig(block_size=4))
    async_engine = AsyncEngine(engine)
    try:
        got = []
        async for out in async_engine.generate([1, 2, 3, 4, 5], LONG):
            got.extend(out.new_token_ids)
            if len(got) >= 3:  # a reader behind the steps gets them merged
                break
        for _ in range(200):
            if not engine.has_work():
                break
            await asyncio.sleep(0.01)
        assert not engine.has_work()
        engine.block_manager.check([])
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        assert async_engine.num_requests == 0
    finally:
        async_engine.close()


async def test_a_full_queue_is_refused_with_unavailable(folder: Path) -> None:
    # one running and one waiting request fill the engine; a third is refused at once
    engine = LLMEngine(folder, EngineConfig(max_num_seqs=1, max_waiting=1))
    async_engine = AsyncEngine(engine)
    try:
        first = async_engine.generate([1, 2, 3], LONG)
        await first.__anext__()
        second = async_engine.generate([4, 5], LONG)
        waiting = asyncio.ensure_future(second.__anext__())
        await asyncio.sleep(0)
        with pytest.raises(KilnError) as info:
            await async_engine.generate([6, 7], LONG).__anext__()
        assert info.value.status is Status.UNAVAILABLE
        await first.aclose()
        await waiting  # the second one runs once the first is gone
        await second.aclose()
    finally:
        async_engine.close()


def test_chat_template_and_incremental_decoding(folder: Path) -> None:
    tok = Tokenizer(folder)
    text = tok.apply_chat_template([{"role": "user", "content": "héllo wörld"}])
    assert text == "<|user|>héllo wörld</s><|assistant|>"
    ids = tok.encode("héllo wörld, the quick fox")
    detok = IncrementalDetokenizer(tok)
    # byte-level tokens split the accented letters: the pieces still join to the text
    pieces = [detok.add([i]) for i in ids]
    assert "".join(pieces) == "héllo wörld, the quick fox"
    assert all("\ufffd" not in p for p in pieces)


def test_a_requests_own_chat_template_renders_bounded(folder: Path) -> None:
    """vLLM's ``chat_template`` of a request (``--trust-request-chat-template``): rendered
    instead of the model's, in the sandbox, with repetition and powers bounded before they
    allocate; the model's own template keeps the plain sandbox."""
    from kiln.core.errors import KilnError

    tok = Tokenizer(folder)
    messages = [{"role": "user", "content": "hi"}]
    own = "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}"
    assert tok.apply_chat_template(messages, chat_template=own) == "[user] hi"
    assert tok.apply_chat_template(messages, chat_template="{{ 'ab' * 3 }}") == "ababab"
    hostile = ["{{ 'a' * 10**9 }}", "{{ [1] * 2**30 }}", "{{ 2 ** 100000 }}",
               "{{ ''.__class__.__mro__ }}", "{% for i in range(10**9) %}{% endfor %}"]  # fmt: skip
    for template in hostile:
        with pytest.raises(KilnError, match="chat template"):
            tok.apply_chat_template(messages, chat_template=template)
    assert tok.apply_chat_template(messages) == "<|user|>hi</s><|assistant|>"
    # each template is compiled once: its next renders reuse it, in its own environment
    from kiln.llm import tokenizer as module

    assert tok.chat_template is not None
    ours, theirs = module._compiled(tok.chat_template, False), module._compiled(own, True)
    assert ours is module._compiled(tok.chat_template, False) and ours is not theirs
    assert type(theirs.environment).__name__ == "RequestTemplateEnv"


def test_incremental_decoding_equals_decoding_the_whole_output(folder: Path) -> None:
    # Random ids, byte-level pieces of multi-byte characters included: the streamed deltas
    # join to exactly what one decode of the whole list gives, token by token or in chunks.
    tok = Tokenizer(folder)
    rng = random.Random(0)
    ids = tok.encode("héllo wörld, ünïcödé — 日本語 the quick brown fox " * 3)
    for trial in range(20):
        seq = ids[: rng.randrange(1, len(ids))] + [rng.randrange(0, 200) for _ in range(30)]
        detok = IncrementalDetokenizer(tok)
        pieces, i = [], 0
        while i < len(seq):
            step = 1 if trial % 2 else rng.randrange(1, 4)
            chunk = seq[i : i + step]
            i += step
            pieces.append(detok.add(chunk, final=i >= len(seq)))
        assert "".join(pieces) == tok.decode(seq), trial
