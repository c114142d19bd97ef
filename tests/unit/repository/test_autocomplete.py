"""ONNX auto-complete, through the repository manager that applies it (as a server loads)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.repository.manager import RepositoryManager
from kiln.server.runtime import runtime_factory
from tests.onnx_models import identity_model


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[RepositoryManager]:
    repo = RepositoryManager([tmp_path], runtime_factory())
    yield repo
    await repo.unload_all()


async def _config(manager: RepositoryManager, name: str) -> ModelConfig:
    await manager.load(name)
    return manager.get(name).config


def _io(cfg: ModelConfig) -> list[tuple[str, int, list[int]]]:
    return [(t.name, t.data_type, list(t.dims)) for t in [*cfg.input, *cfg.output]]


async def test_batchable_model_without_config(tmp_path: Path, manager: RepositoryManager) -> None:
    identity_model(
        tmp_path / "m" / "1" / "model.onnx",
        [("IMAGE", TensorProto.FLOAT, ["batch", 3, "h"]), ("IDS", TensorProto.INT64, ["n", 2])],
        [("PROB", TensorProto.FLOAT, ["batch", 3, "h"]), ("LABEL", TensorProto.INT64, ["n", 2])],
    )
    cfg = await _config(manager, "m")
    assert cfg.name == "m"
    assert cfg.platform == "onnxruntime_onnx" and cfg.backend == "onnxruntime"
    assert cfg.default_model_filename == "model.onnx"
    assert cfg.max_batch_size == 4  # Triton's default-max-batch-size
    assert _io(cfg) == [
        ("IMAGE", PbDataType.TYPE_FP32, [3, -1]),
        ("IDS", PbDataType.TYPE_INT64, [2]),
        ("PROB", PbDataType.TYPE_FP32, [3, -1]),
        ("LABEL", PbDataType.TYPE_INT64, [2]),
    ]
    assert cfg.HasField("dynamic_batching")  # Triton adds an empty one when batching
    assert len(cfg.instance_group) == 1


async def test_one_fixed_first_dim_means_no_batching(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(
        tmp_path / "m" / "1" / "model.onnx",
        [("A", TensorProto.FLOAT, ["batch", 4]), ("B", TensorProto.BOOL, [2, 4])],
    )
    cfg = await _config(manager, "m")
    assert cfg.max_batch_size == 0
    assert not cfg.HasField("dynamic_batching")
    assert _io(cfg) == [
        ("A", PbDataType.TYPE_FP32, [-1, 4]),
        ("B", PbDataType.TYPE_BOOL, [2, 4]),
        ("OUT0", PbDataType.TYPE_FP32, [-1, 4]),
        ("OUT1", PbDataType.TYPE_BOOL, [2, 4]),
    ]


async def test_config_without_io_keeps_what_it_sets(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.STRING, ["b", 2])])
    (tmp_path / "m" / "config.pbtxt").write_text(
        'platform: "onnxruntime_onnx"\nmax_batch_size: 16\n'
        "instance_group [ { count: 2 kind: KIND_CPU } ]\n"
    )
    cfg = await _config(manager, "m")
    assert cfg.max_batch_size == 16
    assert _io(cfg) == [("X", PbDataType.TYPE_STRING, [2]), ("OUT0", PbDataType.TYPE_STRING, [2])]
    assert cfg.instance_group[0].count == 2


async def test_max_batch_size_one_gets_no_dynamic_batching(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b", 2])])
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 1\n")
    cfg = await _config(manager, "m")
    assert cfg.max_batch_size == 1 and not cfg.HasField("dynamic_batching")


async def test_config_with_io_is_not_auto_completed(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b", 2])])
    (tmp_path / "m" / "config.pbtxt").write_text(
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]\n'
        'output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ -1, 2 ] } ]\n'
    )
    cfg = await _config(manager, "m")
    assert cfg.max_batch_size == 0 and not cfg.HasField("dynamic_batching")


async def test_batching_asked_of_a_model_that_cannot_batch(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, [3, 2])])
    (tmp_path / "m" / "config.pbtxt").write_text("max_batch_size: 8\n")
    with pytest.raises(KilnError) as info:
        await manager.load("m")
    assert "failed to load 'm'" in info.value.message
    assert "max_batch_size 8" in info.value.message and "'X'" in info.value.message


async def test_rank_one_batchable_tensor_gets_dims_1_and_empty_reshape(
    tmp_path: Path, manager: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b"])])
    cfg = await _config(manager, "m")
    assert cfg.max_batch_size == 4
    assert list(cfg.input[0].dims) == [1] and cfg.input[0].HasField("reshape")
    assert list(cfg.input[0].reshape.shape) == []
    # the client sends [batch, 1]; the model sees [batch] and the answer is [batch, 1] again
    data = np.array([[1.5], [2.5]], dtype=np.float32)
    request = InferenceRequest("m", inputs=[InferInput("X", DataType.FP32, (2, 1), data)])
    response = await manager.get("m").infer(request)
    assert response.outputs[0].shape == (2, 1)
    np.testing.assert_array_equal(response.outputs[0].data, data)


async def test_unreadable_model_file(tmp_path: Path, manager: RepositoryManager) -> None:
    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"not an onnx file")
    with pytest.raises(KilnError) as info:
        await manager.load("m")
    assert "failed to load 'm'" in info.value.message
    (row,) = manager.index()
    assert row["state"] == "UNAVAILABLE" and "model.onnx" in row["reason"]


PY_IDENTITY = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        if config.as_dict()["name"] == "asks":
            config.set_dynamic_batching()
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests]
"""


