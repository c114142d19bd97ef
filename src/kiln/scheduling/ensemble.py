"""Ensembles: a model whose "backend" is a DAG of other models.

Each step is an ordinary inference request to its composing model, sent through that
model's own runtime, so its own scheduler (and dynamic batcher) applies per step and its
own statistics count the request. Composing models are looked up by name and version policy
on every request, never held: a hot reload of a composing model takes effect at once, and
an unloaded one fails the ensemble's requests with UNAVAILABLE, naming it.

**Decoupled steps.** A composing model that is decoupled (0..N responses per request, e.g.
an LLM streaming tokens between a tokenizer and a detokenizer) makes the ensemble
decoupled: each of its responses carries on through the steps after it on its own, with
the tensors made before it, and the ensemble sends one response each time a branch has
made the requested outputs. A decoupled step starts once nothing else runs in its branch,
so every branch copies a settled set of tensors and nothing before the step runs twice.
Decoupled steps must lie on one chain (each after the other); ones on parallel branches
are refused at load.

**max_inflight_requests** (``ensemble_scheduling``), as in Triton: at most that many
requests in flight at each step, across all of the ensemble's requests. A step waits for a
place before its request goes to its model. A decoupled step's responses are read one at a
time, the next only once the branch the last one started has its places; the stream holds
at most that many responses untaken, and a Python model's sender pauses while it is full
(``core/stream.py``), so a fast producer feeding a slow step cannot fill the memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import ClassVar, Protocol

import numpy as np

from kiln.backends.base import Backend
from kiln.config.ensemble_graph import ENSEMBLE_PLATFORM, EnsembleGraph, Step
from kiln.config.signature import ModelSignature, TensorSpec
from kiln.core.errors import KilnError, Status, internal, invalid_arg
from kiln.core.stats import ModelStats
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    RequestedOutput,
)
from kiln.scheduling.base import Job, Scheduler


class StepModel(Protocol):
    """What an ensemble needs of a composing model (a ``ModelRuntime``)."""

    name: str
    signature: ModelSignature
    decoupled: bool

    async def infer(self, request: InferenceRequest) -> InferenceResponse: ...

    def infer_stream(
        self, request: InferenceRequest, window: int = 0
    ) -> AsyncIterator[InferenceResponse]: ...


# (model name, version or "" for the latest ready one) -> the serving runtime
Resolve = Callable[[str, str], StepModel]
# ensemble tensor -> (datatype, array)
Tensors = dict[str, tuple[DataType, np.ndarray]]


class StepFailed(KilnError):
    """A step's failure, its message naming the ensemble, the step and its model."""


class EnsembleBackend(Backend):
    """Registered for ``platform: "ensemble"`` so that backend selection finds it; an
    ensemble has no instances, its runtime uses :class:`EnsembleScheduler` instead."""

    name: ClassVar[str] = ENSEMBLE_PLATFORM
    platforms: ClassVar[tuple[str, ...]] = (ENSEMBLE_PLATFORM,)

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        raise internal("an ensemble is scheduled by its steps, never executed as one model")


