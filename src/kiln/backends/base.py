"""What a backend is: one loaded model instance that runs a batch.

A backend never parses wire formats; it receives NumPy arrays keyed by the model's input
names (already validated and batched by core and the scheduler) and returns NumPy arrays
keyed by output name.
"""

from __future__ import annotations

import asyncio
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np

from kiln.config.model_config_pb2 import ModelConfig, ModelInstanceGroup
from kiln.core.activity import Activity
from kiln.core.errors import KilnError, Status

if TYPE_CHECKING:
    from kiln.core.stats import ModelStats


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """Where one instance runs: ``kind`` is ``"cpu"`` or ``"gpu"``."""

    name: str
    kind: str
    device_id: int
    index: int
    total_instances: int


class ResponseSink(Protocol):
    """Where a decoupled model's responses go, from the instance's thread, as they come.

    ``window`` > 0 asks the producer to pause while that many of its non-final responses
    are untaken; one that can registers ``on_credit`` (``core/stream.py``)."""

    window: int

    def on_credit(self, grant: Callable[[int], None]) -> None: ...

    def detach(self) -> None:
        """The request's batch ended before its FINAL flag: the model sends the rest from
        its own threads, so the stream ends with that flag, not with the batch."""

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        final: bool,
        error: KilnError | None,
        parameters: dict[str, Any] | None = None,
    ) -> None: ...


class BackendRequest(Protocol):
    """One request as a backend that takes requests unmerged sees it (``Job`` is one)."""

    inputs: dict[str, np.ndarray]
    output_names: list[str]
    parameters: dict[str, Any]
    request_id: str
    sink: ResponseSink | None
    deadline_ns: int  # time.monotonic_ns() by which it must be answered; 0 = none
    # The response's parameters as the model set them (a Python model's
    # ``InferenceResponse(parameters=...)``), for the client: set by the backend.
    response_parameters: dict[str, Any] | None
    # A request whose client can go away (``Job``) also has ``add_cancel_callback``.

    @property
    def correlation_id(self) -> int | str:
        """Triton's ``correlation_id()``: its sequence's id (0 outside a sequence)."""

    @property
    def flags(self) -> int:
        """Triton's ``flags()``: START (1) / END (2) in a sequence batch, else 0."""


# One entry per request: its outputs, or the error that request alone failed with.
RequestOutcome = dict[str, np.ndarray] | KilnError


class Rescheduled(KilnError):
    """The outcome of a request the model released with Triton's
    ``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: it is not answered yet but runs again in
    a later batch. Only the sequence batcher with ``iterative_sequence`` takes it back; any
    other caller sees it as the error it is (a backend refuses rescheduling elsewhere)."""

    def __init__(self, model: str) -> None:
        super().__init__(
            f"Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE, but model "
            f"'{model}' cannot reschedule it: that needs sequence_batching "
            "{ iterative_sequence: true }",
            Status.INTERNAL,
        )


class NotStarted(Exception):
    """A batch ``start_requests`` accepted behind another was lost before it started (its
    worker died first): the instance runs it again on its thread."""