@pytest.mark.parametrize(("name", "batcher"), [("plain", False), ("asks", True)])
async def test_a_python_model_gets_the_batcher_only_if_it_asks(
    tmp_path: Path, manager: RepositoryManager, name: str, batcher: bool
) -> None:
    """Triton's python backend: ``max_batch_size: 8`` alone runs one request per execute
    (Triton 2.51 loads such a config without ``dynamic_batching``); a model's
    ``auto_complete_config`` may turn the batcher on."""
    (tmp_path / name / "1").mkdir(parents=True)
    (tmp_path / name / "1" / "model.py").write_text(PY_IDENTITY)
    (tmp_path / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
    )
    cfg = await _config(manager, name)
    assert cfg.max_batch_size == 8
    assert cfg.HasField("dynamic_batching") is batcher


# ---- --disable-auto-complete-config ---------------------------------------------------------
@pytest.fixture
async def strict(tmp_path: Path) -> AsyncIterator[RepositoryManager]:
    repo = RepositoryManager([tmp_path], runtime_factory(), auto_complete=False)
    yield repo
    await repo.unload_all()


COMPLETE_ONNX = (
    'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
    'output [ { name: "OUT0" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
)


async def test_without_auto_complete_a_batching_model_gets_no_batcher(
    tmp_path: Path, strict: RepositoryManager
) -> None:
    """As Triton with --disable-auto-complete-config: the config as written, one instance."""
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b", 2])])
    (tmp_path / "m" / "config.pbtxt").write_text(COMPLETE_ONNX)
    cfg = await _config(strict, "m")
    assert cfg.max_batch_size == 8 and not cfg.HasField("dynamic_batching")
    assert len(cfg.instance_group) == 1
    data = np.ones((3, 2), np.float32)
    request = InferenceRequest("m", inputs=[InferInput("X", DataType.FP32, (3, 2), data)])
    response = await strict.get("m").infer(request)
    np.testing.assert_array_equal(response.outputs[0].data, data)


async def test_without_auto_complete_a_model_needs_its_config_file(
    tmp_path: Path, strict: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b", 2])])
    with pytest.raises(KilnError) as info:
        await strict.load("m")
    message = info.value.message
    assert "failed to load 'm'" in message and "config.pbtxt" in message
    assert "--disable-auto-complete-config" in message


async def test_without_auto_complete_missing_outputs_are_not_read_from_the_model(
    tmp_path: Path, strict: RepositoryManager
) -> None:
    identity_model(tmp_path / "m" / "1" / "model.onnx", [("X", TensorProto.FLOAT, ["b", 2])])
    (tmp_path / "m" / "config.pbtxt").write_text(COMPLETE_ONNX.rsplit("output", 1)[0])
    with pytest.raises(KilnError) as info:
        await strict.load("m")
    assert "failed to load 'm'" in info.value.message and "output" in info.value.message


async def test_without_auto_complete_a_python_model_s_hook_is_not_called(
    tmp_path: Path, strict: RepositoryManager
) -> None:
    (tmp_path / "asks" / "1").mkdir(parents=True)
    (tmp_path / "asks" / "1" / "model.py").write_text(PY_IDENTITY)
    (tmp_path / "asks" / "config.pbtxt").write_text(
        'name: "asks"\nbackend: "python"\nmax_batch_size: 8\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]\n'
    )
    cfg = await _config(strict, "asks")
    assert not cfg.HasField("dynamic_batching")  # the hook would have asked for it
