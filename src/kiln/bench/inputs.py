"""Request tensors from a model's metadata: shapes resolved, data random, zero or from a file.

Tensors are numpy arrays; BYTES are object arrays of ``bytes`` and BF16 (which numpy lacks)
is carried as its raw ``uint16`` bit pattern, so that serialising is a plain ``tobytes``.
"""

from __future__ import annotations

import base64
import json
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.bench.options import BenchError

DTYPES: dict[str, type[Any]] = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "UINT16": np.uint16,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
    "BF16": np.uint16,  # raw bits
    "BYTES": np.object_,
}
_LETTERS = np.frombuffer((string.ascii_letters + string.digits).encode(), dtype=np.uint8)


@dataclass(slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: list[int]  # as the metadata says: -1 for variable dims (batch dim included)


@dataclass(slots=True)
class ModelSpec:
    """A model's signature as served: metadata plus ``max_batch_size`` from its config."""

    name: str
    version: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec] = field(default_factory=list)
    max_batch_size: int = 0
    sequence: bool = False  # its config has sequence_batching: requests need sequence ids
    decoupled: bool = False  # 0..N responses per request: only a gRPC stream carries them


def request_shapes(
    spec: ModelSpec, batch_size: int, overrides: dict[str, list[int]]
) -> dict[str, list[int]]:
    """Full request shape per input: batch dim first when the model batches, -1s resolved."""
    if spec.max_batch_size == 0 and batch_size > 1:
        raise BenchError(
            f"model '{spec.name}' does not support batching (max_batch_size 0); "
            f"--batch-size {batch_size} needs a batching model"
        )
    if spec.max_batch_size and batch_size > spec.max_batch_size:
        raise BenchError(
            f"--batch-size {batch_size} exceeds model '{spec.name}' max_batch_size "
            f"{spec.max_batch_size}"
        )
    known = {t.name for t in spec.inputs}
    for name in overrides:
        if name not in known:
            raise BenchError(
                f"--shape names '{name}', which is not an input of model '{spec.name}' "
                f"(inputs: {', '.join(sorted(known))})"
            )
    shapes: dict[str, list[int]] = {}
    for t in spec.inputs:
        dims = t.shape[1:] if spec.max_batch_size else list(t.shape)
        if t.name in overrides:
            given = overrides[t.name]
            if len(given) != len(dims) or any(
                d != -1 and d != g for d, g in zip(dims, given, strict=True)
            ):
                raise BenchError(
                    f"--shape {t.name}:{','.join(map(str, given))} does not fit the model's "
                    f"dims {dims} (batch dim excluded)"
                )
            dims = list(given)
        if any(d < 0 for d in dims):
            raise BenchError(
                f"input '{t.name}' of model '{spec.name}' has variable dims {dims}: give them "
                f"with --shape {t.name}:" + ",".join("N" if d < 0 else str(d) for d in dims)
            )
        shapes[t.name] = [batch_size, *dims] if spec.max_batch_size else dims
    return shapes


def random_tensor(datatype: str, shape: list[int], rng: np.random.Generator) -> np.ndarray:
    """Random values valid for ``datatype``; small magnitudes so no model overflows on them."""
    if datatype not in DTYPES:
        raise BenchError(f"datatype '{datatype}' is not a KServe v2 datatype")
    if datatype == "BYTES":
        lengths = rng.integers(1, 17, size=shape if shape else ())
        flat = [
            _LETTERS[rng.integers(0, len(_LETTERS), int(n))].tobytes() for n in np.ravel(lengths)
        ]
        return np.array(flat, dtype=np.object_).reshape(shape)
    if datatype == "BOOL":
        return rng.integers(0, 2, size=shape).astype(np.bool_)
    if datatype in ("FP16", "FP32", "FP64"):
        return rng.standard_normal(size=shape).astype(DTYPES[datatype])
    if datatype == "BF16":
        bits = rng.standard_normal(size=shape).astype(np.float32).view(np.uint32)
        return (bits >> 16).astype(np.uint16)
    return rng.integers(0, 100, size=shape).astype(DTYPES[datatype])


