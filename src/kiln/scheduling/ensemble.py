"""Ensembles: a model whose "backend" is a DAG of other models.

Each step is an ordinary inference request to its composing model, sent through that
model's own runtime, so its own scheduler (and dynamic batcher) applies per step and its
own statistics count the request. Composing models are looked up by name and version policy
on every request, never held: a hot reload of a composing model takes effect at once, and
an unloaded one fails the ensemble's requests with UNAVAILABLE, naming it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import ClassVar, Protocol

import numpy as np

from kiln.backends.base import Backend
from kiln.core.errors import KilnError, Status, internal, invalid_arg
from kiln.core.signature import ModelSignature, TensorSpec
from kiln.core.stats import ModelStats
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    RequestedOutput,
)
from kiln.scheduling.base import Job, Scheduler
from kiln.scheduling.ensemble_graph import ENSEMBLE_PLATFORM, EnsembleGraph, Step


class StepModel(Protocol):
    """What an ensemble needs of a composing model (a ``ModelRuntime``)."""

    name: str
    signature: ModelSignature

    async def infer(self, request: InferenceRequest) -> InferenceResponse: ...


# (model name, version or "" for the latest ready one) -> the serving runtime
Resolve = Callable[[str, str], StepModel]
# ensemble tensor -> (datatype, array)
Tensors = dict[str, tuple[DataType, np.ndarray]]


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
        self, graph: EnsembleGraph, signature: ModelSignature, stats: ModelStats, resolve: Resolve
    ) -> None:
        super().__init__([], stats, graph.name)
        self.graph = graph
        self.signature = signature
        self.resolve = resolve

    async def schedule(self, job: Job) -> dict[str, np.ndarray]:
        start = time.monotonic_ns()
        # An ensemble never waits in a queue of its own: its steps queue at their models.
        job.times.queue_end = job.times.input_end = start
        tensors: Tensors = {
            name: (self.signature.inputs[name].datatype, value)
            for name, value in job.inputs.items()
        }
        # Optional ensemble inputs the client left out never arrive: do not wait for them.
        absent = set(self.graph.inputs) - set(tensors)
        waiting = list(self.graph.steps)
        running: dict[asyncio.Task[Tensors], Step] = {}
        error: KilnError | None = None
        while True:
            if error is None:
                for step in [s for s in waiting if _ready(s, tensors, absent)]:
                    waiting.remove(step)
                    task = asyncio.create_task(self._run_step(step, tensors, job))
                    running[task] = step
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

    async def _run_step(self, step: Step, tensors: Tensors, job: Job) -> Tensors:
        model = self.resolve(step.model_name, step.model_version)
        inputs = []
        for model_input, tensor in step.inputs.items():
            if tensor in tensors:  # else an absent optional input: the model decides
                dtype, value = tensors[tensor]
                inputs.append(InferInput(model_input, dtype, tuple(value.shape), value))
        request = InferenceRequest(
            model_name=step.model_name,
            model_version=step.model_version,
            inputs=inputs,
            outputs=[RequestedOutput(name) for name in step.outputs],
            # priority / timeout apply to every step, as they would to the model alone
            parameters=dict(job.parameters),
        )
        response = await model.infer(request)
        return {step.outputs[o.name]: (o.datatype, o.data) for o in response.outputs}

    def _step_error(self, step: Step, exc: BaseException) -> KilnError:
        prefix = f"in ensemble '{self.model}', step {step.index} model '{step.model_name}' failed"
        if isinstance(exc, KilnError):
            # A composing model that is not loaded (any more) makes the ensemble unavailable.
            status = Status.UNAVAILABLE if exc.status is Status.NOT_FOUND else exc.status
            return KilnError(f"{prefix}: {exc.message}", status)
        return internal(f"{prefix}: {type(exc).__name__}: {exc}")


def _ready(step: Step, tensors: Tensors, absent: set[str]) -> bool:
    return all(t in tensors or t in absent for t in step.inputs.values())


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
