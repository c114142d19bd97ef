"""ONNX Runtime backend: the embedded default engine.

Each instance owns one ``InferenceSession``; ``session.run`` releases the GIL, so N
instances on N threads compute in parallel.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import onnxruntime as ort

from kiln.backends.base import Backend, InstanceSpec, cpu_count, parameter
from kiln.backends.gpus import visible_gpu_count
from kiln.backends.ort_providers import (
    check_session_providers,
    execution_providers,
    preload_cuda_libraries,
)
from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

log = logging.getLogger(__name__)

# ONNX tensor type strings as onnxruntime reports them -> config data types.
_ORT_TYPES = {
    "tensor(bool)": PbDataType.TYPE_BOOL,
    "tensor(uint8)": PbDataType.TYPE_UINT8,
    "tensor(uint16)": PbDataType.TYPE_UINT16,
    "tensor(uint32)": PbDataType.TYPE_UINT32,
    "tensor(uint64)": PbDataType.TYPE_UINT64,
    "tensor(int8)": PbDataType.TYPE_INT8,
    "tensor(int16)": PbDataType.TYPE_INT16,
    "tensor(int32)": PbDataType.TYPE_INT32,
    "tensor(int64)": PbDataType.TYPE_INT64,
    "tensor(float16)": PbDataType.TYPE_FP16,
    "tensor(float)": PbDataType.TYPE_FP32,
    "tensor(double)": PbDataType.TYPE_FP64,
    "tensor(string)": PbDataType.TYPE_STRING,
    "tensor(bfloat16)": PbDataType.TYPE_BF16,
}

_ONNX_BFLOAT16 = 16  # onnx._ONNX_BFLOAT16, without importing onnx for one number

# Triton's ORT backend: optimization.graph.level -1 = basic, 1 = extended, else all.
_GRAPH_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def _dims(shape: list[Any]) -> list[int]:
    return [d if isinstance(d, int) and d >= 0 else -1 for d in shape]


class OnnxRuntimeBackend(Backend):
    name: ClassVar[str] = "onnxruntime"
    platforms: ClassVar[tuple[str, ...]] = ("onnxruntime_onnx",)
    default_model_filename: ClassVar[str] = "model.onnx"

    @classmethod
    def gpu_count(cls) -> int:
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            return 0
        # The driver decides, not the provider list: onnxruntime-gpu names CUDA on a machine
        # with no GPU at all, and KIND_AUTO must then fall back to the CPU, as on Triton.
        return visible_gpu_count()

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        if len(config.input) and len(config.output):
            return  # Triton skips auto-complete when both are given
        path = version_dir / (config.default_model_filename or cls.default_model_filename)
        try:
            session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise KilnError(f"unable to load model '{path}': {exc}", Status.INVALID_ARG) from exc
        ins, outs = session.get_inputs(), session.get_outputs()
        batchable = all(len(t.shape) > 0 and _dims(t.shape)[0] == -1 for t in [*ins, *outs])
        if config.max_batch_size == 0 and batchable:
            config.max_batch_size = 4  # Triton's default-max-batch-size
            log.warning(
                "model '%s': auto-completed max_batch_size to 4 (set it in config.pbtxt)",
                config.name,
            )
        if config.max_batch_size > 0 and not batchable:
            # Stripping a fixed first dim as "batch" would give the client the wrong shapes.
            fixed = [t.name for t in [*ins, *outs] if not t.shape or _dims(t.shape)[0] != -1]
            raise KilnError(
                f"unable to autofill for '{config.name}': configuration specified "
                f"max_batch_size {config.max_batch_size}, but the model does not support "
                f"batching: {', '.join(repr(n) for n in fixed)} lack a variable first dimension",
                Status.INVALID_ARG,
            )
        skip = 1 if config.max_batch_size > 0 else 0
        if not len(config.input):
            built = {target for b in config.batch_input for target in b.target_name}
            for t in (t for t in ins if t.name not in built):  # batch inputs are kiln's
                _add_tensor(config.input.add(name=t.name, data_type=_ORT_TYPES[t.type]), t, skip)
        if not len(config.output):
            for t in outs:
                _add_tensor(config.output.add(name=t.name, data_type=_ORT_TYPES[t.type]), t, skip)

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        options = ort.SessionOptions()
        intra = parameter(config, "intra_op_thread_count")
        if intra is not None:
            options.intra_op_num_threads = int(intra)
        else:
            # N instances share the cores instead of each spawning one thread per core.
            options.intra_op_num_threads = max(1, cpu_count() // instance.total_instances)
        inter = parameter(config, "inter_op_thread_count")
        if inter is not None:
            options.inter_op_num_threads = int(inter)
        if parameter(config, "execution_mode") == "1":
            options.execution_mode = ort.ExecutionMode.ORT_PARALLEL
        if parameter(config, "enable_mem_arena") == "0":
            options.enable_cpu_mem_arena = False
        if parameter(config, "enable_mem_pattern") == "0":
            options.enable_mem_pattern = False
        # ORT's pool threads spin after each run by default; on a server that shares its
        # cores with the front end that spinning steals the CPU the next request needs
        # (measured: benchmarks/HISTORY.md). Opt back in with parameters allow_spinning "1".
        spinning = parameter(config, "allow_spinning", "0")
        options.add_session_config_entry("session.intra_op.allow_spinning", spinning)
        options.add_session_config_entry("session.inter_op.allow_spinning", spinning)
        options.graph_optimization_level = self._graph_level(config)
        providers = execution_providers(
            config, instance.kind, instance.device_id, ort.get_available_providers()
        )
        if instance.kind == "gpu":
            preload_cuda_libraries(ort)
        self.session = ort.InferenceSession(
            str(self.model_path()), sess_options=options, providers=providers
        )
        check_session_providers(
            config.name, instance.device_id, providers, self.session.get_providers()
        )
        # Only CPU work may run inline on the loop: a GPU run waits on the device.
        self.inline_capable = self.session.get_providers() == ["CPUExecutionProvider"]
        self._string_inputs = {
            i.name for i in self.session.get_inputs() if i.type == "tensor(string)"
        }
        self._string_outputs = {
            o.name for o in self.session.get_outputs() if o.type == "tensor(string)"
        }
        self._bf16_inputs = {
            i.name for i in self.session.get_inputs() if i.type == "tensor(bfloat16)"
        }
        self._bf16_outputs = {
            o.name for o in self.session.get_outputs() if o.type == "tensor(bfloat16)"
        }
        if self._bf16_outputs and self._string_inputs:
            # BF16 outputs need IO binding (session.run cannot hand them back), and IO
            # binding takes no string tensors: refuse at load rather than on every request.
            raise KilnError(
                f"model '{config.name}': the onnxruntime backend cannot run a model with both "
                f"STRING inputs ({', '.join(sorted(self._string_inputs))}) and BF16 outputs "
                f"({', '.join(sorted(self._bf16_outputs))}): onnxruntime's Python API binds "
                "no string tensors",
                Status.INVALID_ARG,
            )

    @staticmethod
    def _graph_level(config: ModelConfig) -> ort.GraphOptimizationLevel:
        named = parameter(config, "graph_optimization_level")
        if named is not None:
            if named not in _GRAPH_LEVELS:
                raise KilnError(
                    f"parameter graph_optimization_level must be one of {sorted(_GRAPH_LEVELS)}"
                )
            return _GRAPH_LEVELS[named]
        level = config.optimization.graph.level
        if level == -1:
            return _GRAPH_LEVELS["basic"]
        if level == 1:
            return _GRAPH_LEVELS["extended"]
        return _GRAPH_LEVELS["all"]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        feed: dict[str, Any] = {}
        for name, value in inputs.items():
            if name in self._string_inputs:
                # ORT stringifies bytes objects as "b'..'": hand it str, keep bytes outside.
                value = np.vectorize(_to_str, otypes=[object])(value) if value.size else value
            elif name in self._bf16_inputs:
                # kiln holds BF16 as float32; ORT takes the raw 16-bit pattern as an OrtValue.
                value = ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
                    _fp32_to_bf16_bits(value), _ONNX_BFLOAT16
                )
            feed[name] = value
        if self._bf16_outputs.intersection(output_names):
            results = self._run_bound(feed, output_names)
        else:
            results = self.session.run(output_names, feed)
        out = {}
        for name, value in zip(output_names, results, strict=True):
            if name in self._string_outputs:
                value = np.vectorize(_to_bytes, otypes=[object])(value) if value.size else value
            out[name] = value
        return out

    def _run_bound(self, feed: dict[str, Any], output_names: list[str]) -> list[np.ndarray]:
        """Run through IO binding: ``session.run`` cannot turn a BF16 output into NumPy."""
        binding = self.session.io_binding()
        for name, value in feed.items():
            if isinstance(value, ort.OrtValue):
                binding.bind_ortvalue_input(name, value)
            else:
                binding.bind_cpu_input(name, value)
        for name in output_names:
            binding.bind_output(name, "cpu")  # host memory, so the bits can be read back
        self.session.run_with_iobinding(binding)
        results = []
        for name, value in zip(output_names, binding.get_outputs(), strict=True):
            if name in self._bf16_outputs:
                results.append(_bf16_bits_to_fp32(_ortvalue_uint16(value)))
            else:
                results.append(value.numpy())
        return results

    def close(self) -> None:
        del self.session


def _add_tensor(entry: Any, tensor: Any, skip: int) -> None:
    dims = _dims(tensor.shape)[skip:]
    if dims:
        entry.dims.extend(dims)
    else:
        # Triton: a rank-0 tensor (after the batch dim) is dims [1] for the client and an
        # empty reshape for the model, which receives [batch] (or a scalar).
        entry.dims.append(1)
        entry.reshape.SetInParent()


def _fp32_to_bf16_bits(data: np.ndarray) -> np.ndarray:
    """Truncate float32 to its high 16 bits, as the wire codecs (and tritonclient) do."""
    bits = np.ascontiguousarray(data, dtype=np.float32).view(np.uint32)
    return (bits >> 16).astype(np.uint16)


def _bf16_bits_to_fp32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _ortvalue_uint16(value: ort.OrtValue) -> np.ndarray:
    """Copy a 16-bit tensor out of host memory: NumPy has no bfloat16 for ``.numpy()``."""
    shape = tuple(value.shape())
    count = value.tensor_size_in_bytes() // 2
    if count == 0:
        return np.zeros(shape, dtype=np.uint16)
    buffer = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(buffer).copy().reshape(shape)


def _to_str(value: Any) -> Any:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def _to_bytes(value: Any) -> Any:
    return value.encode("utf-8", "surrogateescape") if isinstance(value, str) else value