class Backend(ABC):
    """One instance of one model version. ``execute`` is called from one thread at a time."""

    #: config ``backend`` name (``"onnxruntime"``)
    name: ClassVar[str]
    #: config ``platform`` names this backend serves (``"onnxruntime_onnx"``)
    platforms: ClassVar[tuple[str, ...]] = ()
    #: model file looked for in the version folder when the config names none
    default_model_filename: ClassVar[str] = ""
    #: True: schedulers hand over each request unmerged through ``execute_requests``
    #: (the Python backend gives a model its requests as a list, as Triton does)
    wants_requests: ClassVar[bool] = False
    #: True when a call may run on the event loop's thread if it is short enough (CPU
    #: compute that needs nothing else from the server); see ``Instance.submit``.
    inline_capable: bool = False
    #: ... and only while its request is the only one in flight in the server (the loop
    #: has nothing else to do); under load the call goes to the instance's thread, where
    #: it overlaps the loop's work on another core.
    inline_only_alone: bool = False
    #: batches the scheduler without batching may have started on one instance at once
    #: (``start_requests`` queues them: the Python backend's worker pipe, ``loopcall.py``;
    #: set per model from its config there)
    pipeline_depth: int = 1
    #: KServe ``infer`` runs even when the model is decoupled (one whole response; the
    #: llm backends, whose ``stream`` input decides), where Triton refuses it
    infer_when_decoupled: ClassVar[bool] = False
    #: batches started on one instance run at once, not one after another (an engine
    #: that batches by itself): none waited for another, so none counts queue time for it
    runs_concurrently: ClassVar[bool] = False
    #: the model version's statistics, set by its runtime at load: for backends that serve
    #: requests outside the schedulers (the llm backend's OpenAI and generate routes)
    model_stats: ModelStats | None = None
    #: the server's request tracer (``kiln.core.trace.Tracer``), set with ``model_stats``,
    #: for the same routes
    tracer: Any = None

    @property
    def queued_requests(self) -> int:
        """Requests accepted behind a running batch (``pipeline_depth`` > 1), not started:
        pending, as those that wait for an instance are. Read from any thread."""
        return 0

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        self.config = config
        self.version_dir = version_dir
        self.instance = instance
        #: the server's in-flight request count, set by the runtime with ``model_stats``
        #: (until then, as for a backend no server runs, one of its own: always alone)
        self.activity = Activity()

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        """Fill what the model file can tell (inputs, outputs, max_batch_size) in place."""
        return None  # most backends cannot tell anything from their file

    #: A ``KIND_GPU`` group without ``gpus`` puts ``count`` instances on every GPU, as
    #: Triton does; False: on GPU 0 only.
    spread_over_gpus: ClassVar[bool] = True

    @classmethod
    def gpu_count(cls) -> int:
        """GPUs this backend can put instances on (``KIND_GPU`` spreads over all of them
        unless the group lists ``gpus``); 0 refuses ``KIND_GPU``."""
        return 0

    @abstractmethod
    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        """Run one batch; return at least the outputs named in ``output_names``."""

    def execute_requests(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        """Run several requests as one execution; one outcome per request, in order."""
        raise NotImplementedError(f"backend '{self.name}' takes merged batches only")

    def start_requests(
        self, requests: list[BackendRequest]
    ) -> asyncio.Future[list[RequestOutcome]] | None:
        """On the event loop's thread: start ``execute_requests`` without blocking and
        return a future the loop resolves (a backend whose work happens in another process
        needs no thread of its own to wait for it); None: run it on the instance's thread."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the session / device memory."""

    def model_path(self) -> Path:
        filename = self.config.default_model_filename or self.default_model_filename
        return self.version_dir / filename


def parameter(config: ModelConfig, key: str, default: str | None = None) -> str | None:
    """A config ``parameters { key: ... value { string_value } }`` entry."""
    if key in config.parameters:
        return str(config.parameters[key].string_value)
    return default


def count_parameter(config: ModelConfig, key: str, unit: str = "") -> int | None:
    """A config parameter that must be a whole number >= 0 (None when absent); ``unit``
    says in the error what it counts."""
    raw = parameter(config, key)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        what = f" ({unit})" if unit else ""
        raise KilnError(
            f"model '{config.name}': parameter {key} must be a non-negative integer{what}, "
            f"got '{raw}'",
            Status.INVALID_ARG,
        )
    return value


def instance_specs(
    config: ModelConfig, gpu_count: int, spread_over_gpus: bool = True
) -> list[InstanceSpec]:
    """Expand ``instance_group`` into one spec per instance (Triton's defaults applied).

    ``gpu_count`` is how many GPUs the backend can use: KIND_AUTO falls back to the CPU
    without one, KIND_GPU refuses to load. A GPU group without ``gpus`` puts its ``count``
    instances on each of them (``spread_over_gpus``), else on GPU 0.
    """
    specs: list[tuple[str, str, int]] = []
    for group_index, group in enumerate(config.instance_group):
        name = group.name or f"{config.name}_{group_index}"
        kind = group.kind
        if kind == ModelInstanceGroup.KIND_AUTO:
            kind = ModelInstanceGroup.KIND_GPU if gpu_count else ModelInstanceGroup.KIND_CPU
        if kind == ModelInstanceGroup.KIND_GPU:
            if not gpu_count:
                # Without this the group would expand to zero instances and every request
                # would wait forever on a model that reports READY.
                raise KilnError(
                    f"instance group {name} of model {config.name} has kind KIND_GPU but "
                    f"server does not support GPUs: the {config.backend or 'model'} backend "
                    "finds no usable GPU on this machine; use KIND_CPU, or KIND_AUTO to run "
                    "on a GPU when there is one and on the CPU otherwise",
                    Status.INVALID_ARG,
                )
            gpus = list(group.gpus) or list(range(gpu_count if spread_over_gpus else 1))
            for gpu in gpus:
                if not 0 <= gpu < gpu_count:
                    raise KilnError(
                        f"instance group {name} of model {config.name} specifies invalid or "
                        f"unsupported gpu id {gpu}: the {config.backend or 'model'} backend "
                        f"can use GPUs {', '.join(map(str, range(gpu_count)))}",
                        Status.INVALID_ARG,
                    )
            for gpu in gpus:
                specs.extend((name, "gpu", gpu) for _ in range(max(group.count, 1)))
        else:
            specs.extend((name, "cpu", 0) for _ in range(max(group.count, 1)))
    total = len(specs)
    return [
        InstanceSpec(name=n, kind=k, device_id=d, index=i, total_instances=total)
        for i, (n, k, d) in enumerate(specs)
    ]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
