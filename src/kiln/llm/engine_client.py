"""EngineClient: the one way from a frontend to an LLM model's engine, through core.

``Server.llm_engine(model, version)`` resolves the model as ``Server.infer`` does (the same
not-found / not-ready errors) and hands out this client. Each ``generate`` is one request
of the model: it counts in the model's in-flight count (so unload, reload and shutdown
drain it), in its Triton statistics (``nv_inference_*``: success or failure with its
reason, count, exec_count, queue and compute durations) and is traced by the server's
tracer with the stamps ``ModelRuntime.infer`` writes, plus the first token's.

vLLM's ``EngineClient`` is the same split: the OpenAI layer sees ``generate`` / ``abort``
/ the tokenizer / ``max_model_len``, never the engine's internals.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.stats import FailureReason, ModelStats, RequestTimes, failure_reason

if TYPE_CHECKING:  # the llm modules import torch
    import torch

    from kiln.core.trace import Trace, Tracer
    from kiln.llm.backend import LLMBackend
    from kiln.llm.engine import LLMEngine, RequestOutput
    from kiln.llm.engine_messages import Counts
    from kiln.llm.lora import LoRARegistry, LoRARequest
    from kiln.llm.parser_metrics import ToolParserInvocations
    from kiln.llm.sequence import SamplingParams
    from kiln.llm.tokenizer import Tokenizer

__all__ = ["EngineClient"]


@dataclass(slots=True)
class _Request:
    """One ``generate`` in flight: what its accounting needs."""

    n: int
    ended: set[int] = field(default_factory=set)  # samples finished, or stopped by the caller
    tokens: dict[int, int] = field(default_factory=dict)  # output tokens per sample
    scheduled: int = 0  # first scheduled (monotonic ns): its queue time ends
    first_token: int = 0
    client_id: str = ""  # the id the client knows (``trace_id``)
    abort_id: str = ""  # the id an abort names it by (vLLM's external request id)


#: (prompt token ids, sampling params, each sample's output token ids, seconds)
FinishedHook = Callable[[list[int], "SamplingParams", dict[int, list[int]], float], None]
log = logging.getLogger(__name__)


class EngineClient:
    """One loaded LLM model version's engine, as frontends may use it."""

    def __init__(
        self,
        model_name: str,
        model_version: str,
        backend: LLMBackend,
        stats: ModelStats,
        tracer: Tracer | None,
        admit: Callable[[], Callable[[], None]],
    ) -> None:
        """``admit``: the runtime's check that it still serves (raising infer's error
        when not) and in-flight count; it returns the call that ends the request."""
        self.model_name = model_name
        self.model_version = model_version
        self.tokenizer: Tokenizer = backend.tokenizer
        self._backend = backend
        self._stats = stats
        self._tracer = tracer
        self._admit = admit
        self._live: dict[str, _Request] = {}
        #: told of each generation that ended normally: (prompt, params, each sample's
        #: output token ids, seconds); the server's rollout shadow sets it
        self.on_finished: FinishedHook | None = None
        #: the LoRA adapter this client's requests run with (``with_lora``)
        self.lora_request: LoRARequest | None = None
        #: one development operation at a time (``control``); shared by ``with_lora``'s copies
        self._control_lock = asyncio.Lock()
        #: vLLM's ``engine_sleep_state`` gauge: (asleep, level), set by sleep and wake_up;
        #: with the engine process's restart count then (a new process starts awake)
        self._sleep: tuple[tuple[int, int], int] = ((0, 0), 0)

    # ---- LoRA adapters ---------------------------------------------------------------
    @property
    def loras(self) -> LoRARegistry | None:
        """The model's adapters by name (None: ``enable_lora`` is off)."""
        return self._backend.loras

    def with_lora(self, request: LoRARequest) -> EngineClient:
        """This client, its requests running with ``request``'s adapter (a request's
        ``model`` named it); the same in-flight bookkeeping."""
        bound = copy.copy(self)
        bound.lora_request = request
        bound.on_finished = None  # a rollout's shadow repeats base-model generations only
        return bound

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """vLLM's ``/v1/load_lora_adapter``: read and check the folder (blocking: call it
        off the event loop), then serve it under ``name``."""
        return self._backend.add_lora(name, path, runtime=True)

    def remove_lora(self, name: str) -> None:
        self._backend.remove_lora(name)

    # ---- what the engine accepts -----------------------------------------------------
    @property
    def engine(self) -> LLMEngine:
        """The engine's settings and counters, for the ``vllm:*`` metrics collector (read
        only): the engine itself, or its ``EngineView`` when it runs in its own process."""
        return self._backend.engine

    def engine_counts(self) -> Counts:
        """The scheduler's and KV cache's figures (running, waiting, preemptions, usage,
        prefix-cache queries and hits), for the ``vllm:*`` gauges."""
        return self._backend.engine_counts()

    @property
    def max_model_len(self) -> int:
        return self._backend.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._backend.engine.args.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model's end-of-sequence ids (its tokenizer's and generation_config.json's)."""
        return self._backend.engine.args.eos_token_ids

    @property
    def max_queued(self) -> int:
        """Requests the engine holds at once, running and waiting."""
        config = self._backend.engine.config
        return config.max_waiting + config.max_num_seqs

    @property
    def num_requests(self) -> int:
        """Requests in the engine now (any frontend's, KServe's too)."""
        return self._backend.async_engine.num_requests

    @property
    def runner(self) -> str:
        """vLLM's runner: ``generate``, or ``pooling`` (embeddings)."""
        return self._backend.engine.config.runner

    @property
    def sampling_defaults(self) -> dict[str, Any]:
        """Request fields' defaults from the checkpoint's generation_config.json."""
        return self._backend.sampling_defaults

    @property
    def max_new_tokens(self) -> int | None:
        """generation_config.json's ``max_new_tokens``: every request's bound."""
        return self._backend.max_new_tokens

    @property
    def enable_auto_tool_choice(self) -> bool:
        """vLLM's ``--enable-auto-tool-choice``: ``tool_choice: auto`` is served."""
        return self._backend.enable_auto_tool_choice

    @property
    def reasoning_parser(self) -> str | None:
        """vLLM's ``--reasoning-parser``: how a thinking model's answer is split."""
        return self._backend.reasoning_parser

    @property
    def default_chat_template_kwargs(self) -> dict[str, Any]:
        """vLLM's ``--default-chat-template-kwargs``: under each request's own."""
        return self._backend.default_chat_template_kwargs

    @property
    def trust_request_chat_template(self) -> bool:
        """vLLM's ``--trust-request-chat-template``: a request may bring its template."""
        return self._backend.trust_request_chat_template

    @property
    def force_include_usage(self) -> bool:
        """vLLM's ``--enable-force-include-usage``: every stream ends with ``usage``."""
        return self._backend.force_include_usage

    @property
    def return_tokens_as_token_ids(self) -> bool:
        """vLLM's ``--return-tokens-as-token-ids``: the default of the request's field."""
        return self._backend.return_tokens_as_token_ids

    @property
    def task_instructions(self) -> dict[str, str]:
        """An embedding model's prefixes by task (Cohere's ``input_type``): its
        ``task_instructions`` or sentence-transformers ``prompts``."""
        return self._backend.task_instructions

    @property
    def response_role(self) -> str:
        """vLLM's ``--response-role``: a chat answer's role after a generation prompt."""
        return self._backend.response_role

    @property
    def chat_template_content_format(self) -> str:
        """vLLM's ``--chat-template-content-format``: ``auto``, ``string`` or ``openai``."""
        return self._backend.chat_template_content_format

    @property
    def exclude_tools_when_tool_choice_none(self) -> bool:
        """vLLM's ``--exclude-tools-when-tool-choice-none``."""
        return self._backend.exclude_tools_when_tool_choice_none

    @property
    def sse_keep_alive_interval(self) -> float:
        """vLLM's ``--sse-keep-alive-interval``: seconds (0: no keep-alive comments)."""
        return self._backend.sse_keep_alive_interval

    @property
    def enable_tokenizer_info_endpoint(self) -> bool:
        """vLLM's ``--enable-tokenizer-info-endpoint``: ``GET /tokenizer_info`` answers."""
        return self._backend.enable_tokenizer_info_endpoint

    def check_admission(self, n: int = 1) -> None:
        """vLLM's preflight: a request of ``n`` samples that ``--max-num-queued-reqs`` or
        ``--max-num-queued-tokens`` would refuse now is refused (503) before a stream
        begins; ``generate`` counts it (and may still refuse it)."""
        self._backend.async_engine.admission.check(n)

    def admission_rejections(self) -> dict[str, int]:
        """Requests the admission limits refused, per reason (``vllm:admission_rejections``)."""
        return dict(self._backend.async_engine.admission.rejections)

    @property
    def tool_call_parser(self) -> str | None:
        """vLLM's ``--tool-call-parser``: the format ``auto`` reads calls in."""
        return self._backend.tool_call_parser

    @property
    def tool_parser_invocations(self) -> ToolParserInvocations | None:
        """``vllm:tool_call_parser_invocations``' counts (None: no tool-call parser)."""
        return self._backend.tool_parser_invocations

    def check_request(self, prompt_len: int, params: SamplingParams, priority: int = 0) -> None:
        self._backend.engine.check_request(prompt_len, params, priority, self.lora_request)
        grammars = self._backend.engine.grammars
        if params.structured_outputs is not None and grammars is not None:
            # compiled here (callers are off the event loop); the engine finds it cached
            grammars.compile(params.structured_outputs)

    def check_n(self, n: int) -> None:
        self._backend.engine.check_n(n)

    def check_priority(self, priority: int) -> None:
        self._backend.engine.check_priority(priority)

    # ---- development operations (VLLM_SERVER_DEV_MODE) ------------------------------------
    async def control(self, op: str, **args: Any) -> dict[str, Any]:
        """A development operation of ``kiln.llm.engine_control`` (pause, sleep, wake_up,
        ...), run between two of the engine's steps. They run one at a time: a second
        waits for the first (a ``wait`` pause: until the engine drained), so concurrent
        calls never interleave inside the engine. ``state`` only reads, ``abort`` only ends
        requests (it may be what ends a ``wait`` pause) and ``set_weight_version`` only
        relabels: they never wait."""
        engine = self._backend.async_engine
        if op in ("state", "abort", "set_weight_version"):
            return await engine.control(op, args)
        async with self._control_lock:
            result = await engine.control(op, args)
            if op == "sleep":
                self._sleep = ((1, int(args.get("level", 1))), self._restarts())
            elif op == "release_kv_cache_memory":
                self._sleep = ((1, 0), self._restarts())
            elif op == "wake_up" and result.get("fully_awake"):
                self._sleep = ((0, 0), self._restarts())
            return result

    @property
    def sleep_state(self) -> tuple[int, int]:
        """(asleep, level) for the gauge: awake once the engine process was restarted after
        the sleep (its new process starts with everything loaded)."""
        state, restarts = self._sleep
        return state if restarts == self._restarts() else (0, 0)

    def _restarts(self) -> int:
        proc = self._backend.engine_proc
        return 0 if proc is None else proc.restarts

    def engine_ids(self, ids: set[str]) -> list[str]:
        """The engine's ids of the requests in flight that ``ids`` name, as vLLM's abort
        matches them: by the external id (``generate``'s ``abort_id``: a chat answer's
        ``id``, ``cmpl-<id>-<i>`` for a completions prompt) or by the engine's own."""
        return [
            rid
            for rid, live in list(self._live.items())
            if rid in ids or (live.abort_id and live.abort_id in ids)
        ]

    # ---- requests --------------------------------------------------------------------
    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        trace_id: str = "",
        abort_id: str = "",
    ) -> AsyncGenerator[RequestOutput, None]:
        """The engine's outputs for one request (``request_id``: unique, the engine's;
        ``trace_id``: the id its trace names, the client's; ``abort_id``: the id an abort
        names it by, :meth:`engine_ids`). Leaving early aborts it: it
        counts as a success when every sample not finished was stopped with
        ``abort(..., reason="stop")`` (a stop string), else as CANCELED."""
        times = RequestTimes(received=time.monotonic_ns())
        done = self._admit()  # not serving: infer's error, before anything is counted
        live = self._live[request_id] = _Request(params.n, client_id=trace_id, abort_id=abort_id)
        trace = None
        if self._tracer is not None and self._tracer.enabled:
            trace = self._tracer.begin(
                self.model_name, self.model_version, trace_id or request_id, times.received
            )
        outcome: FailureReason | None = FailureReason.CANCELED
        observe = self.on_finished
        tokens: dict[int, list[int]] | None = {} if observe is not None else None
        try:
            engine = self._backend.async_engine
            outputs = engine.generate(prompt, params, request_id, priority, self.lora_request)
            async with aclosing(outputs) as outs:
                async for out in outs:
                    if not live.first_token:
                        live.first_token = time.monotonic_ns()
                        if out.first_scheduled_time is not None:  # the engine's clock: monotonic
                            live.scheduled = int(out.first_scheduled_time * 1e9)
                    live.tokens[out.index] = out.num_output_tokens
                    if tokens is not None:
                        tokens.setdefault(out.index, []).extend(out.new_token_ids)
                    if out.finished:
                        live.ended.add(out.index)
                    yield out
            outcome = None
        except GeneratorExit:
            if len(live.ended) >= live.n:
                outcome = None  # every sample ended (stop strings): nothing was cut short
            raise
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            outcome = failure_reason(exc)
            raise
        finally:
            self._live.pop(request_id, None)
            end = time.monotonic_ns()
            self._account(times, live, end, outcome)
            if trace is not None:
                _trace_end(trace, times.received, end, live, params, len(prompt))
            done()
            if outcome is None and observe is not None and tokens is not None:
                try:
                    observe(prompt, params, tokens, (end - times.received) / 1e9)
                except Exception:  # an observer never fails the request it watched
                    log.exception("llm: the finished-generation hook failed")

    async def pool(
        self, prompts: list[list[int]], priority: int = 0, tokens: bool = False
    ) -> list[torch.Tensor]:
        """Each prompt's pooled vector (``runner: pooling``; ``tokens``: its [length,
        hidden] token states), counted in flight like a generation so that unload and
        shutdown wait for it."""
        done = self._admit()
        try:
            return await self._backend.async_engine.pool(prompts, priority, tokens)
        finally:
            done()

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        """Stop one sample of a request (a stop string matched it: ``reason="stop"``, which
        ends it normally) or the whole request."""
        live = self._live.get(request_id)
        if live is not None and reason == "stop":
            live.ended.update(range(live.n) if index is None else (index,))
        self._backend.async_engine.abort(request_id, index, reason)

    # ---- profiling (vLLM's /start_profile, /stop_profile) ---------------------------------
    @property
    def profiling(self) -> bool:
        """Whether the model was started with a ``profiler_config``."""
        return self._backend.engine.config.profiler_config is not None

    async def start_profile(
        self, prefix: str | None = None, delay: int | None = None, limit: int | None = None
    ) -> None:
        """Start recording the engine's steps (between two of them); a session already
        active is a CONFLICT."""
        args = {"args": [prefix, delay, limit]}
        await self._backend.async_engine.control("start_profile", args)

    async def stop_profile(self) -> list[str]:
        """End the session once its trace is written; the files written."""
        files = (await self._backend.async_engine.control("stop_profile", {}))["result"]
        return [str(f) for f in files] if isinstance(files, list) else []

    def _account(
        self, times: RequestTimes, live: _Request, end: int, outcome: FailureReason | None
    ) -> None:
        """Triton's statistics: the engine's queue until first scheduled, its run after as
        compute (one execution: continuous batching has no batch of its own to count)."""
        times.queue_end = times.input_end = live.scheduled or times.received
        times.infer_end = times.output_end = end
        if live.scheduled:
            self._stats.record_execution(1, 0, end - live.scheduled, 0)
        if outcome is None:
            self._stats.record_success(times, 1, end)
        else:
            self._stats.record_failure(times, end, outcome)


