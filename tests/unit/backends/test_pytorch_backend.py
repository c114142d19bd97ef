"""The PyTorch backend in-process: dtypes, bindings, parameters and load refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format

from kiln.backends.base import InstanceSpec
from kiln.backends.pytorch import PyTorchBackend
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

CPU = InstanceSpec(name="m_0", kind="cpu", device_id=0, index=0, total_instances=1)


class _Mixed(torch.nn.Module):
    def forward(
        self, flags: torch.Tensor, half: torch.Tensor, brain: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return ~flags, half * 2, brain + 1


def _tensor(name: str, dtype: str) -> str:
    return f'{{ name: "{name}" data_type: {dtype} dims: [ 3 ] }}'


def _model(tmp_path: Path, inputs: str, outputs: str, extra: str = "") -> PyTorchBackend:
    (tmp_path / "1").mkdir(exist_ok=True)
    torch.jit.save(torch.jit.script(_Mixed()), str(tmp_path / "1" / "model.pt"))
    text = 'name: "m" backend: "pytorch" default_model_filename: "model.pt" '
    text += f"input [ {inputs} ] output [ {outputs} ] {extra}"
    return PyTorchBackend(text_format.Parse(text, ModelConfig()), tmp_path / "1", CPU)


IN = ", ".join(
    [_tensor("half", "TYPE_FP16"), _tensor("brain", "TYPE_BF16"), _tensor("flags", "TYPE_BOOL")]
)
OUT = ", ".join(
    [_tensor("O__0", "TYPE_BOOL"), _tensor("O__1", "TYPE_FP16"), _tensor("O__2", "TYPE_BF16")]
)


def test_bool_fp16_bf16_by_forward_argument_names(tmp_path: Path) -> None:
    backend = _model(tmp_path, IN, OUT)
    assert backend.inputs.names == ("flags", "half", "brain")
    flags = np.array([True, False, True])
    half = np.array([1.5, -2.0, 0.25], np.float16)
    brain = np.array([1.0, 2.5, -3.0], np.float32)  # BF16 held as float32, exact in bf16
    out = backend.execute({"flags": flags, "half": half, "brain": brain}, ["O__0", "O__1", "O__2"])
    np.testing.assert_array_equal(out["O__0"], ~flags)
    assert out["O__1"].dtype == np.float16
    np.testing.assert_array_equal(out["O__1"], half * 2)
    assert out["O__2"].dtype == np.float32
    np.testing.assert_array_equal(out["O__2"], brain + 1)


def test_output_dtype_mismatch_names_model_and_output(tmp_path: Path) -> None:
    wrong = OUT.replace('"O__1" data_type: TYPE_FP16', '"O__1" data_type: TYPE_FP32')
    backend = _model(tmp_path, IN, wrong)
    feed = {
        "flags": np.ones(3, bool),
        "half": np.ones(3, np.float16),
        "brain": np.ones(3, np.float32),
    }
    with pytest.raises(KilnError, match=r"model 'm' produced output 'O__1' as torch.float16"):
        backend.execute(feed, ["O__1"])


def test_string_tensors_are_refused_at_load(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"does not support TYPE_STRING tensors \('half'\)") as e:
        _model(tmp_path, IN.replace("TYPE_FP16", "TYPE_STRING"), OUT)
    assert e.value.status is Status.INVALID_ARG


def test_thread_parameters(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        params = 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } }'
        _model(tmp_path, IN, OUT, params)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    bad = 'parameters { key: "INTER_OP_THREAD_COUNT" value { string_value: "many" } }'
    with pytest.raises(KilnError, match="INTER_OP_THREAD_COUNT must be a non-negative integer"):
        _model(tmp_path, IN, OUT, bad)


def test_optimized_execution_can_be_disabled(tmp_path: Path) -> None:
    params = 'parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value { string_value: "true" } }'
    backend = _model(tmp_path, IN, OUT, params)
    feed = {"flags": np.ones(3, bool), "half": np.ones(3, np.float16), "brain": np.ones(3, "f4")}
    assert backend.execute(feed, ["O__0"])["O__0"].tolist() == [False] * 3


def test_corrupt_file_is_a_load_error(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.pt").write_bytes(b"not a zip archive")
    config = text_format.Parse(
        f'name: "m" default_model_filename: "model.pt" input [ {IN} ] output [ {OUT} ]',
        ModelConfig(),
    )
    with pytest.raises(KilnError, match=r"unable to load model 'm' from model.pt"):
        PyTorchBackend(config, tmp_path / "1", CPU)


def test_pt2_only_folder_completes_the_filename(tmp_path: Path) -> None:
    (tmp_path / "model.pt2").write_bytes(b"")
    config = text_format.Parse(
        f'name: "m" default_model_filename: "model.pt" input [ {IN} ] output [ {OUT} ]',
        ModelConfig(),
    )
    PyTorchBackend.auto_complete_config(config, tmp_path)
    assert config.default_model_filename == "model.pt2"


class _Constants(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.offset = torch.tensor([1.0, 2.0, 3.0])  # a plain attribute: a lifted constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # exported on the CPU, torch.ones records device="cpu" in the graph
        out: torch.Tensor = self.linear(x) + torch.ones(x.shape[1]) + self.offset
        return out


def test_exported_program_moves_whole_to_another_device(tmp_path: Path) -> None:
    """The meta device stands in for a GPU: an exported program's constants and the device
    of its factory ops move with it, not only its parameters."""
    from kiln.backends.pytorch import _load

    path = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(_Constants(), (torch.zeros(2, 3),)), str(path))
    module, names = _load("m", path, torch.device("meta"))
    assert names == ["x"]
    assert module(torch.zeros(2, 3, device="meta")).device.type == "meta"
    module, _ = _load("m", path, torch.device("cpu"))
    assert module(torch.zeros(2, 3)).shape == (2, 3)


def test_config_without_io_cannot_be_completed(tmp_path: Path) -> None:
    with pytest.raises(KilnError, match=r"declare every input and output in config\.pbtxt"):
        PyTorchBackend.auto_complete_config(ModelConfig(name="m"), tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_instance_without_cuda_is_refused(tmp_path: Path) -> None:
    gpu = InstanceSpec(name="m_0", kind="gpu", device_id=0, index=0, total_instances=1)
    config = text_format.Parse(f'name: "m" input [ {IN} ] output [ {OUT} ]', ModelConfig())
    with pytest.raises(KilnError, match="asks for KIND_GPU but this torch build has no CUDA"):
        PyTorchBackend(config, tmp_path, gpu)
