"""Build one sequence batch's model inputs and split its outputs back per sequence.

A row is one batch slot: a request of some sequence, or (strategy ``direct``) an empty
slot, which still needs data in every tensor because the batch is one array per input.
Besides the client's inputs, each row gets its control values (START / END / READY /
CORRID) and its sequence's implicit state; after the run, each request keeps its rows of
the outputs it asked for and the state outputs become that sequence's next state.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.config.model_config_pb2 import ModelSequenceBatching
from kiln.config.sequence_config import ControlSpec, CorrId, StateSpec, corrid_value
from kiln.core.errors import KilnError, Status
from kiln.core.stats import RequestTimes
from kiln.core.types import DataType
from kiln.scheduling.base import Job

Kind = ModelSequenceBatching.Control
# Triton's request flags, as a Python model reads them from ``InferenceRequest.flags()``.
FLAG_SEQUENCE_START = 1
FLAG_SEQUENCE_END = 2


@dataclass(slots=True)
class Row:
    """One batch slot. ``job`` None is an empty slot (READY false, dummy data)."""

    job: Job | None
    corrid: CorrId = 0
    start: bool = False
    end: bool = False
    states: dict[str, np.ndarray] | None = None  # state input name -> value (no batch dim)


@dataclass(slots=True)
class RowResult:
    outputs: dict[str, np.ndarray]  # what the request asked for, its rows only
    states: dict[str, np.ndarray]  # state input name -> next value (no batch dim)


class RowRequest:
    """One row as a backend that takes requests unmerged (the Python backend) sees it:
    the request's inputs with its own control values and state, the outputs it asked for
    and the state outputs, its sequence's id and START / END flags (Triton's
    ``correlation_id()`` and ``flags()``); the rest (parameters, stream, cancellation, the
    response's parameters) is its job's."""

    def __init__(self, row: Row, inputs: dict[str, np.ndarray], states: list[StateSpec]) -> None:
        assert row.job is not None
        self.job = row.job
        self.correlation_id = row.corrid
        self.flags = (FLAG_SEQUENCE_START if row.start else 0) | (
            FLAG_SEQUENCE_END if row.end else 0
        )
        self.inputs = inputs
        wanted = [*row.job.output_names, *(s.output_name for s in states)]
        self.output_names = list(dict.fromkeys(wanted))
        self.parameters = row.job.parameters
        self.request_id = row.job.request_id
        self.sink = row.job.sink
        self.deadline_ns = 0

    @property
    def times(self) -> RequestTimes:
        return self.job.times

    @property
    def response_parameters(self) -> dict[str, Any] | None:
        return self.job.response_parameters

    @response_parameters.setter
    def response_parameters(self, value: dict[str, Any] | None) -> None:
        self.job.response_parameters = value

    def add_cancel_callback(self, callback: Callable[[], None]) -> None:
        self.job.add_cancel_callback(callback)


def batch_inputs(
    rows: list[Row],
    controls: list[ControlSpec],
    states: list[StateSpec],
    batching: bool,
    model: str,
) -> dict[str, np.ndarray]:
    """Every input tensor of the batch: the clients' data, controls and states."""
    template = next(row.job for row in rows if row.job is not None)
    inputs: dict[str, np.ndarray] = {}
    for name, sample in template.inputs.items():
        parts = [row.job.inputs[name] if row.job is not None else _dummy(sample) for row in rows]
        inputs[name] = np.concatenate(parts, axis=0) if batching else parts[0]
    for spec in controls:
        values = [_control_value(spec, row, model) for row in rows]
        dtype = spec.datatype.numpy_dtype
        array = np.array(values, dtype=dtype)
        inputs[spec.name] = array.reshape(-1, 1) if batching else array.reshape(1)
    for state in states:
        values = [_state_of(row, state) for row in rows]
        inputs[state.input_name] = np.stack(values) if batching else values[0]
    return inputs


def _dummy(sample: np.ndarray) -> np.ndarray:
    # An empty slot repeats the shape of a real request of the batch: zeros, or b"".
    if sample.dtype == object:
        return np.full(sample.shape, b"", dtype=object)
    return np.zeros_like(sample)


def _control_value(spec: ControlSpec, row: Row, model: str) -> Any:
    ready = row.job is not None
    if spec.kind == Kind.CONTROL_SEQUENCE_CORRID:
        if not ready:
            return b"" if spec.datatype is DataType.BYTES else 0
        return corrid_value(spec, row.corrid, model)
    if spec.kind == Kind.CONTROL_SEQUENCE_START:
        return spec.value(ready and row.start)
    if spec.kind == Kind.CONTROL_SEQUENCE_END:
        return spec.value(ready and row.end)
    return spec.value(ready)  # CONTROL_SEQUENCE_READY


def _state_of(row: Row, state: StateSpec) -> np.ndarray:
    if row.job is None or row.start or row.states is None:
        return state.initial
    return row.states.get(state.input_name, state.initial)


def split_rows(
    outputs: dict[str, np.ndarray],
    rows: list[Row],
    states: list[StateSpec],
    batching: bool,
    model: str,
) -> list[RowResult | None]:
    """Each real row's outputs and next states; None for empty slots."""
    count = len(rows)
    needed = {name for row in rows if row.job for name in row.job.output_names}
    needed |= {state.output_name for state in states}
    for name in needed:
        value = outputs.get(name)
        if value is None:
            raise KilnError(f"model '{model}' did not produce output '{name}'", Status.INTERNAL)
        if batching and (value.ndim == 0 or value.shape[0] != count):
            got = "a scalar" if value.ndim == 0 else f"batch dimension {value.shape[0]}"
            raise KilnError(
                f"model '{model}' returned output '{name}' with {got}, but the sequence "
                f"batch it was given holds {count} slot(s)",
                Status.INTERNAL,
            )
    results: list[RowResult | None] = []
    for i, row in enumerate(rows):
        if row.job is None:
            results.append(None)
            continue
        mine = {
            name: (outputs[name][i : i + 1] if batching else outputs[name])
            for name in row.job.output_names
        }
        # Copies: the next step must not keep the whole batch's output buffer alive.
        nxt = {
            state.input_name: np.array(
                outputs[state.output_name][i] if batching else outputs[state.output_name]
            )
            for state in states
        }
        results.append(RowResult(mine, nxt))
    return results
