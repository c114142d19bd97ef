"""One request's run through an LLM model: token ids in, text deltas out, with stop strings
applied to the detokenized text."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kiln.core.stats import FailureReason, RequestTimes, failure_reason
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
    #: tokens generated so far by this choice
    completion_tokens: int
    #: the choice (one of the request's ``n`` samples)
    index: int = 0
    #: the logprobs of the tokens this delta releases (when the request asked for them)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: on a choice's first delta, with ``prompt_logprobs``: the prompt's (the first None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(slots=True)
class _Choice:
    """One choice's text and logprobs not yet released."""

    detok: IncrementalDetokenizer
    pending: str = ""
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: the prompt's logprobs, until the choice's first delta carries them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    done: bool = False

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken


async def run(
    llm: LLMBackend,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: tuple[str, ...],
    priority: int = 0,
) -> AsyncGenerator[Delta, None]:
    """Deltas of every choice, interleaved as the steps produce them; each choice ends with
    one delta that carries its ``finish_reason``. The request counts in the model's Triton
    statistics (success, or a failure with its reason; a caller that stops reading early
    is CANCELED) with its whole time as compute: the engine's own histograms
    (``kiln_llm_*``) split queue, first token and decode."""
    stats = llm.model_stats
    times = RequestTimes(received=time.monotonic_ns())
    times.queue_end = times.input_end = times.received
    outcome: FailureReason | None = FailureReason.CANCELED
    try:
        # closed explicitly so that a caller leaving early aborts the sequence at once
        async with aclosing(_run(llm, prompt_ids, params, stops, priority)) as deltas:
            async for delta in deltas:
                yield delta
        outcome = None
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit | asyncio.CancelledError):
            outcome = failure_reason(exc)
        raise
    finally:
        if stats is not None:
            end = time.monotonic_ns()
            times.infer_end = times.output_end = end
            if outcome is None:
                stats.record_success(times, 1, end)
            else:
                stats.record_failure(times, end, outcome)


async def _run(
    llm: LLMBackend,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: tuple[str, ...],
    priority: int,
) -> AsyncGenerator[Delta, None]:
    # a stop string may straddle two tokens: hold back what could be its beginning
    hold = max((len(s) for s in stops), default=1) - 1
    choices = [_Choice(IncrementalDetokenizer(llm.tokenizer)) for _ in range(params.n)]
    left = params.n
    rid = f"oai-{uuid.uuid4().hex}"
    prompt_len = len(prompt_ids)
    engine = llm.async_engine
    async with aclosing(engine.generate(prompt_ids, params, rid, priority)) as outputs:
        async for out in outputs:
            c = choices[out.index]
            if c.done:
                continue  # a stop string ended it; its abort is on the way
            completion = out.num_output_tokens
            c.pending += c.detok.add(out.new_token_ids, final=out.finished)
            c.pending_logprobs.extend(out.logprobs or ())
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            reason = out.finish_reason if out.finished else None
            for stop in stops:
                at = c.pending.find(stop)
                if at >= 0:
                    c.pending, reason = c.pending[:at], "stop"
                    if not out.finished and left > 1:
                        engine.abort(rid, out.index)  # the other choices go on
                    break
            if reason is not None:
                c.done, left = True, left - 1
                logprobs = c.pending_logprobs
                yield Delta(
                    c.pending, reason, prompt_len, completion, out.index, logprobs,
                    c.take_prompt_logprobs(),
                )  # fmt: skip
                if not left:
                    # leaving the loop closes the generator, which aborts what is left
                    return
                continue
            cut = len(c.pending) - hold
            if cut > 0:
                text, logprobs = c.pending[:cut], c.pending_logprobs
                c.pending, c.pending_logprobs = c.pending[cut:], []
                yield Delta(
                    text, None, prompt_len, completion, out.index, logprobs,
                    c.take_prompt_logprobs(),
                )  # fmt: skip
