"""Model warm-up (``model_warmup [...]``): run sample requests through every instance
during load, so the first real request does not pay for lazy allocation or kernel tuning.

A model becomes READY only after every sample has run ``count`` times on every instance;
a sample that cannot be built or fails to run fails the load, naming the sample.

A sample goes to the instance directly, not through the scheduler, so a sequence model's
control and state inputs (which the sequence batcher adds to real requests) come with the
sample: as it gives them (Triton's way), or else each row is a whole sequence of one
request (START, END and READY true, CORRID 0) from the initial state.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig, ModelWarmup
from kiln.config.sequence_config import (
    Control,
    corrid_value,
    parse_controls,
    parse_states,
)
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, element_count
from kiln.scheduling.base import Instance

# Checks a sample's raw outputs the way a real request's are checked (see ModelRuntime).
OutputCheck = Callable[[dict[str, np.ndarray], list[str], int], object]
# A sequence model's control and state inputs: name -> (data type, one row's default).
SequenceInputs = dict[str, tuple[DataType, np.ndarray]]


class WarmupError(KilnError):
    """A warm-up sample that is malformed or whose execution failed."""

    def __init__(self, sample: str, reason: str) -> None:
        super().__init__(f"warm-up '{sample}' failed: {reason}", Status.INVALID_ARG)


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """One ``model_warmup`` entry turned into model-ready inputs."""

    name: str
    batch_size: int
    count: int
    inputs: dict[str, np.ndarray]


def build_samples(
    config: ModelConfig, signature: ModelSignature, model_dir: Path
) -> list[WarmupSample]:
    """Every ``model_warmup`` entry as arrays, checked against the model's inputs."""
    samples = []
    sequence = _sequence_inputs(config, model_dir) if config.model_warmup else {}
    for index, warmup in enumerate(config.model_warmup):
        name = warmup.name or f"warmup_{index}"
        samples.append(_build(warmup, name, signature, model_dir, sequence))
    return samples


def _sequence_inputs(config: ModelConfig, model_dir: Path) -> SequenceInputs:
    """The sequence batcher's inputs (``sequence_batching`` controls and states): name ->
    (data type, one row's value when a sample does not give it)."""
    if not config.HasField("sequence_batching"):
        return {}
    inputs: SequenceInputs = {}
    for spec in parse_controls(config):
        if spec.kind == Control.CONTROL_SEQUENCE_CORRID:
            value = corrid_value(spec, 0, config.name)
        else:
            value = spec.value(True)  # START, END and READY: one whole sequence
        inputs[spec.name] = (spec.datatype, np.array([value], dtype=spec.datatype.numpy_dtype))
    for state in parse_states(config, model_dir):
        inputs[state.input_name] = (state.datatype, state.initial)
    return inputs


async def run_warmup(
    samples: list[WarmupSample],
    instances: list[Instance],
    signature: ModelSignature,
    check: OutputCheck,
) -> None:
    """Run each sample ``count`` times on every instance (instances side by side)."""
    names = signature.output_names

    async def on(instance: Instance) -> None:
        for sample in samples:
            for _ in range(sample.count):
                try:
                    raw, _, _ = await instance.run(sample.inputs, names)
                    check(raw, names, sample.batch_size)
                except Exception as exc:
                    reason = exc.message if isinstance(exc, KilnError) else f"{exc!r}"
                    spec = instance.backend.instance
                    raise WarmupError(
                        sample.name, f"instance {spec.name} #{spec.index}: {reason}"
                    ) from exc

    await asyncio.gather(*(on(instance) for instance in instances))


