"""One request's run through an LLM model: token ids in, text deltas out, with stop strings
applied to the detokenized text."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.llm.sequence import SamplingParams
from kiln.llm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # importing the backend imports torch
    from kiln.llm.backend import LLMBackend
    from kiln.llm.sampler import TokenLogprobs


@dataclass(slots=True)
class Delta:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    #: the logprobs of the tokens this delta releases (when the request asked for them)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


async def run(
    llm: LLMBackend, prompt_ids: list[int], params: SamplingParams, stops: tuple[str, ...]
) -> AsyncGenerator[Delta, None]:
    detok = IncrementalDetokenizer(llm.tokenizer)
    # a stop string may straddle two tokens: hold back what could be its beginning
    hold = max((len(s) for s in stops), default=1) - 1
    pending = ""
    pending_logprobs: list[TokenLogprobs] = []
    completion = 0
    async with aclosing(llm.async_engine.generate(prompt_ids, params)) as outputs:
        async for out in outputs:
            completion = out.num_output_tokens
            pending += detok.add(out.new_token_ids, final=out.finished)
            pending_logprobs.extend(out.logprobs or ())
            for stop in stops:
                at = pending.find(stop)
                if at >= 0:
                    # leaving the loop closes the generator, which aborts the sequence
                    yield Delta(pending[:at], "stop", len(prompt_ids), completion, pending_logprobs)
                    return
            if out.finished:
                reason = out.finish_reason
                yield Delta(pending, reason, len(prompt_ids), completion, pending_logprobs)
                return
            cut = len(pending) - hold
            if cut > 0:
                yield Delta(pending[:cut], None, len(prompt_ids), completion, pending_logprobs)
                pending, pending_logprobs = pending[cut:], []
