"""The engine's step loop on its own thread, streaming outputs to asyncio callers.

The event loop never computes: it hands requests and aborts to the thread through a queue,
and the thread posts each step's outputs back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status
from kiln.llm.admission import Admission
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.engine_control import PENDING, EngineControl
from kiln.llm.lora import LoRARequest
from kiln.llm.sequence import SamplingParams

if TYPE_CHECKING:
    import torch

log = logging.getLogger("kiln.llm")
_IDS = itertools.count()


def _merge(held: RequestOutput, out: RequestOutput) -> None:
    """``out`` (a later step's output of the same sample) appended to ``held``, in place:
    linear however many steps a stalled reader lets pile up. The collector owns the
    outputs it is given (the engine builds each step's lists anew)."""
    held.new_token_ids.extend(out.new_token_ids)
    if out.logprobs is not None:
        if held.logprobs is None:
            held.logprobs = out.logprobs
        else:
            held.logprobs.extend(out.logprobs)
    held.finished, held.finish_reason = out.finished, out.finish_reason
    held.stop_token_id = out.stop_token_id
    held.num_output_tokens = out.num_output_tokens
    if held.prompt_logprobs is None:
        held.prompt_logprobs = out.prompt_logprobs
    if held.first_scheduled_time is None:
        held.first_scheduled_time = out.first_scheduled_time
        held.num_cached_tokens = out.num_cached_tokens
    if out.weight_version_starts is not None:  # the whole list, newer
        held.weight_version_starts = out.weight_version_starts


class OutputCollector:
    """One request's outputs between the step loop and the task that reads them (vLLM's
    ``RequestOutputCollector``). An output that arrives while the same sample's previous one
    is still unread is merged into it: a reader that falls behind the steps takes all of a
    sample's new tokens at once (one detokenization, one event, one socket write) instead of
    one wake-up per step, so a busy server spends less per token the busier it is.

    ``interval`` is vLLM's ``stream_interval``: an unfinished sample is handed over once it
    holds that many new tokens (its first token at once, its last with its finish). 1: every
    step's tokens as soon as the reader asks."""

    __slots__ = ("_error", "_interval", "_loop", "_pending", "_released", "_waiter")

    def __init__(self, loop: asyncio.AbstractEventLoop, interval: int = 1) -> None:
        self._loop = loop
        self._interval = interval
        self._pending: dict[int, RequestOutput] = {}  # by sample, in arrival order
        #: each sample's tokens handed over so far (for ``interval``)
        self._released: dict[int, int] = {}
        self._error: KilnError | None = None
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | KilnError) -> None:
        """On the event loop's thread."""
        if isinstance(item, KilnError):
            self._error = item
        else:
            held = self._pending.get(item.index)
            if held is None:
                self._pending[item.index] = held = item
            else:
                _merge(held, item)
            if self._interval > 1 and not self._due(held):
                return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _due(self, out: RequestOutput) -> bool:
        released = self._released.get(out.index, 0)
        return out.finished or not released or out.num_output_tokens - released >= self._interval

    def _take(self) -> list[RequestOutput]:
        pending = self._pending
        if self._interval == 1 or self._error is not None:
            taken = list(pending.values())
            pending.clear()
        else:
            taken = [out for out in pending.values() if self._due(out)]
            for out in taken:
                del pending[out.index]
                self._released[out.index] = out.num_output_tokens
        return taken

    async def get(self) -> list[RequestOutput]:
        """What is due, at least one output, after waiting for it; an error once every
        output before it is out."""
        while True:
            taken = self._take()
            if taken:
                return taken
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


def _put_all(items: list[tuple[OutputCollector, RequestOutput]]) -> None:
    for collector, item in items:
        collector.put(item)


async def outputs(
    collector: OutputCollector, n: int, abort: Callable[[], None]
) -> AsyncGenerator[RequestOutput, None]:
    """A request's outputs from its collector until its ``n`` samples finish; an error ends
    it, and a caller that stops early calls ``abort`` (the engine frees the request)."""
    unfinished = n
    try:
        while unfinished:
            try:
                items = await collector.get()
            except KilnError:
                unfinished = 0
                raise
            for item in items:
                unfinished -= item.finished
                yield item
    finally:
        if unfinished:
            abort()


def stream_interval(params: SamplingParams, engine: int) -> int:
    """A request's ``stream_interval``, clamped up to the engine's (vLLM's rule)."""
    return max(params.stream_interval or 1, engine)


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    collector: OutputCollector

    def put(self, item: RequestOutput | KilnError) -> None:
        self.loop.call_soon_threadsafe(self.collector.put, item)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str
    index: int | None = None  # one sample of the request, or all of them
    reason: str = "abort"  # the finished_reason it counts under in vllm:request_success


@dataclass(slots=True)
class _Control:
    """A development-mode operation (``engine_control``), answered through ``future``."""

    op: str
    args: dict[str, Any]
    future: concurrent.futures.Future[dict[str, Any]]


@dataclass(order=True, slots=True)
class _Pool:
    """A pooling request: its prompts run in batches between the engine's steps."""

    priority: int
    order: int
    prompts: list[list[int]] = field(compare=False)
    future: concurrent.futures.Future[list[torch.Tensor]] = field(compare=False)
    results: list[torch.Tensor] = field(default_factory=list, compare=False)
    #: every token's state (``token_embed``): a [length, hidden] result per prompt
    tokens: bool = field(default=False, compare=False)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, name: str = "llm") -> None:
        self.engine = engine
        self.name = name
        self._closed = False
        self._commands: queue.SimpleQueue[_Add | _Abort | _Pool | _Control | None] = (
            queue.SimpleQueue()
        )
        #: pause, sleep and the rest of vLLM's development operations (engine thread only)
        self.controller = EngineControl(engine)
        #: pooling requests waiting for their next batch, by (priority, arrival)
        self._pools: list[_Pool] = []
        #: prompts of pooling requests not yet answered (bounded like the engine's queue)
        self._pooling = 0
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        #: vLLM's --max-num-queued-reqs and --max-num-queued-tokens
        config = engine.config
        self.admission = Admission(config.max_num_queued_reqs, config.max_num_queued_tokens)
        self._thread = threading.Thread(target=self._run, name=f"kiln-llm-{name}", daemon=True)
        self._thread.start()

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Outputs as the steps produce them (``index`` tells the ``n`` samples apart); it
        ends when every sample has finished. Leaving early (a closed client) aborts the
        request and frees its blocks."""
        arrival = time.monotonic()  # TTFT and queue time count from here, as vLLM's do
        self.engine.check_request(len(prompt), params, priority, lora_request)
        config = self.engine.config
        with self._lock:
            if self._closed:
                raise KilnError(f"model '{self.name}' is unloaded", Status.UNAVAILABLE)
            if len(self._streams) >= config.max_waiting + config.max_num_seqs:
                raise KilnError(
                    f"llm engine: {len(self._streams)} requests in flight, the queue is full",
                    Status.UNAVAILABLE,
                )
            ticket = self.admission.admit(params.n, len(prompt))
            rid = request_id or f"req-{next(_IDS)}"
            loop = asyncio.get_running_loop()
            interval = stream_interval(params, config.stream_interval)
            stream = _Stream(loop, OutputCollector(loop, interval))
            self._streams[rid] = stream
        try:
            self._send(_Add(rid, prompt, params, priority, arrival, lora_request))
            # aclosing: a caller that stops early aborts now, not when the loop collects it
            async with contextlib.aclosing(
                outputs(stream.collector, params.n, lambda: self._send(_Abort(rid)))
            ) as items:
                async for item in items:
                    if ticket.prefill_tokens:
                        self.admission.prefilled(ticket)
                    yield item
        finally:
            self.admission.release(ticket)
            with self._lock:
                self._streams.pop(rid, None)

    async def pool(
        self, prompts: list[list[int]], priority: int = 0, tokens: bool = False
    ) -> list[torch.Tensor]:
        """Each prompt's pooled vector (float32, on the CPU), computed on the engine's
        thread between steps: a generation step waits for at most one pooling batch
        (``max_num_batched_tokens`` tokens), and a pooling request for the steps in flight.
        Leaving early (a closed client) drops the prompts not yet computed."""
        config = self.engine.config
        with self._lock:
            limit = config.max_waiting + config.max_num_seqs
            if self._pooling + len(prompts) > limit:
                raise KilnError(
                    f"llm engine: {self._pooling} pooling prompts in flight, the queue is full",
                    Status.UNAVAILABLE,
                )
            ticket = self.admission.admit_prompts(len(prompts), sum(map(len, prompts)))
            self._pooling += len(prompts)
        job = _Pool(priority, next(_IDS), prompts, concurrent.futures.Future(), tokens=tokens)
        self._send(job)
        try:
            return await asyncio.wrap_future(job.future)
        finally:
            job.future.cancel()  # the thread skips what is left of it
            self.admission.release(ticket)
            with self._lock:
                self._pooling -= len(prompts)

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Stop one sample of a request (a stop string matched it: ``reason="stop"``) or
        the whole request."""
        self._send(_Abort(request_id, index, reason))

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """Run a development operation (``engine_control``) on the engine's thread, between
        two steps; awaits its answer (a ``wait`` pause: until the engine drained)."""
        with self._lock:
            if self._closed:
                raise KilnError(f"model '{self.name}' is unloaded", Status.UNAVAILABLE)
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        self._send(_Control(op, args, future))
        return await asyncio.wrap_future(future)

    def _send(self, command: _Add | _Abort | _Pool | _Control | None) -> None:
        self._commands.put(command)
        self._wake.set()

    def close(self) -> None:
        """Stop the step loop. Core closes the engine once the model's requests drained
        (or its drain timeout passed): a stream still open then ends with this error,
        never hangs."""
        with self._lock:
            self._closed = True
            streams = list(self._streams.values())
        self._send(None)
        self._thread.join(timeout=10)
        self.engine.close()
        error = KilnError(
            f"model '{self.name}' was unloaded before the request finished (its in-flight "
            "requests did not end within the unload's drain timeout, --exit-timeout-secs)",
            Status.UNAVAILABLE,
        )
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                stream.put(error)

    def _run(self) -> None:
        while True:
            try:
                while True:
                    command = self._commands.get_nowait()
                    if command is None:
                        closed = KilnError("llm engine: closed", Status.UNAVAILABLE)
                        for token, _ in self.controller.pending:
                            _settle(token, closed)
                        for job in self._pools:  # nobody will compute them now
                            with contextlib.suppress(concurrent.futures.InvalidStateError):
                                job.future.set_exception(
                                    KilnError("llm engine: closed", Status.UNAVAILABLE)
                                )
                        return
                    self._apply(command)
            except queue.Empty:
                pass
            control = self.controller
            pooling = bool(self._pools) and not control.holds_requests and control.may_step()
            if pooling:
                self._pool_batch()
            self._controlled()
            if not self.engine.has_work() or not control.may_step():
                if not pooling:
                    self._wake.wait()
                    self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # outside the model run (the engine's own bug)
                log.exception("llm engine step failed")
                self._fail_all(KilnError(f"llm engine step failed: {exc}", Status.INTERNAL))
                continue
            self._deliver(outputs)
            # the model run failed for these alone: the others of the step went on
            for rid, error in self.engine.failed:
                stream = self._streams.get(rid)
                if stream is not None:
                    stream.put(KilnError(f"llm engine step failed: {error}", Status.INTERNAL))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """One cross-thread call per step and event loop, not one per request: with 64
        requests in flight that is 64x fewer wake-ups of the loop and GIL hand-offs."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputCollector, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batches.setdefault(stream.loop, []).append((stream.collector, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_all, items)

    def _pool_batch(self) -> None:
        """One forward pass over the next waiting prompts, up to ``max_num_batched_tokens``
        tokens (always at least one prompt), from one or more pooling requests in order."""
        budget = self.engine.config.max_num_batched_tokens
        batch: list[tuple[_Pool, int]] = []  # (request, prompts taken from it)
        tokens = 0
        for job in sorted(self._pools):  # by (priority, arrival)
            if job.future.cancelled():
                continue
            if batch and job.tokens != batch[0][0].tokens:
                break  # a batch is of one kind: pooled, or every token's states
            start = len(job.results)
            end = start
            while end < len(job.prompts) and (
                (not batch and end == start) or tokens + len(job.prompts[end]) <= budget
            ):
                tokens += len(job.prompts[end])
                end += 1
            if end > start:
                batch.append((job, end - start))
            if end < len(job.prompts):
                break
        self._run_pool(batch)
        self._pools = [j for j in self._pools if not j.future.done()]

    def _run_pool(self, batch: list[tuple[_Pool, int]]) -> None:
        """Run the batch; when it fails, each request's part runs alone, so one request's
        failure fails it alone."""
        prompts = [
            p for job, n in batch for p in job.prompts[len(job.results) : len(job.results) + n]
        ]
        tokens = bool(batch) and batch[0][0].tokens
        try:
            out = self.engine.pool(prompts, tokens).cpu() if prompts else torch.empty(0)
            if tokens:
                pooled = list(out.split_with_sizes([len(p) for p in prompts]))
            else:
                pooled = list(out.unbind(0))
        except Exception as exc:
            if len(batch) > 1:
                for part in batch:
                    self._run_pool([part])
                return
            log.exception("llm engine: a pooling batch failed")
            for job, _ in batch:
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    job.future.set_exception(
                        KilnError(f"llm engine: pooling failed: {exc}", Status.INTERNAL)
                    )
            return
        at = 0
        for job, n in batch:
            job.results.extend(pooled[at : at + n])
            at += n
            if len(job.results) == len(job.prompts):
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    job.future.set_result(job.results)  # unless its client has left

    def _controlled(self) -> None:
        """What the development operations left to do: answer a drained ``wait`` pause,
        send the ends of aborted requests, add the requests a resume released."""
        control = self.controller
        for token, result in control.poll():
            _settle(token, result)
        if control.finished:
            ends, control.finished = control.finished, []
            self._deliver(ends)
        if control.released:
            released, control.released = control.released, []
            for item in released:
                assert isinstance(item, _Add)
                self._apply(item)

    def _apply(self, command: _Add | _Abort | _Pool | _Control) -> None:
        if isinstance(command, _Pool):
            self._pools.append(command)
            return
        if isinstance(command, _Control):
            try:
                result = self.controller.run(command.future, command.op, command.args)
            except Exception as exc:
                if not isinstance(exc, KilnError):
                    log.exception("llm engine: %s failed", command.op)
                    exc = KilnError(f"llm engine: {command.op} failed: {exc}", Status.INTERNAL)
                _settle(command.future, exc)
            else:
                if result is not PENDING:
                    _settle(command.future, result)
            self._controlled()
            return
        if isinstance(command, _Abort):
            whole = command.index is None
            if not (whole and self.controller.drop_held(command.request_id)):
                self.engine.abort(command.request_id, command.index, command.reason)
            return
        if self.controller.holds_requests:  # paused or asleep: it joins at the resume
            self.controller.hold(command.request_id, command.params.n, len(command.prompt), command)
            return
        try:
            self.engine.add_request(
                command.request_id,
                command.prompt,
                command.params,
                command.priority,
                command.arrival_time,
                command.lora_request,
            )
        except Exception as exc:  # anything else must not end this thread, and every stream
            stream = self._streams.get(command.request_id)
            if not isinstance(exc, KilnError):
                log.exception("llm engine: request %s could not be added", command.request_id)
                exc = KilnError(
                    f"llm engine: the request could not be added: {exc}", Status.INTERNAL
                )
            if stream is not None:
                stream.put(exc)

    def _fail_all(self, error: KilnError) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid, reason="error")
            stream.put(error)


def _settle(token: object, result: dict[str, Any] | BaseException) -> None:
    """Answer a development operation's future (its client may have stopped waiting)."""
    assert isinstance(token, concurrent.futures.Future)
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(result, BaseException):
            token.set_exception(result)
        else:
            token.set_result(result)
