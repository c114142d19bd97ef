"""ModelRuntime: one loaded model version — its instances, scheduler, signature and stats."""

from __future__ import annotations

import asyncio
import contextvars
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from kiln.backends.base import Backend, InstanceSpec, instance_specs, parameter
from kiln.backends.registry import LLM_BACKENDS
from kiln.cache import Cache
from kiln.cache.keys import model_fingerprint, request_key
from kiln.config.ensemble_graph import build_graph, is_ensemble
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import ModelSignature
from kiln.core.activity import Activity
from kiln.core.classification import load_labels
from kiln.core.errors import KilnError, Status, internal, invalid_arg, unavailable
from kiln.core.stats import FailureReason, ModelStats, RequestTimes, failure_reason
from kiln.core.stream import ResponseStream
from kiln.core.trace import CURRENT, Trace, Tracer, owned_by_frontend
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferOutput
from kiln.llm.engine_client import EngineClient
from kiln.repository.manager import ModelState, RuntimeFactory
from kiln.scheduling.base import INLINE_MAX_US, Instance, Job, Scheduler
from kiln.scheduling.direct import DirectScheduler
from kiln.scheduling.dynamic import DynamicScheduler
from kiln.scheduling.ensemble import (
    EnsembleScheduler,
    StepModel,
    check_composing,
    decoupled_steps,
)
from kiln.scheduling.ragged import RaggedBatching
from kiln.scheduling.rate_limit import Holder, RateLimiter
from kiln.scheduling.sequence import SequenceScheduler
from kiln.server.warmup import build_samples, run_warmup

if TYPE_CHECKING:  # importing the llm backend imports torch
    from kiln.llm.backend import LLMBackend

log = logging.getLogger(__name__)

# Tells apart successive loads of one model version in the response cache's keys.
_LOAD_IDS = itertools.count(1)
# A response cache key of inputs larger than this (an object array counts 8 bytes an
# element) is computed on a worker thread, as a body over 1 MiB is decoded on one.
KEY_ON_LOOP_MAX_BYTES = 1 << 20


