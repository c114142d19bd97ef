"""One request's run through an LLM model: token ids in, text deltas out, with stop strings
applied to the detokenized text."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.llm.sequence import SamplingParams
from kiln.llm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # importing the backend imports torch
    from kiln.llm.backend import LLMBackend


@dataclass(slots=True)
class Delta:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


async def run(
    llm: LLMBackend, prompt_ids: list[int], params: SamplingParams, stops: tuple[str, ...]
) -> AsyncIterator[Delta]:
    detok = IncrementalDetokenizer(llm.tokenizer)
    # a stop string may straddle two tokens: hold back what could be its beginning
    hold = max((len(s) for s in stops), default=1) - 1
    pending = ""
    completion = 0
    async with aclosing(llm.async_engine.generate(prompt_ids, params)) as outputs:
        async for out in outputs:
            completion = out.num_output_tokens
            pending += detok.add(out.new_token_ids, final=out.finished)
            for stop in stops:
                at = pending.find(stop)
                if at >= 0:
                    # leaving the loop closes the generator, which aborts the sequence
                    yield Delta(pending[:at], "stop", len(prompt_ids), completion)
                    return
            if out.finished:
                yield Delta(pending, out.finish_reason, len(prompt_ids), completion)
                return
            cut = len(pending) - hold
            if cut > 0:
                yield Delta(pending[:cut], None, len(prompt_ids), completion)
                pending = pending[cut:]
