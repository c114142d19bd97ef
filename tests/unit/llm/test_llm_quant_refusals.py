"""Quantized checkpoints kiln cannot load are refused at load, naming the checkpoint and the
reason; ``--quantization`` / the ``quantization`` parameter must be the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file

from kiln.core.errors import KilnError
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.quantization.config import QuantConfig, check_requested, parse
from tests.llm_quant import base_model, write_awq, write_int8
from tests.unit.llm.test_llm_checkpoint import _config


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return base_model(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def int8(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_int8(base, tmp_path_factory.mktemp("int8"), per_channel=True, w8a8=True)[0]


@pytest.fixture(scope="module")
def awq(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_awq(base, tmp_path_factory.mktemp("awq"))[0]


def _load(folder: Path, **kw: Any) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(kv_cache_memory_bytes=1 << 22, **kw))


def _edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"].update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _drop_tensor(folder: Path, suffix: str) -> str:
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n.endswith(suffix))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    return name.removesuffix("." + suffix.split(".")[-1])


@pytest.mark.parametrize(
    ("quantization_config", "reason"),
    [
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
        ({"quant_method": "awq", "bits": 3, "group_size": 128}, "bits=3 is not supported"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 96}, "group_size 96 is not supported"),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
            "awq version 'gemv'",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int"}}},
            },
            "4-bit int weights are not supported",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "config_groups": {
                    "g": {"weights": {"num_bits": 8, "type": "int", "strategy": "group"}}
                },
            },
            "weight strategy 'group'",
        ),
    ],
)
def test_unsupported_configs_are_refused(quantization_config: dict[str, Any], reason: str) -> None:
    with pytest.raises(KilnError, match=reason) as err:
        parse({"quantization_config": quantization_config}, "models/tiny")
    assert "models/tiny" in str(err.value)


def test_unsupported_method_refused_at_load(int8: Path, tmp_path: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(int8, tmp_path / "m"))
    _edit_config(folder, quant_method="hqq")
    with pytest.raises(KilnError, match="quant_method 'hqq' is not supported") as err:
        _load(folder)
    assert str(folder) in str(err.value)


def test_missing_scales_are_refused(int8: Path, awq: Path, tmp_path: Path) -> None:
    import shutil

    folder = Path(shutil.copytree(int8, tmp_path / "int8"))
    layer = _drop_tensor(folder, "weight_scale")
    with pytest.raises(KilnError, match="weight but no weight_scale") as err:
        _load(folder)
    assert f"{folder}: {layer}" in str(err.value)
    folder = Path(shutil.copytree(awq, tmp_path / "awq"))
    layer = _drop_tensor(folder, "scales")
    with pytest.raises(KilnError, match=r"\(awq\) has no scales") as err:
        _load(folder)
    assert layer in str(err.value)


def test_requested_quantization_must_match(int8: Path, base: Path) -> None:
    with pytest.raises(KilnError, match="'awq' was asked for but the checkpoint's is comp"):
        _load(int8, quantization="awq")
    with pytest.raises(KilnError, match="'fp8' was asked for but the checkpoint's is none"):
        _load(base, quantization="fp8")
    with pytest.raises(KilnError, match="'int3' is not one of"):
        check_requested("int3", None, "m")
    # the checkpoint's own method, by name or by vLLM's kernel alias, loads
    check_requested("awq_marlin", QuantConfig("awq", "int4", 128), "m")
    assert _load(int8, quantization="compressed-tensors").runner.quantization is not None


def test_quantization_parameter_and_flag() -> None:
    from kiln.cli.llm_options import ENGINE_FLAGS

    assert _config({}).quantization == "auto"
    assert _config({"quantization": "AWQ"}).quantization == "awq"
    assert ENGINE_FLAGS["quantization"] == "quantization"


def test_quantized_moe_experts_are_refused_at_load(tmp_path: Path) -> None:
    """The experts' matrices are stacked for the grouped matmul, which takes float weights:
    a checkpoint with int8 experts is refused by name (it used to fail mid-load or at the
    first forward with a dtype error)."""
    import torch

    from tests.llm_models import build_tiny_llm
    from tests.llm_quant import _compressed

    folder = build_tiny_llm(tmp_path / "mixtral", "mixtral")
    tensors = load_file(str(folder / "model.safetensors"))
    experts = [n for n in tensors if ".experts." in n and n.endswith(".weight")]
    assert experts
    for name in experts:
        w = tensors[name].float()
        scale = w.abs().amax(dim=1, keepdim=True) / 127.0
        tensors[name] = (w / scale).round().clamp(-128, 127).to(torch.int8)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    save_file(tensors, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = _compressed("int", "channel", "int-quantized", False)
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(KilnError, match=r"experts\.0\.w\d: quantized Mixture-of-Experts"):
        _load(folder)
