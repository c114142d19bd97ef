"""TensorRT backend decisions that need no GPU, and its refusals on a machine without one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from google.protobuf import text_format

from kiln.backends.base import InstanceSpec
from kiln.backends.tensorrt import TensorRTBackend
from kiln.backends.tensorrt_plan import (
    Profile,
    allowed_profiles,
    built_for,
    choose_profile,
    deserialize_error,
    engine_filename,
    mismatch_from_log,
)
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

CC = (
    'cc_model_filenames { key: "9.0" value: "h100.plan" } '
    'cc_model_filenames { key: "8.0" value: "a100.plan" }'
)


def _config(extra: str = "") -> ModelConfig:
    return text_format.Parse(f'name: "trt" {extra}', ModelConfig())


def test_engine_file_by_compute_capability() -> None:
    config = _config(CC)
    assert engine_filename(config, (9, 0)) == "h100.plan"
    assert engine_filename(config, (8, 0)) == "a100.plan"
    assert engine_filename(config, (8, 6)) == "model.plan"  # no key: the default file
    named = _config(f'default_model_filename: "any.plan" {CC}')
    assert engine_filename(named, (7, 5)) == "any.plan"


def test_capability_mismatch_read_from_tensorrt_log() -> None:
    # TensorRT names the deserializing GPU first ("expecting") and the plan's GPU second
    # ("got"): an sm_90 plan loaded on an sm_80 GPU.
    log = [
        "IRuntime::deserializeCudaEngine: Error Code 6: API Usage Error (The engine plan file "
        "is generated on an incompatible device, expecting compute 8.0 got compute 9.0, "
        "please rebuild.)"
    ]
    assert mismatch_from_log(log) == ("sm_90", "sm_80")
    error = deserialize_error(_config(), "model.plan", (8, 0), log)
    assert "engines are GPU-specific: model.plan was built for sm_90, this GPU is sm_80" in (
        error.message
    )
    assert error.status is Status.INVALID_ARG


def test_capability_mismatch_from_cc_key_when_the_log_says_nothing() -> None:
    config = _config('cc_model_filenames { key: "9.0" value: "model.plan" }')
    assert built_for(config, "model.plan") == "sm_90"
    error = deserialize_error(config, "model.plan", (8, 0), [])
    assert "built for sm_90, this GPU is sm_80" in error.message
    assert "9.0 -> model.plan" in error.message


def test_other_deserialize_failures_quote_tensorrt() -> None:
    error = deserialize_error(_config(), "model.plan", (9, 0), ["Serialization assertion failed"])
    assert "model 'trt'" in error.message and "Serialization assertion failed" in error.message


def _profiles() -> list[Profile]:
    return [
        Profile(0, {"INPUT": ((1, 64), (8, 64))}),
        Profile(1, {"INPUT": ((9, 64), (64, 64))}),
    ]


def test_first_profile_that_fits_is_chosen() -> None:
    assert choose_profile("trt", _profiles(), {"INPUT": (4, 64)}).index == 0
    assert choose_profile("trt", _profiles(), {"INPUT": (32, 64)}).index == 1


def test_shape_outside_every_profile_is_invalid_arg() -> None:
    with pytest.raises(KilnError) as info:
        choose_profile("trt", _profiles(), {"INPUT": (65, 64)})
    assert info.value.status is Status.INVALID_ARG
    assert "request specifies invalid shape for model 'trt'" in info.value.message
    assert "dimension 0 of input 'INPUT' to be between 9 and 64 but received 65" in (
        info.value.message
    )
    with pytest.raises(KilnError, match="has 3 dimensions, the engine expects 2"):
        choose_profile("trt", _profiles()[:1], {"INPUT": (1, 64, 1)})


def test_instance_group_profiles() -> None:
    assert allowed_profiles("trt", [], 3) == [0, 1, 2]
    assert allowed_profiles("trt", ["2", "0"], 3) == [2, 0]
    with pytest.raises(KilnError, match="profile '3' does not exist"):
        allowed_profiles("trt", ["3"], 3)


def test_cpu_instance_is_refused_as_gpu_only(tmp_path: Path) -> None:
    spec = InstanceSpec(name="trt_0", kind="cpu", device_id=0, index=0, total_instances=1)
    with pytest.raises(KilnError, match="runs only on GPUs") as info:
        TensorRTBackend(_config(), tmp_path, spec)
    assert info.value.status is Status.UNAVAILABLE


HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


@pytest.mark.skipif(
    TensorRTBackend.gpu_count() > 0 and HAS_TENSORRT, reason="this machine can run engines"
)
def test_refusal_names_what_this_machine_lacks(tmp_path: Path) -> None:
    spec = InstanceSpec(name="trt_0", kind="gpu", device_id=0, index=0, total_instances=1)
    with pytest.raises(KilnError, match="the tensorrt backend needs") as info:
        TensorRTBackend(_config(), tmp_path, spec)
    assert info.value.status is Status.UNAVAILABLE
    message = info.value.message
    if not TensorRTBackend.gpu_count() > 0:
        assert "an NVIDIA GPU, and this machine has no usable one" in message
        assert "engines are GPU-specific" in message
    if not HAS_TENSORRT:
        assert "No module named 'tensorrt'" in message
        assert "install kiln-serve[tensorrt]" in message
    with pytest.raises(KilnError, match="the tensorrt backend needs"):
        TensorRTBackend.auto_complete_config(_config(), tmp_path)  # no I/O: needs the engine
