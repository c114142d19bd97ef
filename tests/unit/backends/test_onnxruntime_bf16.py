"""BF16 at the onnxruntime backend's boundary: float32 in kiln, bfloat16 bits in ORT."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.backends.base import InstanceSpec
from kiln.backends.onnxruntime import OnnxRuntimeBackend
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

SPEC = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)


def backend(
    tmp_path: Path, nodes: list[onnx.NodeProto], ins: list, outs: list
) -> OnnxRuntimeBackend:
    graph = helper.make_graph(nodes, "g", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    (tmp_path / "1").mkdir()
    onnx.save(model, tmp_path / "1" / "model.onnx")
    return OnnxRuntimeBackend(ModelConfig(name="m"), tmp_path / "1", SPEC)


def value(name: str, elem: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, ["n", 3])


def test_bf16_input_casts_to_float_through_session_run(tmp_path: Path) -> None:
    model = backend(
        tmp_path,
        [helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.FLOAT)],
        [value("X", TensorProto.BFLOAT16)],
        [value("Y", TensorProto.FLOAT)],
    )
    data = np.array([[1.0, -0.5, 3.0e38], [0.0, 2.0**-126, -65536.0]], np.float32)
    out = model.execute({"X": data}, ["Y"])["Y"]
    # 3.0e38 is not a BF16 value: the boundary keeps its high 16 bits, like the wire codecs.
    truncated = (data.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    assert truncated[0, 2] != data[0, 2]
    np.testing.assert_array_equal(out, truncated)


def test_float_input_to_bf16_output_truncates_to_the_high_bits(tmp_path: Path) -> None:
    model = backend(
        tmp_path,
        [helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.BFLOAT16)],
        [value("X", TensorProto.FLOAT)],
        [value("Y", TensorProto.BFLOAT16)],
    )
    data = np.array([[1.0, 256.0, -2.5]], np.float32)
    out = model.execute({"X": data}, ["Y"])["Y"]
    assert out.dtype == np.float32 and out.shape == (1, 3)
    np.testing.assert_array_equal(out, data)  # all exact in BF16


def test_bf16_identity_keeps_bits_and_empty_batches(tmp_path: Path) -> None:
    model = backend(
        tmp_path,
        [helper.make_node("Identity", ["X"], ["Y"])],
        [value("X", TensorProto.BFLOAT16)],
        [value("Y", TensorProto.BFLOAT16)],
    )
    bits = np.random.default_rng(3).integers(0, 0x7F80, size=(5, 3), dtype=np.uint32) << 16
    data = bits.view(np.float32)
    np.testing.assert_array_equal(model.execute({"X": data}, ["Y"])["Y"].view(np.uint32), bits)
    empty = model.execute({"X": np.zeros((0, 3), np.float32)}, ["Y"])["Y"]
    assert empty.shape == (0, 3) and empty.dtype == np.float32


def test_string_inputs_with_bf16_outputs_refuse_to_load(tmp_path: Path) -> None:
    with pytest.raises(KilnError) as err:
        backend(
            tmp_path,
            [
                helper.make_node("Identity", ["S"], ["T"]),
                helper.make_node("Cast", ["X"], ["Y"], to=TensorProto.BFLOAT16),
            ],
            [value("S", TensorProto.STRING), value("X", TensorProto.FLOAT)],
            [value("T", TensorProto.STRING), value("Y", TensorProto.BFLOAT16)],
        )
    assert err.value.status is Status.INVALID_ARG
    assert "model 'm'" in err.value.message and "STRING inputs (S)" in err.value.message
    assert "BF16 outputs (Y)" in err.value.message
