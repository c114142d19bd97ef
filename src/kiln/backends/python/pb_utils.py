"""kiln's ``triton_python_backend_utils``: the API a Triton Python model is written against.

The worker registers this module under the name ``triton_python_backend_utils``, so an
unchanged ``import triton_python_backend_utils as pb_utils`` finds it. Tensors are plain
NumPy arrays here (kiln's Python backend runs on the CPU); requests sent to other models
(BLS) and responses of decoupled models go through the worker's channel to the server.

This module holds what reaches the server (through ``_channel`` and ``_metrics``, which the
worker sets): requests and their BLS calls, decoupled response senders, model control and
custom metrics. The plain values it re-exports, as its own API, live in ``pb_tensor``
(``Tensor``, data types, BYTES), ``pb_errors``, ``pb_response``, ``pb_config`` (config
helpers) and ``pb_logger``.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
from typing import Any

from kiln.backends.python import custom_metrics
from kiln.backends.python.autocomplete import ModelConfig
from kiln.backends.python.pb_config import (
    get_input_config_by_name,
    get_output_config_by_name,
    using_decoupled_model_transaction_policy,
)
from kiln.backends.python.pb_errors import TritonError, TritonModelException
from kiln.backends.python.pb_logger import Logger
from kiln.backends.python.pb_response import InferenceResponse, get_output_tensor_by_name
from kiln.backends.python.pb_tensor import (
    TRITON_STRING_TO_NUMPY,
    Tensor,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)
from kiln.backends.python.pb_tensor import TYPE_BYTES as TYPE_BYTES  # public, not in __all__

__all__ = [
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "Logger",
    "MemoryType",
    "Metric",
    "MetricFamily",
    "MetricKind",
    "ModelConfig",
    "PreferredMemory",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "install",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
# Request release flags: ALL answers the request; RESCHEDULE runs it again in a later batch
# (``InferenceRequest.set_release_flags``; needs ``sequence_batching { iterative_sequence:
# true }``).
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
# Memory types a BLS request may prefer for its outputs (``PreferredMemory``).
TRITONSERVER_MEMORY_CPU = 0
TRITONSERVER_MEMORY_CPU_PINNED = 1
TRITONSERVER_MEMORY_GPU = 2

# Set by the worker: carries BLS requests and decoupled responses to the server.
_channel: Any = None
_metrics: Any = None  # the worker's custom_metrics.MetricStore


def install() -> None:
    """Make ``import triton_python_backend_utils`` resolve to this module."""
    sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])


def _json(parameters: dict[str, Any] | str | None) -> str:
    return parameters if isinstance(parameters, str) else json.dumps(parameters or {})


class InferenceResponseSender:
    """Sends a decoupled model's responses, 0..N per request, the last flagged FINAL."""

    def __init__(self, key: int, request: InferenceRequest | None = None) -> None:
        self._key = key  # the server's name for the request's stream
        self._request = request
        self.closed = False
        # Flow control (an ensemble's ``max_inflight_requests``): with a window, a send
        # waits while ``window`` non-final responses are sent and not granted (taken
        # downstream); ``worker_channel.Channel`` reads the grants.
        self._window = 0
        self._sent = 0
        self._granted = 0
        # Why a send is refused once closed: the FINAL flag was sent, or the batch ended
        # (its execute raised) and the request was answered with that error.
        self.closed_reason = (
            "Unable to send response: the response sender has already sent its final "
            "response (TRITONSERVER_RESPONSE_COMPLETE_FINAL)"
        )

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        if response is not None and not isinstance(response, InferenceResponse):
            raise TritonModelException(
                f"send() takes an InferenceResponse, not {type(response).__name__}"
            )
        if _channel is None:
            raise TritonModelException("no server channel: this model is not running in kiln")
        # The channel checks ``closed`` and sets it under its lock: a thread of the model's
        # may send while the main thread ends the batch.
        _channel.send_response(self, response, bool(flags & TRITONSERVER_RESPONSE_COMPLETE_FINAL))

    def is_cancelled(self) -> bool:
        """Whether the request's client went away (a cancelled gRPC stream, a closed
        connection): the model may stop and send the FINAL flag."""
        return self._request is not None and self._request.is_cancelled()


class PreferredMemory:
    """Where a BLS call would like its outputs (Triton's ``preferred_memory``). kiln holds
    tensors in host memory, so outputs come back on the CPU whatever is preferred; the
    object is accepted so that models written for a GPU Triton load unchanged."""

    def __init__(self, preferred_memory_type: int = TRITONSERVER_MEMORY_CPU,
                 preferred_device_id: int = 0) -> None:  # fmt: skip
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """What ``request.trace()`` returns, for a BLS request's ``trace=`` argument: a BLS
    call made with it is traced as a child of this request's trace (when the server
    sampled it; docs/tracing.md). ``get_context()``: in the opentelemetry trace mode, the
    W3C context of the request's model span as JSON (``{"traceparent": ...}``), for the
    model's own spans; else None, as in Triton."""

    def __init__(self, trace_id: int = 0, context: str | None = None) -> None:
        self._trace_id = int(trace_id)
        self._context = context

    def get_context(self) -> str | None:
        return self._context