def zero_tensor(datatype: str, shape: list[int]) -> np.ndarray:
    if datatype not in DTYPES:
        raise BenchError(f"datatype '{datatype}' is not a KServe v2 datatype")
    if datatype == "BYTES":
        # Triton's perf_analyzer sends the string "0" for zero BYTES data; so do we.
        return np.full(shape, b"0", dtype=np.object_)
    return np.zeros(shape, dtype=DTYPES[datatype])


def generate(
    spec: ModelSpec, shapes: dict[str, list[int]], kind: str, seed: int = 0
) -> list[dict[str, np.ndarray]]:
    """One data set (a list of one entry) of random or zero tensors."""
    rng = np.random.default_rng(seed)
    entry = {
        t.name: random_tensor(t.datatype, shapes[t.name], rng)
        if kind == "random"
        else zero_tensor(t.datatype, shapes[t.name])
        for t in spec.inputs
    }
    return [entry]


def load_file(
    path: Path, spec: ModelSpec, shapes: dict[str, list[int]]
) -> list[dict[str, np.ndarray]]:
    """User data: perf_analyzer's JSON layout (``{"data": [{NAME: ...}, ...]}``) or an .npz."""
    if not path.is_file():
        raise BenchError(f"--input-data: '{path}' is not a file (or 'random' / 'zero')")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            raw = [{name: npz[name] for name in npz.files}]
    elif path.suffix == ".json":
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise BenchError(f"--input-data {path}: not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not doc["data"]:
            raise BenchError(f'--input-data {path}: expected {{"data": [{{NAME: ...}}, ...]}}')
        raw = doc["data"]
    else:
        raise BenchError(f"--input-data {path}: expected a .json or .npz file")
    entries = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise BenchError(f"--input-data {path}: data[{i}] must be an object of inputs")
        entries.append({t.name: _from_user(path, i, t, shapes[t.name], item) for t in spec.inputs})
    return entries


def _from_user(
    path: Path, index: int, t: TensorSpec, shape: list[int], item: dict[str, Any]
) -> np.ndarray:
    where = f"--input-data {path}: data[{index}] input '{t.name}'"
    if t.name not in item:
        raise BenchError(f"{where} is missing")
    value = item[t.name]
    if isinstance(value, np.ndarray):  # .npz: the array is sent as it is, shape included
        if t.datatype == "BYTES":
            return np.array([_bytes(v) for v in value.ravel()], np.object_).reshape(value.shape)
        return value.astype(DTYPES[t.datatype])
    if isinstance(value, dict) and "b64" in value:
        raw = base64.b64decode(value["b64"])
        if t.datatype == "BYTES":
            return np.array([raw], dtype=np.object_).reshape([1] * len(shape))
        return np.frombuffer(raw, dtype=DTYPES[t.datatype]).reshape(shape)
    if isinstance(value, dict):
        content, target = value.get("content"), value.get("shape")
    else:
        content, target = value, None
    try:
        if t.datatype == "BYTES":
            arr = np.array([_bytes(v) for v in np.ravel(np.array(content, dtype=object))], object)
        else:
            arr = np.asarray(content, dtype=DTYPES[t.datatype]).ravel()
    except (TypeError, ValueError) as exc:
        raise BenchError(f"{where}: {exc}") from None
    full = list(shape)
    if target is not None:  # perf_analyzer: "shape" is the per-sample shape, batch excluded
        full = [shape[0], *target] if len(shape) == len(target) + 1 else list(target)
    size = int(np.prod(full))
    per_sample = int(np.prod(full[1:])) if len(full) > 1 else size
    if arr.size == per_sample and size != per_sample:
        arr = np.tile(arr, size // max(per_sample, 1))  # one sample repeated over the batch
    if arr.size != size:
        raise BenchError(f"{where} has {arr.size} values, shape {full} needs {size}")
    return arr.reshape(full)


def _bytes(v: Any) -> bytes:
    return v if isinstance(v, bytes) else str(v).encode()
