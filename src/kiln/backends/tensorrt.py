"""TensorRT backend: serialized engines (``model.plan``) run with the TensorRT Python runtime.

tensorrt and torch (a CUDA build: it owns the device buffers and the streams) are imported
when an engine loads, not when this module is imported, so a machine without them gets a
refusal that says what is missing rather than an import error. Each instance holds one
execution context with its own CUDA stream; dynamic shapes go through the engine's
optimization profiles.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from kiln.backends.base import Backend, InstanceSpec
from kiln.backends.gpus import torch_gpu_count
from kiln.backends.tensorrt_plan import (
    DEFAULT_PLAN,
    TORCH_TYPES,
    TRT_TYPES,
    Profile,
    allowed_profiles,
    choose_profile,
    deserialize_error,
    engine_filename,
)
from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

log = logging.getLogger(__name__)

_INSTALL = "install kiln-serve[tensorrt] (the tensorrt package and a CUDA build of torch)"


def _modules(model: str) -> tuple[Any, Any]:
    """(tensorrt, torch), or one refusal naming everything this machine lacks."""
    missing = []
    torch: Any
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        missing.append(
            "an NVIDIA GPU, and this machine has no usable one (engines are GPU-specific: "
            "build and serve them on the GPU model they are for)"
        )
    trt: Any = None
    try:
        import tensorrt

        trt = tensorrt
    except ImportError as exc:
        missing.append(f"the TensorRT Python runtime ({exc}): {_INSTALL}")
    if missing:
        raise KilnError(
            f"model '{model}': the tensorrt backend needs " + "; and ".join(missing),
            Status.UNAVAILABLE,
        )
    return trt, torch


def _load_engine(config: ModelConfig, version_dir: Path, device_id: int) -> tuple[Any, Any]:
    """Deserialize the engine for this GPU's compute capability: (engine, its runtime)."""
    trt, torch = _modules(config.name)
    capability = torch.cuda.get_device_capability(device_id)
    filename = engine_filename(config, capability)
    path = version_dir / filename
    if not path.exists():
        raise KilnError(
            f"unable to load model '{config.name}': no engine file '{path}' (for this GPU, "
            f"compute capability {capability[0]}.{capability[1]})",
            Status.INVALID_ARG,
        )

    class _Collect(trt.ILogger):  # type: ignore[misc, name-defined]
        """Keeps TensorRT's errors so the refusal can quote them."""

        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.errors: list[str] = []

        def log(self, severity: Any, msg: str) -> None:
            if severity <= trt.ILogger.Severity.ERROR:
                self.errors.append(msg)

    logger = _Collect()
    with torch.cuda.device(device_id):
        runtime = trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(path.read_bytes())
    if engine is None:
        raise deserialize_error(config, filename, capability, logger.errors)
    return engine, runtime


def _io(trt: Any, engine: Any) -> tuple[list[str], list[str]]:
    names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
    inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
    return inputs, [n for n in names if n not in inputs]


def _config_type(model: str, engine: Any, name: str) -> int:
    dtype = engine.get_tensor_dtype(name).name
    if dtype not in TRT_TYPES:
        raise KilnError(
            f"model '{model}': engine tensor '{name}' has TensorRT type {dtype}, which has no "
            "config data type",
            Status.INVALID_ARG,
        )
    return TRT_TYPES[dtype]


