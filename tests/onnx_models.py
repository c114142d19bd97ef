"""Tiny ONNX models built with the ``onnx`` helper API, for tests that need a shape or a
behaviour the example models do not have (fixed first dims, rank 0, a slow loop)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import onnx
from onnx import TensorProto, helper

OPSET = 17
IR_VERSION = 8

Dim = int | str  # a string is a symbolic (variable) dimension


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=IR_VERSION
    )
    onnx.checker.check_model(model, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(model, path)
    return path


def identity_model(
    path: Path,
    inputs: Sequence[tuple[str, int, Sequence[Dim]]],
    outputs: Sequence[tuple[str, int, Sequence[Dim]]] | None = None,
) -> Path:
    """Each output ``i`` is ``Identity(input i)``; outputs default to ``OUT<i>`` of the same
    type and shape. Lets a test choose names, element types and (variable) dims freely."""
    if outputs is None:
        outputs = [(f"OUT{i}", t, dims) for i, (_, t, dims) in enumerate(inputs)]
    nodes = [
        helper.make_node("Identity", [i[0]], [o[0]]) for i, o in zip(inputs, outputs, strict=True)
    ]
    graph = helper.make_graph(
        nodes,
        "identity",
        [helper.make_tensor_value_info(n, t, list(d)) for n, t, d in inputs],
        [helper.make_tensor_value_info(n, t, list(d)) for n, t, d in outputs],
    )
    return _save(graph, path)


def slow_add_model(path: Path) -> Path:
    """``OUTPUT = INPUT + ITERS``, computed by adding 1 to the whole tensor ITERS times in a
    Loop: the client picks how long a request computes, and the answer stays checkable.

    INPUT: FP32 [-1] (no batching), ITERS: INT64 [1].
    """
    body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"]),
            helper.make_node("Add", ["x_in", "one"], ["x_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_in", TensorProto.FLOAT, ["n"]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x_out", TensorProto.FLOAT, ["n"]),
        ],
        initializer=[helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Reshape", ["ITERS", "scalar_shape"], ["trip_count"]),
            helper.make_node("Loop", ["trip_count", "true", "INPUT"], ["OUTPUT"], body=body),
        ],
        "slow_add",
        [
            helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["n"]),
            helper.make_tensor_value_info("ITERS", TensorProto.INT64, [1]),
        ],
        [helper.make_tensor_value_info("OUTPUT", TensorProto.FLOAT, ["n"])],
        initializer=[
            helper.make_tensor("scalar_shape", TensorProto.INT64, [0], []),
            helper.make_tensor("true", TensorProto.BOOL, [], [True]),
        ],
    )
    return _save(graph, path)


SLOW_CONFIG = """\
name: "slow"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
  { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] },
  { name: "ITERS" data_type: TYPE_INT64 dims: [ 1 ] }
]
output [
  { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
parameters { key: "intra_op_thread_count" value { string_value: "1" } }
"""


def write_slow_model(repo: Path) -> Path:
    folder = repo / "slow"
    slow_add_model(folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(SLOW_CONFIG, encoding="utf-8")
    return folder