def _trace_end(
    trace: Trace, received: int, end: int, live: _Request, params: SamplingParams,
    prompt_tokens: int,
) -> None:  # fmt: skip
    """Triton's stamps where they apply (the engine's whole run is the compute), the
    first token's (``FIRST_TOKEN``), and vLLM's ``gen_ai.*`` span attributes."""
    trace.stamp("QUEUE_START", received)
    if live.scheduled:
        trace.stamp("COMPUTE_START", live.scheduled)
    if live.first_token:
        trace.stamp("FIRST_TOKEN", live.first_token)
    trace.stamp("COMPUTE_END", end)
    trace.stamp("INFER_RESPONSE_COMPLETE", end)
    trace.stamp("REQUEST_END", end)
    attributes: dict[str, int | float | str] = {
        "gen_ai.request.id": trace.request_id,
        "gen_ai.response.model": trace.model_name,
        "gen_ai.request.n": params.n,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
        "gen_ai.usage.prompt_tokens": prompt_tokens,
        "gen_ai.usage.completion_tokens": sum(live.tokens.values()),
        "gen_ai.latency.e2e": (end - received) / 1e9,
    }
    if params.max_tokens is not None:
        attributes["gen_ai.request.max_tokens"] = params.max_tokens
    if live.scheduled:
        attributes["gen_ai.latency.time_in_queue"] = (live.scheduled - received) / 1e9
    if live.first_token:
        attributes["gen_ai.latency.time_to_first_token"] = (live.first_token - received) / 1e9
    trace.attributes = attributes
    trace.end()
