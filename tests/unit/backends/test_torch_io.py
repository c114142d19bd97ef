"""Triton's PyTorch tensor-binding rules and the registry's torch install hint."""

from __future__ import annotations

import importlib
import types
from pathlib import Path

import pytest

from kiln.backends import registry
from kiln.backends.torch_io import bind_inputs, bind_outputs
from kiln.core.errors import KilnError, Status


def test_inputs_by_forward_argument_follow_forward_order() -> None:
    binding = bind_inputs("m", ["mask", "image"], ["image", "mask"])
    assert binding.names == ("image", "mask")
    assert binding.convention == "forward argument"


def test_inputs_by_index_follow_the_index_not_the_config_order() -> None:
    binding = bind_inputs("m", ["IN__1", "IN__0"], ["x", "y"])
    assert binding.names == ("IN__0", "IN__1")
    assert binding.convention == "<name>__<index>"


def test_inputs_fall_back_to_config_order() -> None:
    binding = bind_inputs("m", ["b", "a"], ["x", "y"])
    assert (binding.names, binding.convention) == (("b", "a"), "config order")


def test_forward_argument_without_config_input_is_refused() -> None:
    with pytest.raises(KilnError, match=r"no input for 'mask'") as info:
        bind_inputs("m", ["image"], ["image", "mask"])
    assert info.value.status is Status.INVALID_ARG


def test_input_count_must_match_forward() -> None:
    with pytest.raises(KilnError, match=r"forward\(\) takes 1 argument"):
        bind_inputs("m", ["INPUT__0", "INPUT__1"], ["x"])


def test_duplicate_and_gapped_indices_are_refused() -> None:
    with pytest.raises(KilnError, match="both claim position 0"):
        bind_outputs("m", ["A__0", "B__0"])
    with pytest.raises(KilnError, match=r"indices are not 0\.\.1"):
        bind_outputs("m", ["A__0", "B__2"])


def test_outputs_by_index_or_config_order() -> None:
    assert bind_outputs("m", ["P__1", "L__0"]).names == ("L__0", "P__1")
    assert bind_outputs("m", ["P", "L__0"]).names == ("P", "L__0")


def test_missing_torch_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.import_module

    def without_torch(name: str, package: str | None = None) -> types.ModuleType:
        if name == "kiln.backends.pytorch":  # what importing it does on a torch-less machine
            raise ModuleNotFoundError("No module named 'torch'", name="torch")
        return real(name, package)

    monkeypatch.setattr(registry.importlib, "import_module", without_torch)
    with pytest.raises(KilnError, match=r"install kiln-serve\[torch\]") as info:
        registry.backend_class("pytorch")
    assert info.value.status is Status.UNAVAILABLE
    assert "No module named 'torch'" in info.value.message


def test_files_and_platforms_pick_the_backend(tmp_path: Path) -> None:
    from kiln.config.model_config_pb2 import ModelConfig

    for filename, backend in (
        ("model.pt", "pytorch"),
        ("model.pt2", "pytorch"),
        ("model.plan", "tensorrt"),
    ):
        model = tmp_path / filename.replace(".", "_")
        (model / "1").mkdir(parents=True)
        (model / "1" / filename).write_bytes(b"")
        assert registry.backend_name(ModelConfig(name="m"), model) == backend
    assert registry.backend_name(ModelConfig(platform="pytorch_libtorch"), tmp_path) == "pytorch"
    assert registry.backend_name(ModelConfig(platform="tensorrt_plan"), tmp_path) == "tensorrt"
