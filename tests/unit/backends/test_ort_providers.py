"""ONNX Runtime execution providers built from the config's GPU accelerators."""

from __future__ import annotations

import pytest
from google.protobuf import text_format

from kiln.backends.ort_providers import (
    CPU,
    CUDA,
    TENSORRT,
    check_session_providers,
    execution_providers,
)
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

ALL = [TENSORRT, CUDA, CPU]


def _config(accelerators: str = "") -> ModelConfig:
    text = f'name: "m" optimization {{ execution_accelerators {{ {accelerators} }} }}'
    return text_format.Parse(text, ModelConfig())


def _trt(params: str) -> str:
    return f'gpu_execution_accelerator {{ name: "tensorrt" {params} }}'


def _cuda(params: str) -> str:
    return f'gpu_execution_accelerator {{ name: "cuda" {params} }}'


def _p(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: "{value}" }}'


def test_cpu_instances_ignore_gpu_accelerators() -> None:
    assert execution_providers(_config(_trt("")), "cpu", 0, ALL) == [CPU]


def test_gpu_without_accelerators_is_cuda_then_cpu() -> None:
    assert execution_providers(_config(), "gpu", 1, ALL) == [(CUDA, {"device_id": 1}), CPU]


def test_gpu_without_cuda_provider_is_refused() -> None:
    with pytest.raises(KilnError, match="no CUDA execution provider") as info:
        execution_providers(_config(), "gpu", 0, [CPU])
    assert info.value.status is Status.UNAVAILABLE


def test_a_session_that_fell_back_to_the_cpu_is_refused() -> None:
    # What onnxruntime-gpu does when libcudnn is missing: an error in its log, and a session
    # on CPUExecutionProvider alone.
    asked = execution_providers(_config(_trt("")), "gpu", 2, ALL)
    with pytest.raises(KilnError) as info:
        check_session_providers("m", 2, asked, [CPU])
    message = str(info.value)
    assert "model 'm'" in message and "on GPU 2" in message
    assert f"{TENSORRT} and {CUDA}" in message and f"fell back to {CPU}" in message
    assert info.value.status is Status.UNAVAILABLE
    # Only the TensorRT EP failed (no libnvinfer): still refused, naming it alone.
    with pytest.raises(KilnError, match=f"could not start the {TENSORRT} on GPU 2"):
        check_session_providers("m", 2, asked, [CUDA, CPU])


def test_a_session_with_every_provider_it_was_given_passes() -> None:
    asked = execution_providers(_config(_trt("")), "gpu", 0, ALL)
    check_session_providers("m", 0, asked, [TENSORRT, CUDA, CPU])
    check_session_providers("m", 0, [CPU], [CPU])


def test_tensorrt_options_from_triton_keys() -> None:
    params = "".join(
        [
            _p("precision_mode", "FP16"),
            _p("max_workspace_size_bytes", "1073741824"),
            _p("trt_engine_cache_path", "/cache"),
            _p("trt_max_partition_iterations", "10"),
            _p("trt_min_subgraph_size", "3"),
        ]
    )
    providers = execution_providers(_config(_trt(params)), "gpu", 0, ALL)
    assert providers == [
        (
            TENSORRT,
            {
                "device_id": 0,
                "trt_fp16_enable": True,
                "trt_max_workspace_size": 1073741824,
                "trt_engine_cache_path": "/cache",
                "trt_engine_cache_enable": True,  # implied by the path
                "trt_max_partition_iterations": 10,
                "trt_min_subgraph_size": 3,
            },
        ),
        (CUDA, {"device_id": 0}),
        CPU,
    ]


def test_explicit_cache_disable_wins_over_the_path() -> None:
    params = _p("trt_engine_cache_enable", "false") + _p("trt_engine_cache_path", "/c")
    trt_options = execution_providers(_config(_trt(params)), "gpu", 0, ALL)[0][1]
    assert isinstance(trt_options, dict)
    assert trt_options["trt_engine_cache_enable"] is False


def test_int8_and_fp32_precision() -> None:
    int8 = execution_providers(_config(_trt(_p("precision_mode", "INT8"))), "gpu", 0, ALL)
    assert int8[0] == (TENSORRT, {"device_id": 0, "trt_int8_enable": True})
    fp32 = execution_providers(_config(_trt(_p("precision_mode", "FP32"))), "gpu", 0, ALL)
    assert fp32[0] == (TENSORRT, {"device_id": 0})


def test_cuda_accelerator_options() -> None:
    cuda = _cuda(
        "".join(
            [
                _p("cudnn_conv_algo_search", "1"),
                _p("gpu_mem_limit", "4096"),
                _p("arena_extend_strategy", "1"),
                _p("do_copy_in_default_stream", "true"),
            ]
        )
    )
    providers = execution_providers(_config(cuda), "gpu", 2, ALL)
    assert providers == [
        (
            CUDA,
            {
                "device_id": 2,
                "cudnn_conv_algo_search": "HEURISTIC",
                "gpu_mem_limit": 4096,
                "arena_extend_strategy": "kSameAsRequested",
                "do_copy_in_default_stream": True,
            },
        ),
        CPU,
    ]


def test_tensorrt_and_cuda_together_keep_tensorrt_first() -> None:
    both = _trt("") + _cuda(_p("gpu_mem_limit", "64"))
    assert execution_providers(_config(both), "gpu", 0, ALL) == [
        (TENSORRT, {"device_id": 0}),
        (CUDA, {"device_id": 0, "gpu_mem_limit": 64}),
        CPU,
    ]


@pytest.mark.parametrize(
    ("accelerators", "available", "message"),
    [
        (_trt(""), [CUDA, CPU], "has no TensorRT execution provider"),
        ('gpu_execution_accelerator { name: "openvino" }', ALL, "unknown Execution Accelerator"),
        (_trt(_p("precision_mode", "FP8")), ALL, "precision_mode 'FP8' is not one of"),
        (_trt(_p("trt_fp16", "1")), ALL, "unknown parameter 'trt_fp16' for the tensorrt"),
        (_trt(_p("trt_min_subgraph_size", "x")), ALL, "'trt_min_subgraph_size' must be an int"),
        (_trt(_p("trt_engine_cache_enable", "maybe")), ALL, "must be true or false"),
        (
            _cuda(_p("cudnn_conv_algo_search", "7")),
            ALL,
            "'cudnn_conv_algo_search' must be one of 0, 1, 2, got 7",
        ),
    ],
)
def test_bad_accelerator_configs_name_model_and_key(
    accelerators: str, available: list[str], message: str
) -> None:
    with pytest.raises(KilnError, match=message) as info:
        execution_providers(_config(accelerators), "gpu", 0, available)
    assert "model 'm'" in info.value.message


def test_cuda_libraries_are_preloaded_once_per_process(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import kiln.backends.ort_providers as providers

    calls: list[str] = []

    class Ort:  # onnxruntime-gpu's preload_dlls, which needs NVIDIA's wheels to do anything
        @staticmethod
        def preload_dlls() -> None:
            calls.append("preload")
            raise OSError("libcudnn.so.9: cannot open shared object file")

    monkeypatch.setattr(providers, "_preloaded", False)
    providers.preload_cuda_libraries(Ort)
    providers.preload_cuda_libraries(Ort)
    assert calls == ["preload"]
    assert "preload_dlls() failed: libcudnn.so.9" in caplog.text
    # An onnxruntime before 1.21 has no preload_dlls: nothing to do, nothing raised.
    monkeypatch.setattr(providers, "_preloaded", False)
    providers.preload_cuda_libraries(object())