class EnsembleScheduler(Scheduler):
    def __init__(
        self,
        graph: EnsembleGraph,
        signature: ModelSignature,
        stats: ModelStats,
        resolve: Resolve,
        decoupled_steps: frozenset[int] = frozenset(),
        max_inflight: int = 0,
    ) -> None:
        """``decoupled_steps``: the indices of the steps whose model is decoupled;
        ``max_inflight``: ``max_inflight_requests`` (0: no limit)."""
        super().__init__([], stats, graph.name)
        self.graph = graph
        self.signature = signature
        self.resolve = resolve
        self.decoupled_steps = decoupled_steps
        self.max_inflight = max_inflight
        # one place-count per step, shared by every request; None costs nothing
        self._places: list[asyncio.Semaphore] | None = (
            [asyncio.Semaphore(max_inflight) for _ in graph.steps] if max_inflight > 0 else None
        )

    def in_flight(self, step: int) -> int:
        """Requests in flight at a step now (0 without ``max_inflight_requests``)."""
        if self._places is None:
            return 0
        return self.max_inflight - self._places[step]._value

    async def _start(self, step: Step, tensors: Tensors, job: Job) -> asyncio.Task[Tensors]:
        """The step's request as a task, once the step has a place; the place is given
        back when the task ends (even one cancelled before it began)."""
        places = self._places
        if places is None:
            return asyncio.create_task(self._run_step(step, tensors, job))
        place = places[step.index]
        await place.acquire()
        task = asyncio.create_task(self._run_step(step, tensors, job))
        task.add_done_callback(lambda _: place.release())
        return task

    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        if self.decoupled_steps:
            return await self._schedule_streaming(job)
        tensors, absent = self._begin(job)
        waiting = list(self.graph.steps)
        running: dict[asyncio.Task[Tensors], Step] = {}
        error: KilnError | None = None
        while True:
            if error is None:
                for step in [s for s in waiting if _ready(s, tensors, absent)]:
                    waiting.remove(step)
                    running[await self._start(step, tensors, job)] = step
            if not running:
                break
            # Steps in flight when another fails still finish (their models' batches may
            # hold other requests), but no new step starts.
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                step = running.pop(task)
                exc = task.exception()
                if exc is None:
                    tensors.update(task.result())
                elif error is None:
                    error = self._step_error(step, exc)
        if error is not None:
            raise error
        if waiting:  # validated acyclic at load, so only a bug gets here
            raise internal(f"ensemble '{self.model}': steps {[s.index for s in waiting]} never ran")
        end = time.monotonic_ns()
        job.times.infer_end = job.times.output_end = end
        return {name: tensors[name][1] for name in job.output_names}

    def _begin(self, job: Job) -> tuple[Tensors, set[str]]:
        """The request's tensors, and the optional ensemble inputs it left out (they never
        arrive: nothing waits for them)."""
        # An ensemble never waits in a queue of its own: its steps queue at their models.
        job.times.queue_end = job.times.input_end = time.monotonic_ns()
        tensors: Tensors = {
            name: (self.signature.inputs[name].datatype, value)
            for name, value in job.inputs.items()
        }
        return tensors, set(self.graph.inputs) - set(tensors)

    # ---- with decoupled steps: one branch per response ------------------------------------
    async def _schedule_streaming(self, job: Job) -> dict[str, np.ndarray]:
        sink = job.sink
        if sink is None:
            raise internal(f"ensemble '{self.model}' is decoupled but has no response stream")
        tensors, absent = self._begin(job)
        await self._branch(tensors, list(self.graph.steps), job, absent)
        job.times.infer_end = job.times.output_end = time.monotonic_ns()
        sink.send(None, True, None)  # every branch has answered
        return {}

    async def _branch(
        self,
        tensors: Tensors,
        waiting: list[Step],
        job: Job,
        absent: set[str],
        admitted: asyncio.Future[None] | None = None,
    ) -> None:
        """Run the steps of one branch; a decoupled step forks it, one branch per response.
        A branch that ends with every requested output sends them as one response.
        ``admitted`` is set once the branch's first steps have their places (the fork
        that started it reads the next response only then)."""
        running: dict[asyncio.Task[Tensors], Step] = {}
        try:
            while True:
                ready = [s for s in waiting if _ready(s, tensors, absent)]
                for step in ready:
                    if step.index not in self.decoupled_steps:
                        waiting.remove(step)
                        running[await self._start(step, tensors, job)] = step
                if not running:
                    forks = [s for s in ready if s.index in self.decoupled_steps]
                    if forks:  # nothing else runs: every branch copies settled tensors
                        waiting.remove(forks[0])
                        if self._places is not None:
                            await self._places[forks[0].index].acquire()
                        _admit(admitted)
                        await self._fork(forks[0], tensors, waiting, job, absent)
                        return
                    break
                _admit(admitted)
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    step = running.pop(task)
                    exc = task.exception()
                    if exc is not None:
                        raise self._step_error(step, exc)
                    tensors.update(task.result())
        finally:
            _admit(admitted)
            for task in running:  # a step failed: the branch's other steps are not wanted
                task.cancel()
        if all(name in tensors for name in job.output_names):
            assert job.sink is not None
            job.sink.send({name: tensors[name][1] for name in job.output_names}, False, None)

    async def _fork(
        self, step: Step, tensors: Tensors, rest: list[Step], job: Job, absent: set[str]
    ) -> None:
        """Run a decoupled step (its place taken by the caller, given back when its
        stream ends) and a branch per response."""
        branches: set[asyncio.Task[None]] = set()
        try:
            try:
                # closed on the way out, so a step left early (a branch failed, the client
                # went away) has its own request cancelled at once, not when collected
                async with contextlib.aclosing(self._stream_step(step, tensors, job)) as stream:
                    async for produced in stream:
                        _reap(branches)  # a branch that failed stops the stream now
                        branch = dict(tensors)
                        branch.update(produced)
                        admitted = None if self._places is None else _future()
                        task = asyncio.create_task(
                            self._branch(branch, list(rest), job, absent, admitted)
                        )
                        branches.add(task)
                        if admitted is not None:  # backpressure: the next once it is in
                            await asyncio.wait({admitted, task}, return_when=_FIRST)
            except StepFailed:
                raise  # a branch's, already naming its step
            except Exception as exc:
                raise self._step_error(step, exc) from exc
            finally:
                if self._places is not None:
                    self._places[step.index].release()
            while branches:
                done, branches = await asyncio.wait(branches, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    if (failure := task.exception()) is not None:
                        raise failure
        finally:
            for task in branches:
                task.cancel()

    async def _stream_step(
        self, step: Step, tensors: Tensors, job: Job
    ) -> AsyncGenerator[Tensors, None]:
        """The outputs of each response of a decoupled step, as they come."""
        model = self.resolve(step.model_name, step.model_version)
        request = self._step_request(step, tensors, job)
        # a FINAL flag alone carries nothing for the steps after it
        request.parameters.pop("triton_enable_empty_final_response", None)
        async for response in model.infer_stream(request, self.max_inflight):
            if response.outputs:
                yield {step.outputs[o.name]: (o.datatype, o.data) for o in response.outputs}

    async def _run_step(self, step: Step, tensors: Tensors, job: Job) -> Tensors:
        model = self.resolve(step.model_name, step.model_version)
        response = await model.infer(self._step_request(step, tensors, job))
        return {step.outputs[o.name]: (o.datatype, o.data) for o in response.outputs}

    def _step_request(self, step: Step, tensors: Tensors, job: Job) -> InferenceRequest:
        inputs = []
        for model_input, tensor in step.inputs.items():
            if tensor in tensors:  # else an absent optional input: the model decides
                dtype, value = tensors[tensor]
                inputs.append(InferInput(model_input, dtype, tuple(value.shape), value))
        return InferenceRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            inputs=inputs,
            outputs=[RequestedOutput(name) for name in step.outputs],
            # priority / timeout apply to every step, as they would to the model alone
            parameters=dict(job.parameters),
        )

    def _step_error(self, step: Step, exc: BaseException) -> StepFailed:
        prefix = f"in ensemble '{self.model}', step {step.index} model '{step.model_name}' failed"
        if isinstance(exc, KilnError):
            # A composing model that is not loaded (any more) makes the ensemble unavailable.
            status = Status.UNAVAILABLE if exc.status is Status.NOT_FOUND else exc.status
            return StepFailed(f"{prefix}: {exc.message}", status)
        return StepFailed(f"{prefix}: {type(exc).__name__}: {exc}", Status.INTERNAL)


