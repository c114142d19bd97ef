"""One request's run through an LLM model: token ids in, text deltas out, with stop strings
applied to the detokenized text."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status
from kiln.llm import weight_versions
from kiln.llm.beam_search import BeamSearch
from kiln.llm.sequence import SamplingParams, find_stop, token_by_token
from kiln.llm.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:  # importing the engine imports torch
    from kiln.llm.engine import RequestOutput
    from kiln.llm.engine_client import EngineClient
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
    #: prompt tokens the prefix cache held (the request's, the same for its ``n`` choices)
    cached_tokens: int = 0
    #: vLLM's ``stop_reason``, on a choice's last delta: the stop string, or the id of the
    #: ``stop_token_ids`` token, that ended it (None for EOS, length, and the rest)
    stop_reason: int | str | None = None
    #: the token ids this delta releases, with its logprobs (every generated token: EOS
    #: and a stop token too, up to the one that completed a stop string), for vLLM's
    #: tokens-out API (/inference/v1/generate)
    token_ids: list[int] = field(default_factory=list)
    #: on a choice's last delta: vLLM's ``weight_versions`` spans of its output tokens
    weight_versions: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class _Choice:
    """One choice's text and logprobs not yet released."""

    #: None: the choice is not detokenized (its text stays "": vLLM's --tokens-only)
    detok: IncrementalDetokenizer | None
    pending: str = ""
    pending_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pending_ids: list[int] = field(default_factory=list)
    #: the prompt's logprobs, until the choice's first delta carries them
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    done: bool = False
    #: the engine's weight-version starts of the sample (``kiln.llm.weight_versions``)
    weight_starts: list[tuple[str, int]] | None = None

    def stop(self, stops: tuple[str, ...], options: OutputOptions, start: int = 0) -> str | None:
        """The stop string in the pending text (from ``start``), if any; the text then
        ends at it (or after it, with ``include_stop_str_in_output``)."""
        found = find_stop(self.pending, stops, start)
        if found is None:
            return None
        at, stop = found
        self.pending = self.pending[: at + (len(stop) if options.include_stop_str_in_output else 0)]
        return stop

    def take_prompt_logprobs(self) -> list[TokenLogprobs | None] | None:
        taken, self.prompt_logprobs = self.prompt_logprobs, None
        return taken

    def take_ids(self) -> list[int]:
        taken, self.pending_ids = self.pending_ids, []
        return taken


