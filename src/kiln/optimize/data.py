"""Calibration / validation data: ``.npy``, ``.npz`` or a folder of them, matched to model inputs.

A ``.npy`` array feeds a single-input model; a ``.npz`` names its arrays after the inputs (or
holds one array for a single-input model). A folder's files are concatenated along the batch
axis, in name order, so a data set can be split across files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kiln.optimize.types import OptimizeError

Batch = dict[str, npt.NDArray[np.generic]]

# ONNX Runtime's type strings -> the NumPy dtype a model input accepts.
ORT_NUMPY = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}


@dataclass(slots=True, frozen=True)
class InputSpec:
    """One model input as ONNX Runtime reports it; ``None`` dims are symbolic."""

    name: str
    dtype: type[np.generic]
    shape: tuple[int | None, ...]


def _load_file(path: Path) -> list[tuple[str | None, np.ndarray]]:
    try:
        if path.suffix == ".npy":
            return [(None, np.load(path, allow_pickle=False))]
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as archive:
                return [(key, archive[key]) for key in archive.files]
    except (OSError, ValueError) as exc:
        raise OptimizeError(f"cannot read data file '{path}': {exc}") from exc
    raise OptimizeError(f"data file '{path}' is not .npy or .npz")


def _assign(arrays: list[tuple[str | None, np.ndarray]], inputs: list[InputSpec], source: Path
            ) -> Batch:  # fmt: skip
    names = [i.name for i in inputs]
    if len(arrays) == 1 and len(inputs) == 1:
        return {names[0]: arrays[0][1]}
    by_name = {key: value for key, value in arrays if key is not None}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise OptimizeError(
            f"'{source}' has no array for model input(s) {missing}; "
            f"a .npz for a multi-input model must name its arrays {names}"
        )
    return {n: by_name[n] for n in names}


def load_data(source: str | Path, inputs: list[InputSpec], what: str) -> Batch:
    """Load ``source`` and check it fits ``inputs``: dtype castable, same rank, fixed dims equal."""
    path = Path(source)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".npy", ".npz"))
        parts = [_assign(_load_file(f), inputs, f) for f in files]
    elif path.exists():
        parts = [_assign(_load_file(path), inputs, path)]
    else:
        raise OptimizeError(f"{what} data '{path}' does not exist")
    if not parts:
        raise OptimizeError(f"{what} data '{path}' holds no .npy or .npz file")
    batch = {s.name: _conform([p[s.name] for p in parts], s, what) for s in inputs}
    rows = {len(a) for a in batch.values()}
    if rows == {0}:
        raise OptimizeError(f"{what} data '{path}' is empty (0 samples)")
    if len(rows) != 1:
        raise OptimizeError(f"{what} data '{path}': inputs have different sample counts {rows}")
    return batch


def _conform(parts: list[np.ndarray], spec: InputSpec, what: str) -> np.ndarray:
    array = np.concatenate(parts) if len(parts) > 1 else parts[0]
    if array.ndim != len(spec.shape):
        raise OptimizeError(
            f"{what} data for input '{spec.name}' has shape {list(array.shape)}, but the model "
            f"expects rank {len(spec.shape)} {_show(spec.shape)} (batch first)"
        )
    for axis, (got, want) in enumerate(zip(array.shape[1:], spec.shape[1:], strict=True), 1):
        if want is not None and got != want:
            raise OptimizeError(
                f"{what} data for input '{spec.name}' has shape {list(array.shape)}, but the "
                f"model expects {_show(spec.shape)}: dim {axis} is {got}, not {want}"
            )
    if array.dtype != spec.dtype:
        if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
            raise OptimizeError(
                f"{what} data for input '{spec.name}' is {array.dtype}, which does not convert "
                f"to the model's {np.dtype(spec.dtype).name}"
            )
        array = array.astype(spec.dtype)
    return np.ascontiguousarray(array)


def _show(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("N" if d is None else str(d) for d in shape) + "]"


def load_labels(source: str | Path, samples: int) -> np.ndarray:
    path = Path(source)
    arrays = _load_file(path) if path.exists() else []
    if len(arrays) != 1:
        raise OptimizeError(f"labels '{path}' must be one .npy array (or a .npz holding one)")
    labels = arrays[0][1].reshape(-1)
    if len(labels) != samples:
        raise OptimizeError(f"labels '{path}' has {len(labels)} entries for {samples} samples")
    return labels.astype(np.int64)


def slice_batch(batch: Batch, start: int, stop: int) -> Batch:
    return {k: v[start:stop] for k, v in batch.items()}


def sample_count(batch: Batch) -> int:
    return len(next(iter(batch.values())))


def tile_to(batch: Batch, size: int) -> Batch:
    """A batch of exactly ``size`` rows, repeating the data when it has fewer."""
    n = sample_count(batch)
    index = np.arange(size) % n
    return {k: v[index] for k, v in batch.items()}
