"""kiln optimize's GPU side, as far as it runs without a GPU: skip reasons, the FP16 model,
engine profiles, and the repository entries GPU candidates are written as."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln.backends.ort_providers import CPU, CUDA, TENSORRT, execution_providers
from kiln.config.loader import parse_config_text
from kiln.examples.models import build_mlp
from kiln.optimize import gpu
from kiln.optimize.deploy import config_text
from kiln.optimize.precision import build_fp16
from kiln.optimize.trt_engine import profile_shapes
from kiln.optimize.types import Candidate
from tests.conftest import DigitsFiles

EVERYTHING = gpu.GpuFacts(
    providers=(TENSORRT, CUDA, CPU), nvml=None, tensorrt="10.9.0", torch_cuda=None,
    fp16_converter=None,
)  # fmt: skip


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    onnx.save_model(build_mlp(), path)
    return path


def test_cpu_device_skips_every_gpu_candidate_with_the_reason() -> None:
    reasons = gpu.skip_reasons("cpu", None)
    assert set(reasons) == {c.name for c in gpu.GPU_CANDIDATES}
    assert set(reasons.values()) == {gpu.CPU_REASON}


def test_a_machine_with_everything_builds_every_gpu_candidate() -> None:
    assert set(gpu.skip_reasons("cuda", EVERYTHING).values()) == {None}


@pytest.mark.parametrize(
    ("change", "candidate", "reason"),
    [
        ({"providers": (CPU,)}, "ort-cuda",
         "onnxruntime has no CUDAExecutionProvider (install kiln-serve[gpu])"),
        ({"providers": (CUDA, CPU)}, "ort-tensorrt-fp16",
         "onnxruntime has no TensorrtExecutionProvider (onnxruntime-gpu with the TensorRT "
         "libraries)"),
        ({"tensorrt": None}, "tensorrt-int8-qdq",
         "tensorrt not installed (install kiln-serve[tensorrt])"),
        ({"tensorrt": "8.6.1"}, "tensorrt-fp32",
         "tensorrt 8.6.1 is too old: strongly typed networks need TensorRT >= 10"),
        ({"nvml": "no NVIDIA GPU visible to NVML (Driver Not Loaded)"}, "fp16",
         "no NVIDIA GPU visible to NVML (Driver Not Loaded)"),
        ({"torch_cuda": "torch sees no CUDA device"}, "tensorrt-fp16", "torch sees no CUDA device"),
    ],
)  # fmt: skip
def test_each_missing_piece_is_named(change: dict[str, object], candidate: str,
                                     reason: str) -> None:  # fmt: skip
    facts = gpu.GpuFacts(**{**_facts_dict(EVERYTHING), **change})  # type: ignore[arg-type]
    reasons = gpu.skip_reasons("cuda", facts)
    assert reasons[candidate] == reason
    # What one candidate lacks does not skip those that do not need it.
    if "providers" in change:
        assert reasons["tensorrt-fp32"] is None
    if "tensorrt" in change:
        assert reasons["ort-cuda"] is None


def _facts_dict(facts: gpu.GpuFacts) -> dict[str, object]:
    return {k: getattr(facts, k) for k in gpu.GpuFacts.__slots__}  # type: ignore[attr-defined]


def test_this_machine_reasons_are_precise() -> None:
    facts = gpu.probe()
    reasons = gpu.skip_reasons("cuda", facts)
    if CUDA not in ort.get_available_providers():
        assert "onnxruntime has no CUDAExecutionProvider (install kiln-serve[gpu])" in (
            reasons["ort-cuda"] or ""
        )
    if facts.tensorrt is None:
        assert "tensorrt not installed" in (reasons["tensorrt-fp32"] or "")
    if facts.nvml is not None:
        assert facts.nvml.startswith(("nvidia-ml-py is not installed", "no NVIDIA GPU visible"))
        assert all(facts.nvml in (r or "") for r in reasons.values())


def test_fp16_model_keeps_float32_io_and_matches(mlp: Path, tmp_path: Path) -> None:
    path = build_fp16(mlp, tmp_path, "fp16", keep_io_types=True)
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    elem = onnx.TensorProto
    assert {i.type.tensor_type.elem_type for i in model.graph.input} == {elem.FLOAT}
    assert {o.type.tensor_type.elem_type for o in model.graph.output} == {elem.FLOAT}
    assert {w.data_type for w in model.graph.initializer if w.dims} == {elem.FLOAT16}
    # ONNX Runtime's CPU provider has float16 kernels for these ops: the model really runs.
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    name = model.graph.input[0].name
    fp32 = ort.InferenceSession(str(mlp)).run(None, {name: x})[0]
    fp16 = ort.InferenceSession(str(path)).run(None, {name: x})[0]
    assert fp16.dtype == np.float32
    np.testing.assert_allclose(fp16, fp32, rtol=2e-2, atol=2e-2)


def test_fp16_model_without_kept_io_is_float16(mlp: Path, tmp_path: Path) -> None:
    model = onnx.load(str(build_fp16(mlp, tmp_path, "fp16-io", keep_io_types=False)))
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16


def test_engine_profile_spans_the_batch_sizes() -> None:
    assert profile_shapes([32, 1, 8], (1, 8, 8)) == ((1, 1, 8, 8), (8, 1, 8, 8), (32, 1, 8, 8))
    assert profile_shapes([4], (64,)) == ((4, 64), (4, 64), (4, 64))


def test_tensorrt_engine_entry(mlp: Path) -> None:
    engine = Candidate("tensorrt-int8-qdq", "tensorrt", "engine", runtime="tensorrt",
                       path=Path("model.plan"), built_from=mlp)  # fmt: skip
    text = config_text("digits", engine, 32, 1)
    config = parse_config_text(text)
    assert config.platform == "tensorrt_plan" and config.max_batch_size == 32
    assert config.instance_group[0].kind == config.instance_group[0].KIND_GPU
    assert [i.name for i in config.input] == [i.name for i in onnx.load(str(mlp)).graph.input]
    assert "optimization" not in text  # ONNX Runtime's settings mean nothing to a plan


def test_ort_tensorrt_entry_gives_the_measured_providers(mlp: Path, tmp_path: Path) -> None:
    c = Candidate("ort-tensorrt-fp16", "ort-trt", "d", runtime="ort-tensorrt", precision="fp16",
                  path=mlp)  # fmt: skip
    config = parse_config_text(config_text("m", c, 8, 1, cache_dir=tmp_path / "cache"))
    providers = execution_providers(config, "gpu", 0, [TENSORRT, CUDA, CPU])
    name, options = providers[0]  # type: ignore[misc]
    assert name == TENSORRT
    assert options["trt_fp16_enable"] is True
    assert options["trt_engine_cache_enable"] is True
    assert options["trt_engine_cache_path"] == str((tmp_path / "cache").resolve())
    assert [p[0] if isinstance(p, tuple) else p for p in providers[1:]] == [CUDA, CPU]


@pytest.mark.parametrize("per_channel", [False, True])
def test_int32_biases_are_folded_for_tensorrt_and_nothing_else_changes(
    digits_files: DigitsFiles, tmp_path: Path, per_channel: bool
) -> None:
    """TensorRT's ONNX parser refuses an INT32 DequantizeLinear (quantize_static's bias
    form): the TensorRT INT8 candidate is built from a copy with those biases in float."""
    from kiln.optimize.precision import build_int8_static, fold_int32_bias

    source = digits_files.mlp_onnx  # torch's export: Gemm layers, whose biases go INT32
    name = onnx.load(str(source)).graph.input[0].name
    samples = np.load(digits_files.calibration).astype(np.float32)
    qdq = build_int8_static(source, tmp_path, {name: samples}, "minmax", per_channel).path
    assert qdq is not None

    def int32_dequantize(model: onnx.ModelProto) -> list[str]:
        int32 = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT32}
        return [n.name for n in model.graph.node
                if n.op_type == "DequantizeLinear" and n.input[0] in int32]  # fmt: skip

    original = onnx.load(str(qdq))
    assert int32_dequantize(original), "quantize_static no longer writes INT32 biases"
    folded_path = fold_int32_bias(qdq, tmp_path / "int8-trt.onnx")
    folded = onnx.load(str(folded_path))
    onnx.checker.check_model(folded, full_check=True)
    assert int32_dequantize(folded) == []
    # every other QDQ node is still there: only the bias dequantizations went
    kinds = [n.op_type for n in folded.graph.node]
    assert kinds.count("QuantizeLinear") == [n.op_type for n in original.graph.node].count(
        "QuantizeLinear"
    )
    assert len(folded.graph.node) == len(original.graph.node) - len(int32_dequantize(original))
    x = {name: samples[:16]}
    run = [
        ort.InferenceSession(str(p), providers=["CPUExecutionProvider"]).run(None, x)
        for p in (qdq, folded_path)
    ]
    for before, after in zip(*run, strict=True):
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)
