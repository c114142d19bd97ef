"""Write the chosen candidate as a model repository entry ``kiln serve`` (or Triton) loads as is."""

from __future__ import annotations

import shutil
from pathlib import Path

from kiln.optimize.session import open_session
from kiln.optimize.types import Candidate

# ONNX Runtime type strings -> config.pbtxt data types.
_CONFIG_TYPES = {
    "tensor(float)": "TYPE_FP32",
    "tensor(double)": "TYPE_FP64",
    "tensor(float16)": "TYPE_FP16",
    "tensor(int64)": "TYPE_INT64",
    "tensor(int32)": "TYPE_INT32",
    "tensor(int8)": "TYPE_INT8",
    "tensor(uint8)": "TYPE_UINT8",
    "tensor(bool)": "TYPE_BOOL",
}

# Triton's onnxruntime backend: optimization.graph.level -1 = basic, 1 = extended, else all.
_GRAPH_LEVEL = {"basic": -1, "extended": 1, "all": 2}


def _tensor(name: str, ort_type: str, shape: list[object]) -> str:
    dims = ", ".join(str(d) if isinstance(d, int) and d >= 0 else "-1" for d in shape[1:])
    return (
        f'  {{\n    name: "{name}"\n    data_type: {_CONFIG_TYPES[ort_type]}\n'
        f"    dims: [ {dims} ]\n  }}"
    )


def config_text(name: str, candidate: Candidate, max_batch_size: int, threads: int) -> str:
    assert candidate.path is not None
    session = open_session(candidate.path, candidate.graph_level, threads)
    inputs = ",\n".join(_tensor(i.name, i.type, i.shape) for i in session.get_inputs())
    outputs = ",\n".join(_tensor(o.name, o.type, o.shape) for o in session.get_outputs())
    return f"""\
# Written by kiln optimize: candidate {candidate.name} ({candidate.description}).
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
input [
{inputs}
]
output [
{outputs}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
optimization {{ graph {{ level: {_GRAPH_LEVEL[candidate.graph_level]} }} }}
parameters {{ key: "intra_op_thread_count" value {{ string_value: "{threads}" }} }}
"""


def write_entry(
    repository: Path, name: str, candidate: Candidate, max_batch_size: int, threads: int
) -> Path:
    """``REPO/NAME/config.pbtxt`` and ``REPO/NAME/1/model.onnx``; returns the model folder."""
    assert candidate.path is not None
    folder = repository / name
    (folder / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(candidate.path, folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(config_text(name, candidate, max_batch_size, threads))
    return folder
