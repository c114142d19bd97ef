"""kiln's ``triton_python_backend_utils``: the API a Triton Python model is written against.

The worker registers this module under the name ``triton_python_backend_utils``, so an
unchanged ``import triton_python_backend_utils as pb_utils`` finds it. Tensors are plain
NumPy arrays here (kiln's Python backend runs on the CPU); requests sent to other models
(BLS) and responses of decoupled models go through the worker's channel to the server.
"""

from __future__ import annotations

import asyncio
import enum
import json
import sys
from typing import Any

import numpy as np

from kiln.backends.python import custom_metrics, dlpack
from kiln.backends.python.arena import serialize_bytes
from kiln.backends.python.autocomplete import ModelConfig

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

_NUMPY_TYPES: dict[str, Any] = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
    "TYPE_BF16": np.float32,  # held as float32, as everywhere in kiln
}
TRITON_STRING_TO_NUMPY = _NUMPY_TYPES  # Triton's name for it; models read it directly

# TRITONSERVER_DataType's numbers (Tensor.triton_dtype(), triton_to_numpy_type), BOOL..BYTES
_TRITON_NUMBERS: dict[int, Any] = {
    1: np.bool_,
    2: np.uint8,
    3: np.uint16,
    4: np.uint32,
    5: np.uint64,
    6: np.int8,
    7: np.int16,
    8: np.int32,
    9: np.int64,
    10: np.float16,
    11: np.float32,
    12: np.float64,
    13: np.object_,
}
_NUMBERS_OF: dict[Any, int] = {np.dtype(t): n for n, t in _TRITON_NUMBERS.items()}
TYPE_BYTES = 13


def install() -> None:
    """Make ``import triton_python_backend_utils`` resolve to this module."""
    sys.modules.setdefault("triton_python_backend_utils", sys.modules[__name__])


def _json(parameters: dict[str, Any] | str | None) -> str:
    return parameters if isinstance(parameters, str) else json.dumps(parameters or {})


_PARAMETER_TYPES = (bool, int, float, str)


def _response_parameters(parameters: dict[str, Any] | str | None) -> str:
    """A response's parameters as JSON, checked as Triton checks them: an object whose
    values are bool, int, float or str (they reach the client as the response's
    ``parameters``)."""
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters or "{}")
        except json.JSONDecodeError as exc:
            raise TritonModelException(
                f"InferenceResponse parameters: not valid JSON ({exc})"
            ) from None
    if parameters is None:
        return "{}"
    if not isinstance(parameters, dict):
        raise TritonModelException(
            f"InferenceResponse parameters must be a dict, got {type(parameters).__name__}"
        )
    for key, value in parameters.items():
        if not isinstance(key, str):
            raise TritonModelException(f"InferenceResponse parameters: key {key!r} must be a str")
        if not isinstance(value, _PARAMETER_TYPES):
            raise TritonModelException(
                f"InferenceResponse parameter '{key}' must be a bool, int, float or str, "
                f"got {type(value).__name__}"
            )
    return json.dumps(parameters)


class TritonError:
    """An error a response carries; ``code`` picks the status the client sees."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE = 0, 1, 2, 3, 4
    UNSUPPORTED, ALREADY_EXISTS, CANCELLED = 5, 6, 7

    def __init__(self, message: str, code: int = 1) -> None:
        self._message = str(message)
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code

    def __repr__(self) -> str:
        return f"TritonError({self._message!r})"


class TritonModelException(Exception):
    pass


class Tensor:
    def __init__(self, name: str, array: Any) -> None:
        if not isinstance(array, np.ndarray):
            raise TritonModelException(
                f"Tensor '{name}': expected a numpy array, got {type(array).__name__}"
            )
        self._name = name
        self._array = array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array

    def shape(self) -> list[int]:
        return list(self._array.shape)

    def triton_dtype(self) -> int | None:
        """The tensor's TRITONSERVER_DataType number (11 for FP32, 13 for BYTES)."""
        return numpy_to_triton_type(self._array.dtype)

    def is_cpu(self) -> bool:
        return True

    # ---- DLPack (dlpack.py): tensors to and from torch etc. without copies ----
    def to_dlpack(self) -> Any:
        """A DLPack capsule of the tensor's data, e.g. for
        ``torch.utils.dlpack.from_dlpack``: an input's capsule views the shared memory."""
        try:
            return dlpack.capsule_of(self._array)
        except dlpack.DLPackError as exc:
            raise TritonModelException(f"Tensor '{self._name}': to_dlpack: {exc}") from None

    @classmethod
    def from_dlpack(cls, name: str, capsule: Any) -> Tensor:
        """A tensor named ``name`` from a DLPack capsule or an object with ``__dlpack__``
        (a torch tensor, a NumPy array...): a view of host memory, a copy of GPU memory."""
        if not isinstance(name, str):
            raise TritonModelException(
                f"Tensor.from_dlpack takes the tensor's name first, got {type(name).__name__}"
            )
        try:
            return cls(name, dlpack.to_numpy(capsule))
        except dlpack.DLPackError as exc:
            raise TritonModelException(f"Tensor '{name}': from_dlpack: {exc}") from None

    def __dlpack__(self, **kwargs: Any) -> Any:
        """The DLPack protocol: ``torch.from_dlpack(tensor)`` takes a pb_utils.Tensor."""
        try:
            return dlpack.capsule_of(self._array, **kwargs)
        except dlpack.DLPackError as exc:
            raise BufferError(f"Tensor '{self._name}': {exc}") from None

    def __dlpack_device__(self) -> tuple[int, int]:
        return (dlpack.DL_CPU, 0)

    def __repr__(self) -> str:
        return f"Tensor({self._name!r}, shape={self._array.shape}, dtype={self._array.dtype})"


