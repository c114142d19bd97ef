"""Triton's classification extension: an output asked for with ``classification: K``
comes back as its top K entries, each a BYTES string ``"<value>:<index>[:<label>]"``.

Labels are read once, at load time, from the output's ``label_filename`` (one per line,
in the model folder).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kiln.core.errors import invalid_arg
from kiln.core.types import DataType, InferOutput

PARAMETER = "classification"


def load_labels(model_dir: Path, filenames: dict[str, str]) -> dict[str, list[str]]:
    """Output name -> labels, for outputs whose config names a ``label_filename``."""
    labels = {}
    for output, filename in filenames.items():
        path = (model_dir / filename).resolve()
        if not path.is_relative_to(model_dir.resolve()):
            raise invalid_arg(
                f"output '{output}': label_filename '{filename}' is outside the model"
            )
        try:
            labels[output] = path.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise invalid_arg(
                f"output '{output}': unable to read label_filename '{filename}': {exc.strerror}"
            ) from None
    return labels


def requested_count(output: str, parameters: dict[str, object]) -> int:
    count = parameters.get(PARAMETER)
    if count is None:
        return 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise invalid_arg(f"output '{output}': 'classification' must be an integer >= 1")
    return count


def _format(value: object) -> str:
    # Triton writes values with std::to_string: six decimals for floats.
    if isinstance(value, float | np.floating):
        return f"{float(value):f}"
    return str(value)


def classify(out: InferOutput, count: int, batching: bool, labels: list[str]) -> InferOutput:
    if out.datatype is DataType.BYTES:
        raise invalid_arg(f"output '{out.name}': classification needs a numeric output, not BYTES")
    data = out.data
    rows = data.reshape(data.shape[0], -1) if batching else data.reshape(1, -1)
    k = min(count, rows.shape[1])
    result = np.empty((rows.shape[0], k), dtype=object)
    for r, row in enumerate(rows):
        # Highest first; a stable sort keeps the lower index first among equal values.
        order = np.argsort(-row.astype(np.float64), kind="stable")[:k]
        for c, index in enumerate(order):
            text = f"{_format(row[index].item())}:{index}"
            if index < len(labels):
                text += f":{labels[index]}"
            result[r, c] = text.encode()
    final: np.ndarray = result if batching else result.reshape(k)
    return InferOutput(out.name, DataType.BYTES, tuple(final.shape), final)