class TensorRTBackend(Backend):
    name: ClassVar[str] = "tensorrt"
    platforms: ClassVar[tuple[str, ...]] = ("tensorrt_plan",)
    default_model_filename: ClassVar[str] = DEFAULT_PLAN

    @classmethod
    def gpu_count(cls) -> int:
        return torch_gpu_count()

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        if len(config.input) and len(config.output):
            return
        trt, _ = _modules(config.name)
        engine, _runtime = _load_engine(config, version_dir, 0)
        inputs, outputs = _io(trt, engine)
        profiles = engine.num_optimization_profiles
        # Batchable when every tensor's first dim is dynamic; the batch cap is the smallest
        # profile maximum of that dim over the inputs.
        batchable = all(engine.get_tensor_shape(n)[0] == -1 for n in [*inputs, *outputs])
        if config.max_batch_size == 0 and batchable and inputs:
            config.max_batch_size = min(
                max(engine.get_tensor_profile_shape(n, p)[2][0] for p in range(profiles))
                for n in inputs
            )
        skip = 1 if config.max_batch_size > 0 else 0
        for names, entries in ((inputs, config.input), (outputs, config.output)):
            if len(entries):
                continue
            for name in names:
                dims = list(engine.get_tensor_shape(name))[skip:] or [1]
                entries.add(name=name, data_type=_config_type(config.name, engine, name), dims=dims)

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        if instance.kind != "gpu":
            raise KilnError(
                f"model '{config.name}': the tensorrt backend runs only on GPUs; instance "
                f"group {instance.name} resolved to KIND_CPU because this machine has no "
                "usable NVIDIA GPU",
                Status.UNAVAILABLE,
            )
        self.trt, self.torch = _modules(config.name)
        self.device = self.torch.device("cuda", instance.device_id)
        self.engine, self._runtime = _load_engine(config, version_dir, instance.device_id)
        self.inputs, self.outputs = _io(self.trt, self.engine)
        self._types = {
            n: getattr(self.torch, TORCH_TYPES[self.engine.get_tensor_dtype(n).name])
            for n in [*self.inputs, *self.outputs]
            if self.engine.get_tensor_dtype(n).name in TORCH_TYPES
        }
        for tensor in [*config.input, *config.output]:
            if tensor.name not in self.inputs and tensor.name not in self.outputs:
                raise KilnError(
                    f"model '{config.name}': the engine has no tensor '{tensor.name}' "
                    f"(inputs {', '.join(self.inputs)}; outputs {', '.join(self.outputs)})",
                    Status.INVALID_ARG,
                )
            actual = _config_type(config.name, self.engine, tensor.name)
            if actual != tensor.data_type:
                raise KilnError(
                    f"model '{config.name}': tensor '{tensor.name}' is "
                    f"{PbDataType.Name(actual)} in the engine but "
                    f"{PbDataType.Name(tensor.data_type)} in the config",
                    Status.INVALID_ARG,
                )
        group = _group(config, instance.name)
        indices = allowed_profiles(
            config.name, list(group.profile) if group else [], self.engine.num_optimization_profiles
        )
        self.profiles = [Profile(p, self._bounds(p)) for p in indices]
        with self.torch.cuda.device(self.device):
            self.stream = self.torch.cuda.Stream(self.device)
            self.context = self.engine.create_execution_context()
        self.profile = -1

    def _bounds(self, profile: int) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        bounds = {}
        for name in self.inputs:
            low, _opt, high = self.engine.get_tensor_profile_shape(name, profile)
            bounds[name] = (tuple(low), tuple(high))
        return bounds

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        torch, ctx = self.torch, self.context
        profile = choose_profile(
            self.config.name, self.profiles, {n: tuple(v.shape) for n, v in inputs.items()}
        )
        keep = []  # device tensors must outlive the asynchronous run
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            if profile.index != self.profile:
                ctx.set_optimization_profile_async(profile.index, self.stream.cuda_stream)
                self.profile = profile.index
            for name in self.inputs:
                host = torch.from_numpy(np.ascontiguousarray(inputs[name]))
                # BF16 arrives held as float32 (kiln.core.types): the cast is exact.
                tensor = host.to(self.device, dtype=self._types[name])
                ctx.set_input_shape(name, tuple(tensor.shape))
                ctx.set_tensor_address(name, tensor.data_ptr())
                keep.append(tensor)
            results = {}
            for name in self.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                out = torch.empty(shape, dtype=self._types[name], device=self.device)
                ctx.set_tensor_address(name, out.data_ptr())
                results[name] = out
            if not ctx.execute_async_v3(self.stream.cuda_stream):
                raise KilnError(
                    f"model '{self.config.name}' failed to execute: TensorRT rejected the run",
                    Status.INTERNAL,
                )
            fetched = {n: _to_host(torch, results[n]) for n in output_names}
        self.stream.synchronize()
        return fetched

    def close(self) -> None:
        del self.context
        del self.engine


def _to_host(torch: Any, tensor: Any) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.float()  # NumPy has no bfloat16; kiln holds BF16 as float32
    array: np.ndarray = tensor.cpu().numpy()
    return array


def _group(config: ModelConfig, name: str) -> Any:
    for index, group in enumerate(config.instance_group):
        if (group.name or f"{config.name}_{index}") == name:
            return group
    return None