class ModelRuntime:
    def __init__(
        self,
        name: str,
        version: int,
        config: ModelConfig,
        version_dir: Path,
        backend_cls: type[Backend],
        cache: Cache | None = None,
        resolve: Callable[[str, str], StepModel] | None = None,
        rate_limiter: RateLimiter | None = None,
        tracer: Tracer | None = None,
        activity: Activity | None = None,
    ) -> None:
        self.name = name
        # the server's in-flight count across models (a runtime of its own: its own count)
        self.activity = activity if activity is not None else Activity()
        self.tracer = tracer  # the server's: samples requests for trace files
        self.rate_limiter = rate_limiter  # --rate-limit: instances take turns on resources
        self.version = version
        self.version_str = str(version)
        self.config = config
        self.version_dir = version_dir
        self.backend_cls = backend_cls
        self.signature = ModelSignature(config)
        self.labels: dict[str, list[str]] = {}  # output -> label_filename lines
        self.stats = ModelStats()
        self.state = ModelState.LOADING
        self.reason = ""
        self.scheduler: Scheduler | None = None
        self.load_seconds = 0.0
        self._inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.cache = _model_cache(config, name, cache)
        self._load_id = next(_LOAD_IDS)
        # The model's part of its cache keys: this load (local cache), or a fingerprint of
        # its files that every server computes alike (a shared cache; set by ``load``).
        self._cache_owner = self._load_id
        self._resolve = resolve  # ensembles look their composing models up through it
        # 0..N responses per request, only through the stream APIs (infer_stream)
        self.decoupled = config.model_transaction_policy.decoupled
        self._engine_client: EngineClient | None = None  # an llm model's (``llm_engine``)

    async def load(self) -> None:
        """Create every instance off the event loop, then the scheduler."""
        start = time.perf_counter()
        loop = asyncio.get_running_loop()
        filenames = {o.name: o.label_filename for o in self.config.output if o.label_filename}
        if self.cache is not None and self.cache.shared:
            self._cache_owner = await loop.run_in_executor(
                None, model_fingerprint, self.config, self.version_dir
            )
        self.labels = await loop.run_in_executor(
            None, load_labels, self.version_dir.parent, filenames
        )
        if is_ensemble(self.config):
            self._load_ensemble()
            self.load_seconds = time.perf_counter() - start
            return
        specs = instance_specs(
            self.config, self.backend_cls.gpu_count(), self.backend_cls.spread_over_gpus
        )
        # A malformed warm-up sample fails the load before any session is built.
        samples = await loop.run_in_executor(
            None, build_samples, self.config, self.signature, self.version_dir.parent
        )
        instances: list[Instance] = []
        try:
            for spec in specs:
                limit = self._rate_limit(spec)  # too few resources: refused before building
                try:
                    backend = await loop.run_in_executor(
                        None, self.backend_cls, self.config, self.version_dir, spec
                    )
                except BaseException:
                    if limit is not None:
                        limit[0].unregister(limit[1])
                    raise
                backend.model_stats = self.stats
                backend.tracer = self.tracer
                backend.activity = self.activity
                instances.append(Instance(backend, self.name, self._inline_max_us(), limit))
            if samples:
                await run_warmup(samples, instances, self.signature, self._outputs)
        except BaseException:
            for inst in instances:
                await loop.run_in_executor(None, inst.close)
            raise
        self.scheduler = self._scheduler(instances)
        self._engine_client = self._llm_client(instances)
        self.load_seconds = time.perf_counter() - start
        self.state = ModelState.READY

    def _rate_limit(self, spec: InstanceSpec) -> tuple[RateLimiter, Holder] | None:
        """The rate limiter and the instance's place at it (``--rate-limit``), if on."""
        limiter = self.rate_limiter
        return None if limiter is None else (limiter, limiter.register(self.config, spec))

    def _inline_max_us(self) -> int:
        """Model parameter ``inline_execution_max_us`` (see ``Instance``)."""
        raw = parameter(self.config, "inline_execution_max_us", str(INLINE_MAX_US))
        if raw is None or not raw.strip().isdigit():
            raise KilnError(
                f"model '{self.name}': parameters.inline_execution_max_us must be an integer "
                f">= 0 (microseconds; 0 = always use the instance thread), got '{raw}'",
                Status.INVALID_ARG,
            )
        return int(raw)

    def _load_ensemble(self) -> None:
        if self._resolve is None:
            raise internal(f"ensemble '{self.name}' was loaded without a model repository")
        graph = build_graph(self.config)
        check_composing(graph, self.signature, self._resolve)
        # A decoupled composing model makes the ensemble decoupled (ensemble.py).
        streaming = decoupled_steps(graph, self._resolve)
        self.decoupled = self.decoupled or bool(streaming)
        self.scheduler = EnsembleScheduler(
            graph,
            self.signature,
            self.stats,
            self._resolve,
            streaming,
            self.config.ensemble_scheduling.max_inflight_requests,
        )
        self.state = ModelState.READY

    def _scheduler(self, instances: list[Instance]) -> Scheduler:
        if self.config.HasField("dynamic_batching"):
            return DynamicScheduler(instances, self.stats, self.name, self.config)
        if self.config.HasField("sequence_batching"):
            return SequenceScheduler(
                instances, self.stats, self.name, self.config, self.version_dir.parent
            )
        return DirectScheduler(instances, self.stats, self.name, RaggedBatching.of(self.config))

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    @property
    def inflight(self) -> int:
        return self._inflight

    def llm_engine(self) -> EngineClient:
        """This version's LLM engine (``backend: "llm"`` / ``"vllm"``), for the routes
        that serve it (``Server.llm_engine``)."""
        self._check_ready()
        if self._engine_client is None:
            kind = self.config.backend or self.config.platform
            raise invalid_arg(
                f"model '{self.name}' is served by the {kind} backend, not by an llm "
                f"backend: use /v2/models/{self.name}/infer"
            )
        return self._engine_client

    def _llm_client(self, instances: list[Instance]) -> EngineClient | None:
        """The client of the model's engine when an llm backend serves it (built once, at
        load, so that the metrics thread and the event loop share it)."""
        for instance in instances:
            if instance.backend.name in LLM_BACKENDS:
                backend = cast("LLMBackend", instance.backend)
                return EngineClient(
                    self.name,
                    self.version_str,
                    backend,
                    self.stats,
                    self.tracer,
                    self._begin_llm_request,
                )
        return None

    def _check_ready(self) -> None:
        if self.state is not ModelState.READY or self.scheduler is None:
            raise unavailable(f"model '{self.name}' version {self.version} is not ready")

    def _begin_llm_request(self) -> Callable[[], None]:
        """An LLM request starts: refused as infer refuses it when the model no longer
        serves, else counted in flight until the returned call (unload waits for it)."""
        self._check_ready()
        self._inflight += 1
        self.activity.inflight += 1
        self._idle.clear()

        def end() -> None:
            self._inflight -= 1
            self.activity.inflight -= 1
            if self._inflight == 0:
                self._idle.set()

        return end

    def _inputs(self, request: InferenceRequest) -> tuple[dict[str, np.ndarray], int]:
        """The validated request's inputs as the model takes them, and its batch size."""
        batch = self.signature.validate(request)
        inputs = {}
        for tensor in request.inputs:
            spec = self.signature.inputs[tensor.name]
            data = tensor.data
            if spec.reshape is not None:
                lead = (batch,) if self.signature.max_batch_size > 0 else ()
                data = data.reshape(lead + spec.reshape)
            inputs[tensor.name] = data
        return inputs, batch

    async def infer(self, request: InferenceRequest) -> InferenceResponse:
        times = RequestTimes(received=time.monotonic_ns())
        if self.state is not ModelState.READY or self.scheduler is None:
            raise unavailable(f"model '{self.name}' version {self.version} is not ready")
        if self.decoupled and not self.backend_cls.infer_when_decoupled:
            # Triton's wording, with the way out: a decoupled model answers only on a stream.
            raise KilnError(
                f"model '{self.name}' uses the decoupled transaction policy: this end point "
                "doesn't support models with decoupled transaction policy; use the gRPC "
                "stream (ModelStreamInfer) or HTTP generate / generate_stream",
                Status.UNSUPPORTED,
            )
        self._inflight += 1
        self.activity.inflight += 1
        self._idle.clear()
        trace, current = self._trace_begin(request, times)
        try:
            inputs, batch = self._inputs(request)
            names = [o.name for o in request.outputs] or self.signature.output_names
            key, lookup_ns = None, 0
            if self.cache is not None:
                lookup_start = time.monotonic_ns()
                args = (self.name, self.version_str, request, names, self._cache_owner)
                if sum(t.data.nbytes for t in request.inputs) > KEY_ON_LOOP_MAX_BYTES:
                    # every byte is digested, each BYTES element in Python: seconds for a
                    # large request, which the event loop must not spend
                    key = await asyncio.to_thread(request_key, *args)
                else:
                    key = request_key(*args)
                cached = await self.cache.get(key)
                lookup_ns = time.monotonic_ns() - lookup_start
                if cached is not None:
                    self.stats.record_cache_hit(times, lookup_ns, time.monotonic_ns())
                    hit = self._response(request, cached[0])
                    hit.parameters.update(cached[1])
                    return hit
            job = Job(inputs, names, batch, times, request.parameters, request.id)
            if trace is not None:
                self._trace_queued(trace, request, job)
            try:
                raw = await self.scheduler.schedule(job)
                if self.decoupled:  # its one response carries what it sent, as on a stream
                    names = [n for n in names if n in raw]
                outputs = self._outputs(raw, names, batch)
                if trace is not None:
                    self._trace_computed(trace, times, outputs)
            except asyncio.CancelledError:
                job.cancel()  # the client went away (a cancelled gRPC call)
                self.stats.record_failure(times, time.monotonic_ns(), FailureReason.CANCELED)
                raise
            except KilnError as exc:
                self.stats.record_failure(times, time.monotonic_ns(), failure_reason(exc))
                raise
            except Exception as exc:
                self.stats.record_failure(times, time.monotonic_ns(), FailureReason.BACKEND)
                log.exception("model '%s' failed", self.name)
                raise internal(f"model '{self.name}': {type(exc).__name__}: {exc}") from exc
            if self.cache is not None and key is not None:
                insert_start = time.monotonic_ns()
                await self.cache.put(key, outputs, self._cache_owner, job.response_parameters)
                self.stats.record_cache_miss(lookup_ns + time.monotonic_ns() - insert_start)
            self.stats.record_success(times, batch, time.monotonic_ns())
            response = self._response(request, outputs)
            if job.response_parameters:
                response.parameters.update(job.response_parameters)
            return response
        finally:
            if trace is not None:
                self._trace_end(trace, current)
            self._inflight -= 1
            self.activity.inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _trace_begin(
        self, request: InferenceRequest, times: RequestTimes
    ) -> tuple[Trace | None, contextvars.Token[Trace | None] | None]:
        """The request's trace when the server samples it, and the token that makes it the
        current trace (the scheduling, an ensemble's steps among it, runs under it)."""
        tracer = self.tracer
        if tracer is None or not tracer.enabled:
            return None, None
        trace = tracer.begin(
            self.name, self.version_str, request.id, times.received, request.trace_parent
        )
        return (trace, CURRENT.set(trace)) if trace is not None else (None, None)

    @staticmethod
    def _trace_queued(trace: Trace, request: InferenceRequest, job: Job) -> None:
        # a Python model's request.trace() names it (BLS children, get_context())
        job.trace_id, job.trace_context = trace.id, trace.context
        trace.stamp("QUEUE_START")
        if trace.tensors is not None:
            for tensor in request.inputs:
                trace.tensor("TENSOR_QUEUE_INPUT", tensor.name, tensor.datatype.value, tensor.data)

    def _trace_computed(
        self, trace: Trace, times: RequestTimes, outputs: list[InferOutput]
    ) -> None:
        self._trace_compute_stamps(trace, times)
        self._trace_response(trace, outputs)

    def _trace_compute_stamps(self, trace: Trace, times: RequestTimes) -> None:
        """The COMPUTE_* stamps of the request's execution (an ensemble has none of its
        own: its steps' traces do)."""
        if isinstance(self.scheduler, EnsembleScheduler):
            return
        for name, ns in (
            ("COMPUTE_START", times.queue_end),
            ("COMPUTE_INPUT_END", times.input_end),
            ("COMPUTE_OUTPUT_START", times.infer_end),
            ("COMPUTE_END", times.output_end),
        ):
            if ns:
                trace.stamp(name, ns)

    @staticmethod
    def _trace_response(trace: Trace, outputs: list[InferOutput]) -> None:
        """One response is complete: its tensors (TENSORS level) and its stamp."""
        if trace.tensors is not None:
            for out in outputs:
                trace.tensor("TENSOR_BACKEND_OUTPUT", out.name, out.datatype.value, out.data)
        trace.stamp("INFER_RESPONSE_COMPLETE")

    @staticmethod
    def _trace_end(trace: Trace, current: contextvars.Token[Trace | None] | None) -> None:
        trace.stamp("REQUEST_END")
        if current is not None:
            CURRENT.reset(current)
        if not owned_by_frontend(trace):
            trace.end()  # else the frontend ends it once the response is sent

    async def infer_stream(
        self, request: InferenceRequest, window: int = 0
    ) -> AsyncIterator[InferenceResponse]:
        """Every response to one request, as the model sends them (decoupled or not).

        A decoupled model's responses carry ``triton_final_response``; a FINAL flag sent
        without a response yields an empty final response only when the request asks with
        ``triton_enable_empty_final_response``, as in Triton. ``window`` > 0: a model that
        can pause (a Python model) sends no more while that many responses wait untaken.
        """
        if not self.decoupled:
            yield await self.infer(request)
            return
        times = RequestTimes(received=time.monotonic_ns())
        if self.state is not ModelState.READY or self.scheduler is None:
            raise unavailable(f"model '{self.name}' version {self.version} is not ready")
        self._inflight += 1
        self.activity.inflight += 1
        self._idle.clear()
        task: asyncio.Task[dict[str, np.ndarray]] | None = None
        ended = False  # the stream ran to its end (or its error)
        trace, current = self._trace_begin(request, times)
        try:
            inputs, batch = self._inputs(request)
            names = [o.name for o in request.outputs] or self.signature.output_names
            stream = ResponseStream(asyncio.get_running_loop(), window)
            job = Job(inputs, names, batch, times, request.parameters, request.id, stream)
            if trace is not None:
                self._trace_queued(trace, request, job)
            task = asyncio.get_running_loop().create_task(self.scheduler.schedule(job))
            task.add_done_callback(
                lambda t: stream.finish(None if t.cancelled() else t.exception())
            )
            empty_final = bool(request.parameters.get("triton_enable_empty_final_response"))
            try:
                async for item in stream:
                    if item.error is not None:
                        raise item.error
                    if item.outputs is None:
                        if not (item.final and empty_final):
                            continue
                        outputs: list[InferOutput] = []
                    else:
                        present = [n for n in names if n in item.outputs]
                        outputs = self._outputs(item.outputs, present, batch)
                    response = self._response(request, outputs)
                    if item.parameters:
                        response.parameters.update(item.parameters)
                    response.parameters["triton_final_response"] = item.final
                    if trace is not None:
                        self._trace_response(trace, outputs)
                    yield response
            except KilnError as exc:
                ended = True
                self.stats.record_failure(times, time.monotonic_ns(), failure_reason(exc))
                raise
            ended = True
            self.stats.record_success(times, batch, time.monotonic_ns())
        finally:
            # The client went away first: the model may see it and stop (a detached
            # request's batch is over, but its model's threads still run it), later
            # responses are dropped (a paused model goes on), and nobody waits any more.
            if task is not None and not ended:
                job.cancel()
                stream.cancel()
                if not task.done():
                    task.cancel()
                self.stats.record_failure(times, time.monotonic_ns(), FailureReason.CANCELED)
            if trace is not None:
                self._trace_compute_stamps(trace, times)
                self._trace_end(trace, current)
            self._inflight -= 1
            self.activity.inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def _response(self, request: InferenceRequest, outputs: list[InferOutput]) -> InferenceResponse:
        return InferenceResponse(
            model_name=self.name, model_version=self.version_str, id=request.id, outputs=outputs
        )

    def _outputs(
        self, raw: dict[str, np.ndarray], names: list[str], batch: int
    ) -> list[InferOutput]:
        result = []
        for name in names:
            spec = self.signature.outputs[name]
            if name not in raw:
                raise KilnError(
                    f"model '{self.name}' did not produce output '{name}'", Status.INTERNAL
                )
            value = raw[name]
            if not _dtype_ok(value, spec.datatype):
                raise KilnError(
                    f"model '{self.name}' produced output '{name}' as {value.dtype}, but its "
                    f"config declares {spec.datatype.config_name}",
                    Status.INTERNAL,
                )
            if spec.reshape is not None:
                lead = (batch,) if self.signature.max_batch_size > 0 else ()
                value = value.reshape(lead + tuple(d if d != -1 else -1 for d in spec.dims))
            result.append(InferOutput(name, spec.datatype, tuple(value.shape), value))
        return result

    async def drain(self, timeout: float | None = None) -> bool:
        """Wait until no request is in flight; False if the timeout expired first."""
        if self._idle.is_set():
            return True  # wait_for with a timeout of 0 would time out even so
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def unload(self, timeout: float | None = None) -> None:
        self.state = ModelState.UNLOADING
        if self.scheduler is not None:
            self.scheduler.flush()  # queued requests finish now, not after their delay
        if not await self.drain(timeout):
            log.warning("model '%s' v%s unloaded with requests in flight", self.name, self.version)
        if self.scheduler is not None:
            await self.scheduler.close()
            self.scheduler = None
        if self.cache is not None:
            self.cache.drop_owner(self._cache_owner)
        self.state = ModelState.UNAVAILABLE
        self.reason = "unloaded"


