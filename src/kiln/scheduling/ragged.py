"""Ragged batching: ``allow_ragged_batch`` inputs, ``batch_input`` and ``batch_output``.

Requests whose ragged inputs differ in shape still share a batch: the batcher compares the
other inputs' shapes only. A ragged input reaches the model as one 1-D tensor, every
request's elements one after the other, as Triton's ONNX Runtime, PyTorch and TensorRT
backends hand it over. The model learns where each request's part ends from the batch
inputs kiln builds for the batch (the client never sends them):

=======================================  ======================================================
``BATCH_ELEMENT_COUNT``                  [requests]: each request's element count of the source
``BATCH_ACCUMULATED_ELEMENT_COUNT``      [requests]: the running total, where each part ends
``..._WITH_ZERO``                        [requests + 1]: 0, then the running total
``BATCH_MAX_ELEMENT_COUNT_AS_SHAPE``     [max count]: its shape is the information (zeros)
``BATCH_ITEM_SHAPE``                     [items, rank]: each batch item's shape of the source
``BATCH_ITEM_SHAPE_FLATTEN``             [items * rank]: the same, flat
=======================================  ======================================================

(element counts include the request's batch dimension; an item is one row of a request's
batch). An output named by ``batch_output`` ``BATCH_SCATTER_WITH_INPUT_SHAPE`` goes back
to each request in the shape of its source input: the output's first dimension is split by
the requests' element counts of that input. Other outputs split along the batch dimension,
as always.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.config.model_config_pb2 import BatchInput, BatchOutput, ModelConfig
from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType
from kiln.scheduling.base import Job
from kiln.scheduling.batch import split_outputs
from kiln.scheduling.queue import ShapeKey, shape_key

Kind = BatchInput.Kind


@dataclass(frozen=True, slots=True)
class BatchInputSpec:
    kind: int  # BatchInput.Kind
    target: str
    dtype: np.dtype
    source: str


class RaggedBatching:
    """What a model's config asks of ragged batching; ``of`` is None when nothing."""

    def __init__(self, config: ModelConfig) -> None:
        self.model = config.name
        self.batching = config.max_batch_size > 0
        self.ragged = frozenset(i.name for i in config.input if i.allow_ragged_batch)
        self.batch_inputs = [
            BatchInputSpec(
                b.kind,
                target,
                DataType.from_config(PbDataType.Name(b.data_type)).numpy_dtype,
                b.source_input[0],
            )
            for b in config.batch_input
            for target in b.target_name
        ]
        self.scatter = {
            target: b.source_input[0]
            for b in config.batch_output
            if b.kind == BatchOutput.BATCH_SCATTER_WITH_INPUT_SHAPE
            for target in b.target_name
        }

    @classmethod
    def of(cls, config: ModelConfig) -> RaggedBatching | None:
        if (
            config.batch_input
            or config.batch_output
            or any(i.allow_ragged_batch for i in config.input)
        ):
            return cls(config)
        return None

    def key(self, inputs: dict[str, np.ndarray]) -> ShapeKey:
        """What must agree for requests to share a batch: ragged inputs' shapes need not."""
        return shape_key(inputs, self.batching, self.ragged)

    def merge(self, jobs: list[Job]) -> dict[str, np.ndarray]:
        """The batch's inputs: ragged ones flattened end to end, the others concatenated
        along the batch dimension, and every batch input."""
        merged: dict[str, np.ndarray] = {}
        for name in jobs[0].inputs:
            if name in self.ragged:
                parts = [job.inputs[name].reshape(-1) for job in jobs]
                merged[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
            elif len(jobs) == 1:
                merged[name] = jobs[0].inputs[name]
            else:
                merged[name] = np.concatenate([job.inputs[name] for job in jobs], axis=0)
        for spec in self.batch_inputs:
            merged[spec.target] = self._batch_input(spec, jobs)
        return merged

    def _batch_input(self, spec: BatchInputSpec, jobs: list[Job]) -> np.ndarray:
        sources = [job.inputs[spec.source] for job in jobs]
        counts = [int(a.size) for a in sources]
        if spec.kind == Kind.BATCH_ELEMENT_COUNT:
            values: list[int] | np.ndarray = counts
        elif spec.kind == Kind.BATCH_ACCUMULATED_ELEMENT_COUNT:
            values = np.cumsum(counts)
        elif spec.kind == Kind.BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO:
            values = np.concatenate([[0], np.cumsum(counts)])
        elif spec.kind == Kind.BATCH_MAX_ELEMENT_COUNT_AS_SHAPE:
            return np.zeros(max(counts), dtype=spec.dtype)
        else:  # BATCH_ITEM_SHAPE / _FLATTEN: one row per batch item
            shapes = [
                list(a.shape[1:]) if self.batching else list(a.shape)
                for a, job in zip(sources, jobs, strict=True)
                for _ in range(job.batch_size if self.batching else 1)
            ]
            items = np.array(shapes, dtype=spec.dtype).reshape(len(shapes), -1)
            return items.reshape(-1) if spec.kind == Kind.BATCH_ITEM_SHAPE_FLATTEN else items
        return np.asarray(values, dtype=spec.dtype)

    def split(self, outputs: dict[str, np.ndarray], jobs: list[Job]) -> list[dict[str, np.ndarray]]:
        """Each request's part of each output it asked for."""
        plain = {name: value for name, value in outputs.items() if name not in self.scatter}
        if len(jobs) == 1:
            parts = [{n: v for n, v in plain.items() if n in jobs[0].output_names}]
        else:
            parts = split_outputs(plain, jobs, self.model)
        wanted = {name for job in jobs for name in job.output_names}
        for name, source in self.scatter.items():
            if name not in wanted or name not in outputs:
                continue
            value = outputs[name]
            counts = [int(job.inputs[source].size) for job in jobs]
            rows = value.shape[0] if value.ndim else 0
            if rows != sum(counts):
                raise KilnError(
                    f"model '{self.model}' returned output '{name}' with {rows} rows, but its "
                    f"batch_output BATCH_SCATTER_WITH_INPUT_SHAPE needs {sum(counts)}: the "
                    f"element count of input '{source}' in the batch",
                    Status.INTERNAL,
                )
            offset = 0
            for part, job, count in zip(parts, jobs, counts, strict=True):
                if name in job.output_names:
                    shape = job.inputs[source].shape + value.shape[1:]
                    part[name] = value[offset : offset + count].reshape(shape)
                offset += count
        return parts