class InferenceResponse:
    def __init__(
        self,
        output_tensors: list[Tensor] | None = None,
        error: TritonError | None = None,
        parameters: dict[str, Any] | str | None = None,
    ) -> None:
        self._outputs = list(output_tensors or [])
        self._error = error
        self._parameters = _response_parameters(parameters)

    def output_tensors(self) -> list[Tensor]:
        return self._outputs

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return self._parameters


class InferenceResponseSender:
    """Sends a decoupled model's responses, 0..N per request, the last flagged FINAL."""

    def __init__(self, key: int, request: InferenceRequest | None = None) -> None:
        self._key = key  # the server's name for the request's stream
        self._request = request
        self.closed = False
        # Flow control (an ensemble's ``max_inflight_requests``): with a window, a send
        # waits while ``window`` non-final responses are sent and not granted (taken
        # downstream); ``worker.Channel`` reads the grants.
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


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _config_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, str):
        loaded: dict[str, Any] = json.loads(model_config)
        return loaded
    return dict(model_config)


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return next((t for t in _config_dict(model_config).get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return next(
        (t for t in _config_dict(model_config).get("output", []) if t["name"] == name), None
    )


def triton_string_to_numpy(triton_type: str) -> Any:
    try:
        return _NUMPY_TYPES[triton_type]
    except KeyError:
        raise TritonModelException(f"unknown data type '{triton_type}'") from None


def triton_to_numpy_type(data_type: int) -> Any:
    """The NumPy type of a TRITONSERVER_DataType number; None for one without (BF16)."""
    return _TRITON_NUMBERS.get(data_type)


def numpy_to_triton_type(data_type: Any) -> int | None:
    """The TRITONSERVER_DataType number of a NumPy dtype or type; None if it has none."""
    try:
        dtype = np.dtype(data_type)
    except TypeError:
        return None
    if dtype.kind in ("S", "U"):
        return TYPE_BYTES
    return _NUMBERS_OF.get(dtype)


def using_decoupled_model_transaction_policy(model_config: Any) -> bool:
    """Whether the config (``args["model_config"]``, as a dict or its JSON) is decoupled."""
    policy = _config_dict(model_config).get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))


def serialize_byte_tensor(array: np.ndarray) -> np.ndarray:
    """Triton's length-prefixed BYTES serialization, as a uint8 array."""
    return np.frombuffer(serialize_bytes(array), dtype=np.uint8)


def deserialize_bytes_tensor(encoded: bytes | np.ndarray) -> np.ndarray:
    raw = encoded.tobytes() if isinstance(encoded, np.ndarray) else bytes(encoded)
    items, pos = [], 0
    while pos < len(raw):
        length = int.from_bytes(raw[pos : pos + 4], "little")
        items.append(raw[pos + 4 : pos + 4 + length])
        pos += 4 + length
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


class _LogLevel(enum.IntEnum):
    INFO = 0
    WARNING = 1
    ERROR = 2
    VERBOSE = 3


class Logger:
    """``pb_utils.Logger.log_info(...)`` or ``Logger.log(message, Logger.WARNING)``: lines
    land in the server's log, each with its level."""

    LogLevel = _LogLevel
    INFO, WARNING, ERROR, VERBOSE = _LogLevel

    @classmethod
    def log(cls, message: str, level: int = _LogLevel.INFO) -> None:
        try:
            name = _LogLevel(level).name
        except ValueError:
            raise TritonModelException(
                f"Logger.log: unknown level {level!r} (Logger.INFO, WARNING, ERROR, VERBOSE)"
            ) from None
        # The worker's stderr is the server's: one line per message, as Triton logs them.
        print(f"{name}: {message}", file=sys.stderr, flush=True)

    @classmethod
    def log_info(cls, message: str) -> None:
        cls.log(message, _LogLevel.INFO)

    @classmethod
    def log_warn(cls, message: str) -> None:
        cls.log(message, _LogLevel.WARNING)

    @classmethod
    def log_error(cls, message: str) -> None:
        cls.log(message, _LogLevel.ERROR)

    @classmethod
    def log_verbose(cls, message: str) -> None:
        cls.log(message, _LogLevel.VERBOSE)


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
