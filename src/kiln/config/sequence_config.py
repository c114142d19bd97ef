"""What ``sequence_batching {}`` asks of the scheduler, parsed once at load time.

Control inputs (START / END / READY / CORRID) and implicit state are tensors the scheduler
creates, never the client: this module turns the config into specs that build them, and a
request's ``sequence_id`` / ``sequence_start`` / ``sequence_end`` parameters into flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig, ModelSequenceBatching
from kiln.core.errors import KilnError, Status, invalid_arg
from kiln.core.types import DataType

CorrId = int | str
Control = ModelSequenceBatching.Control

# Triton's default when max_sequence_idle_microseconds is 0 (unset).
DEFAULT_IDLE_US = 1_000_000
_UINT64_MAX = 2**64 - 1
#: characters of a string correlation id (a UUID is 36)
MAX_STRING_ID = 256


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    """One request's sequence parameters, checked."""

    corrid: CorrId
    start: bool
    end: bool


@dataclass(frozen=True, slots=True)
class ControlSpec:
    """One control input tensor: which signal it carries and how it is spelled."""

    name: str
    kind: int  # Control.Kind
    datatype: DataType
    false_value: Any = None
    true_value: Any = None

    def value(self, flag: bool) -> Any:
        return self.true_value if flag else self.false_value


@dataclass(frozen=True, slots=True)
class StateSpec:
    """One implicit state: the model's ``output_name`` of a step is its next ``input_name``."""

    input_name: str
    output_name: str
    datatype: DataType
    initial: np.ndarray  # one sequence's state before its first step (no batch dim)


def scheduler_inputs(config: ModelConfig) -> set[str]:
    """Input names the sequence batcher supplies, so the client must not (and need not)."""
    if not config.HasField("sequence_batching"):
        return set()
    sb = config.sequence_batching
    return {c.name for c in sb.control_input} | {s.input_name for s in sb.state}


def state_outputs(config: ModelConfig) -> set[str]:
    """Output names that carry implicit state: kept by kiln, not part of the response."""
    if not config.HasField("sequence_batching"):
        return set()
    return {s.output_name for s in config.sequence_batching.state}


def parse_controls(config: ModelConfig) -> list[ControlSpec]:
    specs: list[ControlSpec] = []
    for control_input in config.sequence_batching.control_input:
        for control in control_input.control:
            specs.append(_control_spec(config.name, control_input.name, control))
    return specs


def _control_spec(model: str, name: str, control: Any) -> ControlSpec:
    if control.kind == Control.CONTROL_SEQUENCE_CORRID:
        if control.data_type not in _CORRID_TYPES:
            allowed = ", ".join(PbDataType.Name(t) for t in _CORRID_TYPES)
            raise KilnError(
                f"model '{model}': CONTROL_SEQUENCE_CORRID input '{name}' must set data_type "
                f"to one of {allowed}, got {PbDataType.Name(control.data_type)}",
                Status.INVALID_ARG,
            )
        datatype = DataType.from_config(PbDataType.Name(control.data_type))
        return ControlSpec(name, control.kind, datatype)
    choices = [
        (DataType.INT32, list(control.int32_false_true)),
        (DataType.FP32, list(control.fp32_false_true)),
        (DataType.BOOL, list(control.bool_false_true)),
    ]
    given = [(datatype, values) for datatype, values in choices if values]
    if len(given) != 1 or len(given[0][1]) != 2:
        raise KilnError(
            f"model '{model}': control input '{name}' ({Control.Kind.Name(control.kind)}) "
            "must give exactly one of int32_false_true, fp32_false_true, bool_false_true, "
            "with two entries (the false value, then the true value)",
            Status.INVALID_ARG,
        )
    datatype, (false_value, true_value) = given[0]
    return ControlSpec(name, control.kind, datatype, false_value, true_value)


_CORRID_TYPES = (
    PbDataType.TYPE_UINT64,
    PbDataType.TYPE_INT64,
    PbDataType.TYPE_UINT32,
    PbDataType.TYPE_INT32,
    PbDataType.TYPE_STRING,
)


def parse_states(config: ModelConfig, model_dir: Path) -> list[StateSpec]:
    specs: list[StateSpec] = []
    for state in config.sequence_batching.state:
        datatype = DataType.from_config(PbDataType.Name(state.data_type))
        specs.append(
            StateSpec(
                state.input_name,
                state.output_name,
                datatype,
                _initial_state(config.name, state, datatype, model_dir),
            )
        )
    return specs