_FIRST = asyncio.FIRST_COMPLETED


def _future() -> asyncio.Future[None]:
    return asyncio.get_running_loop().create_future()


def _admit(admitted: asyncio.Future[None] | None) -> None:
    if admitted is not None and not admitted.done():
        admitted.set_result(None)


def _reap(branches: set[asyncio.Task[None]]) -> None:
    """Drop the branches that have ended; raise the error of one that failed."""
    for task in [t for t in branches if t.done()]:
        branches.discard(task)
        if not task.cancelled() and (failure := task.exception()) is not None:
            raise failure


def _ready(step: Step, tensors: Tensors, absent: set[str]) -> bool:
    return all(t in tensors or t in absent for t in step.inputs.values())


def decoupled_steps(graph: EnsembleGraph, resolve: Resolve) -> frozenset[int]:
    """The steps whose model is decoupled; refused when two of them lie on parallel
    branches (each response of one would run the other again)."""
    found = frozenset(
        step.index for step in graph.steps if resolve(step.model_name, step.model_version).decoupled
    )
    producer = {tensor: step.index for step in graph.steps for tensor in step.outputs.values()}
    before: dict[int, set[int]] = {}  # step -> every step it (transitively) waits for

    def ancestors(index: int) -> set[int]:
        if index not in before:
            direct = {producer[t] for t in graph.steps[index].inputs.values() if t in producer}
            before[index] = set(direct)
            for parent in direct:
                before[index] |= ancestors(parent)
        return before[index]

    ordered = sorted(found)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1 :]:
            if a not in ancestors(b) and b not in ancestors(a):
                raise invalid_arg(
                    f"in ensemble '{graph.name}', {graph.steps[a].label} and "
                    f"{graph.steps[b].label} are decoupled and on parallel branches: decoupled "
                    "steps must come one after the other"
                )
    return found