@dataclass(frozen=True, slots=True)
class OutputOptions:
    """vLLM's options on how tokens become text."""

    #: a stop string (or stop token) that ended a choice stays at the end of its text
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: False: no text is made (vLLM's ``detokenize``; its --tokens-only); no stop strings
    detokenize: bool = True


async def run(
    llm: EngineClient,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: tuple[str, ...],
    priority: int = 0,
    request_id: str = "",
    options: OutputOptions = OutputOptions(),
    abort_id: str | None = None,
) -> AsyncGenerator[Delta, None]:
    """Deltas of every choice, interleaved as the steps produce them; each choice ends with
    one delta that carries its ``finish_reason``. ``request_id``: the id the client knows
    (its trace's); ``abort_id``: the id an abort names it by (vLLM's external request id:
    ``cmpl-<id>-<i>`` for a completions prompt; default ``request_id``). The engine's id
    is it and 8 random hex digits (vLLM's internal id), which an abort names it by too.
    The request counts, traces and drains in core (``EngineClient``)."""
    # a stop string may straddle two tokens: hold back what could be its beginning
    hold = max((len(s) for s in stops), default=1) - 1
    skip = options.skip_special_tokens
    # each choice's text decoded in the prompt's context, as vLLM's detokenizer does
    choices = [
        _Choice(
            IncrementalDetokenizer(llm.tokenizer, skip, prompt_ids) if options.detokenize else None
        )
        for _ in range(params.n)
    ]
    left = params.n
    external = request_id if abort_id is None else abort_id
    rid = f"{external}-{uuid.uuid4().hex[:8]}" if external else f"oai-{uuid.uuid4().hex}"
    prompt_len = len(prompt_ids)
    outputs = llm.generate(prompt_ids, params, rid, priority, request_id, external)
    # closed explicitly so that a caller leaving early aborts the sequence at once
    async with aclosing(outputs):
        async for out in outputs:
            c = choices[out.index]
            if c.done:
                continue  # a stop string ended it; its abort is on the way
            completion = out.num_output_tokens
            if out.prompt_logprobs is not None:
                c.prompt_logprobs = out.prompt_logprobs
            if out.weight_version_starts is not None:
                c.weight_starts = out.weight_version_starts
            drop = out.stop_token_id is not None and not options.include_stop_str_in_output
            reason = out.finish_reason if out.finished else None
            matched: int | str | None = None
            if reason == "stop" and out.stop_token_id in params.stop_token_ids:
                matched = out.stop_token_id  # vLLM's: a stop token's id, not EOS's
            if stops and len(out.new_token_ids) > 1:
                # several steps' tokens: a stop string ends the choice at the token that
                # completes it (and usage counts to there), however the steps were merged
                steps = token_by_token(out, drop)
                for token, (ids, entries, completion, final) in zip(
                    out.new_token_ids, steps, strict=True
                ):
                    c.pending_ids.append(token)
                    # where a step of its own would have left the held-back text
                    start = max(len(c.pending) - hold, 0)
                    c.pending += c.detok.add(ids, final=final) if c.detok else ""
                    c.pending_logprobs.extend(entries)
                    if completion > params.min_tokens:
                        matched = c.stop(stops, options, start) or matched
                        if isinstance(matched, str):
                            reason = "stop"
                            break
            else:
                ids = out.new_token_ids[:-1] if drop else out.new_token_ids
                c.pending_ids.extend(out.new_token_ids)
                c.pending += c.detok.add(ids, final=out.finished) if c.detok else ""
                c.pending_logprobs.extend(out.logprobs or ())
                # as vLLM: before min_tokens are out, no stop string ends the choice either
                if stops and completion > params.min_tokens:
                    matched = c.stop(stops, options) or matched
                    if isinstance(matched, str):
                        reason = "stop"
            if reason == "stop" and not out.finished:  # the other choices go on
                llm.abort(rid, out.index, "stop")
            if reason is not None:
                c.done, left = True, left - 1
                logprobs = c.pending_logprobs
                yield Delta(
                    c.pending, reason, prompt_len, completion, out.index, logprobs,
                    c.take_prompt_logprobs(), out.num_cached_tokens, matched, c.take_ids(),
                    weight_versions.spans(c.weight_starts, completion),
                )  # fmt: skip
                if not left:
                    # leaving the loop closes the generator, which aborts what is left
                    return
                continue
            cut = len(c.pending) - hold
            if cut > 0 or (c.detok is None and c.pending_ids):  # undetokenized: its tokens
                cut = max(cut, 0)
                text, logprobs = c.pending[:cut], c.pending_logprobs
                c.pending, c.pending_logprobs = c.pending[cut:], []
                yield Delta(
                    text, None, prompt_len, completion, out.index, logprobs,
                    c.take_prompt_logprobs(), out.num_cached_tokens, None, c.take_ids(),
                )  # fmt: skip


@dataclass(frozen=True, slots=True)
class BeamOptions:
    """vLLM's beam search settings beside ``n`` (the beams) and the sampling params'."""

    length_penalty: float = 1.0


async def beam_run(
    llm: EngineClient,
    prompt_ids: list[int],
    params: SamplingParams,
    stops: tuple[str, ...],
    beams: BeamOptions,
    priority: int = 0,
    request_id: str = "",
    options: OutputOptions = OutputOptions(),
) -> AsyncGenerator[Delta, None]:
    """vLLM's ``use_beam_search`` (kiln.llm.beam_search): ``params.n`` beams; every step
    runs the live beams as one-token engine requests at once. The choices are the best
    beams, best first, each one delta when the search ends. Leaving early (the client
    went away) cancels the step's requests, which aborts them."""
    skip = options.skip_special_tokens
    tokenizer = llm.tokenizer
    search = BeamSearch(
        len(prompt_ids),
        params.n,
        params.max_tokens,
        eos_token_ids=llm.eos_token_ids,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        length_penalty=beams.length_penalty,
        include_stop_str_in_output=options.include_stop_str_in_output,
        min_tokens=params.min_tokens,
        stops=stops,
        decode=lambda ids: tokenizer.decode(ids, skip),
    )
    asked = params.logprobs
    step = SamplingParams(
        max_tokens=1,
        temperature=0.0,
        ignore_eos=True,
        logprobs=max(search.num_candidates, asked or 0),
        cache_salt=params.cache_salt,
    )
    rid = f"beam-{uuid.uuid4().hex}"
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    cached = 0
    while not search.done():
        first = search.steps == 0
        # the prompt's logprobs (vLLM's prompt_logprobs, echo's) come with the first step
        p = replace(step, prompt_logprobs=params.prompt_logprobs) if first else step
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [
                    group.create_task(
                        _next_token(llm, ids, p, f"{rid}-{search.steps}-{i}", priority, request_id)
                    )
                    for i, ids in enumerate(search.prompts(prompt_ids))
                ]
        except BaseExceptionGroup as failed:  # the first step request's error, as it was
            raise failed.exceptions[0] from None
        outs = [task.result() for task in tasks]
        if first:
            prompt_logprobs, cached = outs[0].prompt_logprobs, outs[0].num_cached_tokens
        search.advance([_next_dist(out) for out in outs])
    for index, beam in enumerate(search.best()):
        text = beam.text if beam.text is not None else tokenizer.decode(beam.tokens, skip)
        entries = [] if asked is None else [replace(e, top=e.top[:asked]) for e in beam.logprobs]
        yield Delta(
            text, beam.finish_reason, len(prompt_ids), len(beam.logprobs), index, entries,
            prompt_logprobs, cached,
        )  # fmt: skip


def _next_dist(out: RequestOutput) -> TokenLogprobs:
    assert out.logprobs, "checked by _next_token"
    return out.logprobs[0]


async def _next_token(
    llm: EngineClient,
    prompt_ids: list[int],
    params: SamplingParams,
    rid: str,
    priority: int,
    request_id: str,
) -> RequestOutput:
    """One beam's step: the engine's one output of a one-token request."""
    last: RequestOutput | None = None
    async with aclosing(llm.generate(prompt_ids, params, rid, priority, request_id)) as outs:
        async for out in outs:
            last = out
    if last is None or not last.logprobs:
        raise KilnError(f"beam search: request {rid} ended without a token", Status.INTERNAL)
    return last


async def started(
    deltas: AsyncGenerator[Delta, None], wait: float | None = None
) -> AsyncGenerator[Delta, None]:
    """``deltas`` with its first delta awaited already, so that an error before any output
    (the model began unloading since it was resolved, the engine's queue is full) is an
    HTTP error with its status, not an event of a stream that began with 200. ``wait``:
    seconds at most (``--sse-keep-alive-interval``): a first delta still to come then
    (the request queued, or in a long prefill) is the stream's, which begins meanwhile."""
    first: Delta | None = None
    later: asyncio.Future[Delta] | None = None
    try:
        if wait is None:
            first = await deltas.__anext__()
        else:
            later = asyncio.ensure_future(deltas.__anext__())
            done, _ = await asyncio.wait({later}, timeout=wait)
            if done:
                first, later = later.result(), None
    except StopAsyncIteration:
        pass
    except BaseException:
        if later is not None:
            later.cancel()
            await asyncio.wait({later})
        await deltas.aclose()
        raise
    ended = first is None and later is None

    async def rest() -> AsyncGenerator[Delta, None]:
        async with aclosing(deltas):
            try:
                if ended:
                    return
                yield first if first is not None else await _first(later)
            except StopAsyncIteration:
                return
            async for delta in deltas:
                yield delta

    return rest()


async def _first(later: asyncio.Future[Delta] | None) -> Delta:
    assert later is not None
    try:
        return await later
    finally:
        later.cancel()  # left before it came: the engine's request is aborted by aclose


async def merged(streams: list[AsyncGenerator[Delta, None]], n: int) -> AsyncGenerator[Delta, None]:
    """The deltas of several prompts' runs (a completions list of prompts) as they come,
    prompt ``i``'s choice ``j`` renumbered ``i * n + j`` as OpenAI numbers them. Leaving
    early, or one run failing, closes every run (which aborts its engine request)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for delta in only:
                yield delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[Delta, None]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((i, delta))
        except Exception as exc:
            queue.put_nowait((i, exc))
        else:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                item.index += i * n
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