def runtime_factory(
    cache: Cache | None = None,
    rate_limiter: RateLimiter | None = None,
    tracer: Tracer | None = None,
    activity: Activity | None = None,
) -> RuntimeFactory[ModelRuntime]:
    """What the repository builds each model version with: runtimes sharing the server's
    response cache (``--cache-config``), rate limiter (``--rate-limit``), tracer and
    in-flight request count."""

    def build(
        name: str,
        version: int,
        config: ModelConfig,
        version_dir: Path,
        backend_cls: type[Backend],
        resolve: Callable[[str, str], ModelRuntime],
    ) -> ModelRuntime:
        return ModelRuntime(
            name,
            version,
            config,
            version_dir,
            backend_cls,
            cache,
            resolve=resolve,
            rate_limiter=rate_limiter,
            tracer=tracer,
            activity=activity,
        )

    return build


def _model_cache(config: ModelConfig, name: str, cache: Cache | None) -> Cache | None:
    """The server's cache when this model asks for it and can use it; else None."""
    if not config.response_cache.enable:
        return None
    if cache is None:
        log.warning(
            "model '%s' enables response_cache, but the server has no cache: start kiln "
            "with --cache-config local,size=BYTES to cache its responses",
            name,
        )
        return None
    if config.HasField("sequence_batching"):
        # A stateful model's answer depends on the sequence so far, not on the inputs alone.
        log.warning("model '%s': response_cache is ignored for sequence batching", name)
        return None
    return cache


def _dtype_ok(value: np.ndarray, datatype: DataType) -> bool:
    if datatype is DataType.BYTES:
        return value.dtype.kind in ("O", "S", "U")
    return value.dtype == datatype.numpy_dtype