def _initial_state(model: str, state: Any, datatype: DataType, model_dir: Path) -> np.ndarray:
    where = f"model '{model}': state '{state.input_name}'"
    init = state.initial_state[0] if state.initial_state else None
    dims = tuple(init.dims) if init is not None and init.dims else tuple(state.dims)
    if any(d < 0 for d in dims):
        raise KilnError(
            f"{where} has variable dims {list(dims)}: give initial_state dims to size it",
            Status.INVALID_ARG,
        )
    dtype = datatype.numpy_dtype
    if init is None or init.WhichOneof("state_data") != "data_file":
        # No initial_state, or zero_data: a sequence starts from zeros (empty strings).
        if datatype is DataType.BYTES:
            return np.full(dims, b"", dtype=object)
        return np.zeros(dims, dtype=dtype)
    path = model_dir / "initial_state" / init.data_file
    if datatype is DataType.BYTES:
        raise KilnError(f"{where}: initial_state data_file is not supported for TYPE_STRING")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise KilnError(f"{where}: cannot read initial_state data_file: {exc}") from exc
    count = int(np.prod(dims, dtype=np.int64))
    if len(raw) != count * dtype.itemsize:
        raise KilnError(
            f"{where}: initial_state data_file '{path}' holds {len(raw)} bytes, but dims "
            f"{list(dims)} of {datatype.config_name} need {count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(dims).copy()


def idle_limit_ns(config: ModelConfig) -> int:
    us = config.sequence_batching.max_sequence_idle_microseconds or DEFAULT_IDLE_US
    return int(us) * 1000


def parse_flags(parameters: dict[str, Any], model: str, iterative: bool = False) -> SequenceFlags:
    """The request's sequence parameters; a missing or zero id is refused (Triton's text),
    except with ``iterative_sequence``, where it asks for a sequence of its own: id 0, START
    and not END (the scheduler names the sequence)."""
    corrid = parameters.get("sequence_id", 0)
    if isinstance(corrid, bool) or not isinstance(corrid, int | str):
        raise invalid_arg(
            f"request parameter 'sequence_id' for model '{model}' must be an unsigned "
            f"integer or a string, got {corrid!r}"
        )
    if isinstance(corrid, str) and len(corrid) > MAX_STRING_ID:
        # the scheduler keeps thousands of ended ids (``GoneIds``): a long one is memory
        # the client chose, held for the server's life
        raise invalid_arg(
            f"request parameter 'sequence_id' for model '{model}' is a string of "
            f"{len(corrid)} characters, more than {MAX_STRING_ID}"
        )
    if isinstance(corrid, int) and not 0 <= corrid <= _UINT64_MAX:
        raise invalid_arg(
            f"request parameter 'sequence_id' for model '{model}' must fit in uint64, got {corrid}"
        )
    if (corrid == 0 or corrid == "") and iterative:
        return SequenceFlags(0, True, False)
    if corrid == 0 or corrid == "":
        raise invalid_arg(
            f"inference request to model '{model}' must specify a non-zero or non-empty "
            "correlation ID (request parameter 'sequence_id'): the model uses sequence "
            "batching"
        )
    return SequenceFlags(
        corrid,
        _flag(parameters, "sequence_start", model),
        _flag(parameters, "sequence_end", model),
    )


def _flag(parameters: dict[str, Any], name: str, model: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise invalid_arg(
            f"request parameter '{name}' for model '{model}' must be a boolean, got {value!r}"
        )
    return value


def corrid_value(spec: ControlSpec, corrid: CorrId, model: str) -> Any:
    """The sequence id as the CORRID control's data type."""
    if spec.datatype is DataType.BYTES:
        return str(corrid).encode("utf-8")
    if isinstance(corrid, str):
        raise invalid_arg(
            f"sequence '{corrid}' to model '{model}' has a string id, but the model's "
            f"CONTROL_SEQUENCE_CORRID input '{spec.name}' is {spec.datatype.config_name}"
        )
    info = np.iinfo(spec.datatype.numpy_dtype)
    if not info.min <= corrid <= info.max:
        raise invalid_arg(
            f"sequence {corrid} to model '{model}' does not fit the model's "
            f"CONTROL_SEQUENCE_CORRID input '{spec.name}' ({spec.datatype.config_name})"
        )
    return corrid