#: The trace of an untraced request (immutable: shared by all of them).
_UNTRACED = InferenceTrace()


class InferenceRequest:
    """A request the model receives in ``execute``, or builds to call another model (BLS)."""

    def __init__(
        self,
        model_name: str = "",
        inputs: list[Tensor] | None = None,
        requested_output_names: list[str] | None = None,
        model_version: int = -1,
        correlation_id: int | str = 0,
        request_id: str = "",
        flags: int = 0,
        timeout: int = 0,
        parameters: dict[str, Any] | str | None = None,
        trace: InferenceTrace | None = None,
        **_: Any,  # preferred_memory: meaningless on a CPU-only backend
    ) -> None:
        self._trace = trace if trace is not None else _UNTRACED
        self._model_name = model_name
        self._inputs = list(inputs or [])
        self._outputs = list(requested_output_names or [])
        self._model_version = model_version
        self._correlation_id = correlation_id
        self._request_id = request_id
        self._flags = flags
        self._timeout = timeout
        self._parameters = (
            parameters if isinstance(parameters, str) else json.dumps(parameters or {})
        )
        self._sender: InferenceResponseSender | None = None
        self._release_flags = TRITONSERVER_REQUEST_RELEASE_ALL
        # Where the server flags this request cancelled: (arena, byte offset), in execute.
        self._cancel_flag: tuple[Any, int] | None = None

    def inputs(self) -> list[Tensor]:
        return self._inputs

    def set_flags(self, flags: int) -> None:
        """A BLS request's sequence flags (``TRITONSERVER_REQUEST_FLAG_SEQUENCE_START`` /
        ``_END``), as the constructor's ``flags`` sets them."""
        self._flags = int(flags)

    def trace(self) -> InferenceTrace:
        return self._trace

    def requested_output_names(self) -> list[str]:
        return self._outputs

    def request_id(self) -> str:
        return self._request_id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def model_name(self) -> str:
        return self._model_name

    def model_version(self) -> int:
        return self._model_version

    def flags(self) -> int:
        return self._flags

    def timeout(self) -> int:
        return self._timeout

    def parameters(self) -> str:
        return self._parameters

    def set_release_flags(self, flags: int) -> None:
        """``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE``: run this request again in a later
        batch instead of answering it now (Triton 23.11+; the model's config needs
        ``sequence_batching { iterative_sequence: true }``). A model that is not decoupled
        puts None in place of its response; a decoupled one calls this before ``execute``
        returns. ``TRITONSERVER_REQUEST_RELEASE_ALL`` (the default) answers it."""
        if flags not in (TRITONSERVER_REQUEST_RELEASE_ALL, TRITONSERVER_REQUEST_RELEASE_RESCHEDULE):
            raise TritonModelException(
                f"set_release_flags: unknown flags {flags!r} (use "
                "TRITONSERVER_REQUEST_RELEASE_ALL or TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)"
            )
        self._release_flags = flags

    def is_cancelled(self) -> bool:
        """Whether the request's client went away while it runs (Triton 23.10+)."""
        flag = self._cancel_flag
        return flag is not None and flag[0].flag(flag[1])

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender() is only available to decoupled models "
                "(model_transaction_policy { decoupled: true })"
            )
        return self._sender

    def exec(self, decoupled: bool = False) -> Any:
        """Run this request on another model through the server; errors come back in it.
        ``decoupled=True``: an iterator of the responses as the model sends them."""
        if _channel is None:
            raise TritonModelException("no server channel: this model is not running in kiln")
        if decoupled:
            return _channel.stream(self)
        return _channel.call(self)

    async def async_exec(self, decoupled: bool = False) -> Any:
        # The channel answers one call at a time, so a thread keeps the caller's loop free
        # without letting two calls interleave on the pipe.
        return await asyncio.get_running_loop().run_in_executor(None, self.exec, decoupled)


# ---- model control from a model (Triton's model loading API; explicit mode) ---------------
def _control(call: dict[str, Any]) -> Any:
    if _channel is None:
        raise TritonModelException("no server channel: this model is not running in kiln")
    return _channel.control(call)