def _build(
    warmup: ModelWarmup,
    name: str,
    signature: ModelSignature,
    model_dir: Path,
    sequence: SequenceInputs,
) -> WarmupSample:
    batching = signature.max_batch_size > 0
    batch = warmup.batch_size or 1  # unset (0) means one request, like count
    if not batching and batch != 1:
        raise WarmupError(
            name, f"batch_size is {batch}, but model '{signature.name}' does not batch (use 1)"
        )
    if batching and batch > signature.max_batch_size:
        raise WarmupError(
            name, f"batch_size {batch} exceeds max_batch_size {signature.max_batch_size}"
        )
    for input_name in warmup.inputs:
        if input_name not in signature.inputs and input_name not in sequence:
            raise WarmupError(name, f"unexpected input '{input_name}' for model '{signature.name}'")
    arrays: dict[str, np.ndarray] = {}
    for spec in signature.inputs.values():
        if spec.name not in warmup.inputs:
            if spec.optional:
                continue
            raise WarmupError(name, f"no data for input '{spec.name}'")
        entry = warmup.inputs[spec.name]
        datatype = _datatype(entry.data_type)
        if datatype is not spec.datatype:
            raise WarmupError(
                name,
                f"input '{spec.name}' is {datatype.config_name if datatype else 'TYPE_INVALID'}"
                f", but the model expects {spec.datatype.config_name}",
            )
        dims = tuple(entry.dims)
        if len(dims) != len(spec.dims) or any(
            d < 0 or (c != -1 and c != d) for d, c in zip(dims, spec.dims, strict=False)
        ):
            raise WarmupError(
                name,
                f"input '{spec.name}' has dims {list(dims)}, but the model expects "
                f"{list(spec.dims)} (warm-up dims are exact, without the batch dimension)",
            )
        one = _data(entry, name, spec.name, datatype, dims, model_dir)
        data = np.stack([one] * batch) if batching else one
        if spec.reshape is not None:
            data = data.reshape(((batch,) if batching else ()) + spec.reshape)
        arrays[spec.name] = data
    for input_name, (datatype, default) in sequence.items():
        one = default
        if input_name in warmup.inputs:
            entry = warmup.inputs[input_name]
            given = _datatype(entry.data_type)
            if given is not datatype:
                raise WarmupError(
                    name,
                    f"sequence input '{input_name}' is "
                    f"{given.config_name if given else 'TYPE_INVALID'}, but the model's "
                    f"sequence_batching makes it {datatype.config_name}",
                )
            one = _data(entry, name, input_name, datatype, tuple(entry.dims), model_dir)
        arrays[input_name] = np.stack([one] * batch) if batching else one
    return WarmupSample(name, batch, max(warmup.count, 1), arrays)


def _datatype(value: int) -> DataType | None:
    if value == PbDataType.TYPE_INVALID:
        return None
    return DataType.from_config(PbDataType.Name(value))


def _data(
    entry: ModelWarmup.Input,
    sample: str,
    input_name: str,
    datatype: DataType,
    dims: tuple[int, ...],
    model_dir: Path,
) -> np.ndarray:
    """One batch element of an input, as kiln holds it in memory."""
    kind = entry.WhichOneof("input_data_type")
    count = element_count(dims)
    if kind == "input_data_file":
        raw = _read_file(entry.input_data_file, sample, input_name, model_dir)
        return _from_file(raw, sample, input_name, datatype, count).reshape(dims)
    if datatype is DataType.BYTES:
        # As in Triton, strings get zero data (empty elements) even for random_data.
        return np.full(dims, b"", dtype=object)
    if kind == "random_data":
        rng = np.random.default_rng()
        dtype = datatype.numpy_dtype
        if dtype.kind == "f":
            return rng.standard_normal(dims).astype(dtype)
        if dtype.kind == "b":
            return rng.integers(0, 2, dims).astype(np.bool_)
        # Small values: valid for both signed and unsigned types, safe as indices.
        return rng.integers(0, 100, dims).astype(dtype)
    if kind == "zero_data":
        return np.zeros(dims, dtype=datatype.numpy_dtype)
    raise WarmupError(
        sample, f"input '{input_name}' sets none of zero_data, random_data, input_data_file"
    )


def _read_file(filename: str, sample: str, input_name: str, model_dir: Path) -> bytes:
    # Triton reads warm-up files from the model's warmup/ folder and nowhere else.
    folder = (model_dir / "warmup").resolve()
    path = (folder / filename).resolve()
    if not path.is_relative_to(folder):
        raise WarmupError(
            sample, f"input '{input_name}': input_data_file '{filename}' is outside warmup/"
        )
    try:
        return path.read_bytes()
    except OSError as exc:
        raise WarmupError(
            sample,
            f"input '{input_name}': cannot read input_data_file 'warmup/{filename}': "
            f"{exc.strerror or exc}",
        ) from None


def _from_file(
    raw: bytes, sample: str, input_name: str, datatype: DataType, count: int
) -> np.ndarray:
    where = f"input '{input_name}': input_data_file"
    if datatype is DataType.BYTES:
        # Each element: a 4-byte little-endian length, then that many bytes.
        items: list[bytes] = []
        pos = 0
        while len(items) < count:
            if pos + 4 > len(raw):
                raise WarmupError(sample, f"{where} holds {len(items)} of {count} elements")
            length = int.from_bytes(raw[pos : pos + 4], "little")
            if pos + 4 + length > len(raw):
                raise WarmupError(sample, f"{where}: element {len(items)} runs past the end")
            items.append(raw[pos + 4 : pos + 4 + length])
            pos += 4 + length
        if pos != len(raw):
            raise WarmupError(sample, f"{where} has {len(raw) - pos} bytes after {count} elements")
        out = np.empty(count, dtype=object)
        out[:] = items
        return out
    expected = count * datatype.itemsize
    if len(raw) != expected:
        raise WarmupError(
            sample,
            f"{where} has {len(raw)} bytes, but {count} {datatype.value} elements need {expected}",
        )
    if datatype is DataType.BF16:
        return (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
    return np.frombuffer(raw, datatype.numpy_dtype.newbyteorder("<")).astype(datatype.numpy_dtype)