def check_composing(graph: EnsembleGraph, signature: ModelSignature, resolve: Resolve) -> None:
    """Load-time checks that need the composing models: names, datatypes, shapes, batching."""
    where = f"in ensemble '{graph.name}', "
    mbs = signature.max_batch_size
    # tensor -> (datatype, full shape, who writes it)
    known: dict[str, tuple[DataType, list[int], str]] = {
        name: (spec.datatype, spec.full_shape(mbs), f"ensemble input '{name}'")
        for name, spec in signature.inputs.items()
    }
    models: dict[int, ModelSignature] = {}
    for step in graph.steps:
        try:
            sig = resolve(step.model_name, step.model_version).signature
        except KilnError as exc:
            raise KilnError(
                where + f"{step.label} is not available: {exc.message}", Status.UNAVAILABLE
            ) from exc
        models[step.index] = sig
        if mbs > 0 and sig.max_batch_size < mbs:
            raise invalid_arg(
                where + f"max_batch_size {mbs} is larger than {step.label}'s "
                f"max_batch_size {sig.max_batch_size}"
            )
        _check_names(where, step, "input", step.inputs, sig.inputs)
        _check_names(where, step, "output", step.outputs, sig.outputs)
        unmapped = [n for n in sig.required if n not in step.inputs]
        if unmapped:
            raise invalid_arg(where + f"{step.label} required input(s) {unmapped} are not mapped")
        for model_output, tensor in step.outputs.items():
            spec = sig.outputs[model_output]
            writer = f"{step.label} output '{model_output}'"
            known[tensor] = (spec.datatype, spec.full_shape(sig.max_batch_size), writer)
    for step in graph.steps:
        sig = models[step.index]
        for model_input, tensor in step.inputs.items():
            reader = f"{step.label} input '{model_input}'"
            _check_compatible(where, reader, sig.inputs[model_input], sig, tensor, known[tensor])
    for name, spec in signature.outputs.items():
        _check_compatible(where, f"ensemble output '{name}'", spec, signature, name, known[name])


def _check_names(
    where: str, step: Step, kind: str, mapped: dict[str, str], specs: dict[str, TensorSpec]
) -> None:
    for name in mapped:
        if name not in specs:
            raise invalid_arg(
                where + f"{step.label} has no {kind} '{name}' (its {kind}s: {list(specs)})"
            )


def _check_compatible(
    where: str,
    reader: str,
    spec: TensorSpec,
    sig: ModelSignature,
    tensor: str,
    written: tuple[DataType, list[int], str],
) -> None:
    dtype, shape, writer = written
    want = spec.full_shape(sig.max_batch_size)
    same_shape = len(shape) == len(want) and all(
        a == b or -1 in (a, b) for a, b in zip(shape, want, strict=True)
    )
    if dtype is not spec.datatype or not same_shape:
        raise invalid_arg(
            where + f"{reader} expects {spec.datatype.config_name} {want}, but tensor "
            f"'{tensor}' ({writer}) is {dtype.config_name} {shape}"
        )