def load_model(model_name: str, config: str = "", files: dict[str, bytes] | None = None) -> None:
    """Load (or reload) ``model_name`` in the server running this model, as the
    repository API does: ``config`` a JSON model config overriding the repository's,
    ``files`` ``{"file:1/model.onnx": bytes}`` to load it from. Needs
    ``--model-control-mode=explicit``; raises ``TritonModelException`` if it fails."""
    for key, value in (files or {}).items():
        if not key.startswith("file:") or not isinstance(value, bytes | bytearray):
            raise TritonModelException(
                f"load_model('{model_name}'): files maps 'file:<path>' to bytes, got "
                f"{key!r}: {type(value).__name__}"
            )
    _control(
        {
            "action": "load",
            "name": model_name,
            "config": config or "",
            "files": {k: bytes(v) for k, v in (files or {}).items()},
        }
    )


def unload_model(model_name: str, unload_dependents: bool = False) -> None:
    """Unload ``model_name`` (explicit mode), with ``unload_dependents`` an ensemble's
    composing models too (those not loaded by name nor used by another ensemble);
    ``TritonModelException`` if it fails."""
    _control({"action": "unload", "name": model_name, "unload_dependents": unload_dependents})


def is_model_ready(model_name: str, model_version: str = "") -> bool:
    """Whether ``model_name`` (``model_version``, or its latest) is ready for requests."""
    return bool(_control({"action": "ready", "name": model_name, "version": model_version}))


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


class MetricKind(enum.IntEnum):
    """Triton's ``pb_utils.MetricKind``; its members are also module names
    (``pb_utils.COUNTER``) and ``MetricFamily`` attributes."""

    COUNTER = custom_metrics.COUNTER
    GAUGE = custom_metrics.GAUGE
    HISTOGRAM = custom_metrics.HISTOGRAM


COUNTER, GAUGE, HISTOGRAM = MetricKind


class MemoryType(enum.IntEnum):
    """Triton's ``pb_utils.MemoryType`` (a ``PreferredMemory``'s type)."""

    TRITONSERVER_MEMORY_CPU = TRITONSERVER_MEMORY_CPU
    TRITONSERVER_MEMORY_GPU = TRITONSERVER_MEMORY_GPU


class MetricFamily:
    """A custom metric family, shown on the server's ``/metrics`` (Triton's custom metrics).

    ``MetricFamily(name, description, kind)`` with ``kind`` one of ``COUNTER``, ``GAUGE``,
    ``HISTOGRAM``; the same name again returns the same family (a different kind or
    description is an error)."""

    COUNTER = custom_metrics.COUNTER
    GAUGE = custom_metrics.GAUGE
    HISTOGRAM = custom_metrics.HISTOGRAM

    def __init__(self, name: str, description: str, kind: int) -> None:
        if _metrics is None:
            raise TritonModelException("no server: custom metrics need a model running in kiln")
        try:
            _metrics.family(name, description, kind)
        except custom_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None
        self._name = name
        self._kind = kind

    def Metric(
        self, labels: dict[str, str] | None = None, buckets: list[float] | None = None
    ) -> Metric:
        return Metric(self, labels or {}, buckets)


class Metric:
    """One labelled metric of a family: ``increment`` (counter, gauge), ``set`` (gauge),
    ``observe`` (histogram), ``value`` (counter, gauge)."""

    def __init__(
        self, family: MetricFamily, labels: dict[str, str], buckets: list[float] | None
    ) -> None:
        try:
            self._slot = _metrics.metric(family._name, labels, buckets)
        except custom_metrics.MetricError as exc:
            raise TritonModelException(str(exc)) from None
        self._family = family
        self._buckets = [float(b) for b in buckets] if buckets else []

    def _refuse(self, what: str) -> TritonModelException:
        kind = custom_metrics.KINDS[self._family._kind]
        return TritonModelException(f"metric '{self._family._name}' is a {kind}: {what}")

    def increment(self, value: float) -> None:
        kind = self._family._kind
        if kind == MetricFamily.HISTOGRAM:
            raise self._refuse("increment() is for counters and gauges; use observe()")
        if kind == MetricFamily.COUNTER and value < 0:
            raise self._refuse(f"a counter cannot decrease (increment({value!r}))")
        _metrics.add(self._slot, float(value))

    def set(self, value: float) -> None:
        if self._family._kind != MetricFamily.GAUGE:
            raise self._refuse("set() is for gauges")
        _metrics.set(self._slot, float(value))

    def observe(self, value: float) -> None:
        if self._family._kind != MetricFamily.HISTOGRAM:
            raise self._refuse("observe() is for histograms")
        _metrics.observe(self._slot, self._buckets, float(value))

    def value(self) -> float:
        if self._family._kind == MetricFamily.HISTOGRAM:
            raise self._refuse("value() is for counters and gauges")
        return float(_metrics.get(self._slot))
