"""PyTorch backend: TorchScript (``model.pt``) and ``torch.export`` programs (``model.pt2``).

Importing this module imports torch; the registry turns a missing torch into
"install kiln-serve[torch]". Each instance holds its own copy of the module on its device
(``cpu`` or ``cuda:<device_id>``) and, on a GPU, its own CUDA stream.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from kiln.backends.base import Backend, InstanceSpec, count_parameter, parameter
from kiln.backends.gpus import torch_gpu_count
from kiln.backends.torch_io import Binding, bind_inputs, bind_outputs
from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType

log = logging.getLogger(__name__)

TORCHSCRIPT_FILE = "model.pt"
EXPORTED_FILE = "model.pt2"

# Config data types -> torch dtypes. BF16 arrives held as float32 (see kiln.core.types)
# and is cast to torch.bfloat16 exactly: its low 16 bits are already zero.
_TORCH_TYPES: dict[DataType, torch.dtype] = {
    DataType.BOOL: torch.bool,
    DataType.UINT8: torch.uint8,
    DataType.UINT16: torch.uint16,
    DataType.UINT32: torch.uint32,
    DataType.UINT64: torch.uint64,
    DataType.INT8: torch.int8,
    DataType.INT16: torch.int16,
    DataType.INT32: torch.int32,
    DataType.INT64: torch.int64,
    DataType.FP16: torch.float16,
    DataType.FP32: torch.float32,
    DataType.FP64: torch.float64,
    DataType.BF16: torch.bfloat16,
}


def _flag(config: ModelConfig, key: str) -> bool | None:
    value = parameter(config, key)
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


class PyTorchBackend(Backend):
    name: ClassVar[str] = "pytorch"
    platforms: ClassVar[tuple[str, ...]] = ("pytorch_libtorch",)
    default_model_filename: ClassVar[str] = TORCHSCRIPT_FILE

    @classmethod
    def gpu_count(cls) -> int:
        return torch_gpu_count()

    @classmethod
    def auto_complete_config(cls, config: ModelConfig, version_dir: Path) -> None:
        # A folder holding only a torch.export program needs no default_model_filename.
        if (
            config.default_model_filename == TORCHSCRIPT_FILE
            and not (version_dir / TORCHSCRIPT_FILE).exists()
            and (version_dir / EXPORTED_FILE).exists()
        ):
            config.default_model_filename = EXPORTED_FILE
        if not len(config.input) or not len(config.output):
            # TorchScript records no dtypes or shapes, so there is nothing to fill from.
            raise KilnError(
                f"model '{config.name}': the pytorch backend cannot auto-complete inputs and "
                "outputs; declare every input and output in config.pbtxt",
                Status.INVALID_ARG,
            )

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        name = config.name
        for tensor in [*config.input, *config.output]:
            datatype = DataType.from_config(_type_name(tensor.data_type))
            if datatype not in _TORCH_TYPES:
                raise KilnError(
                    f"model '{name}': the pytorch backend does not support "
                    f"{datatype.config_name} tensors ('{tensor.name}')",
                    Status.INVALID_ARG,
                )
        self.device = self._device(config, instance)
        _apply_threads(config)
        self._optimized = not _flag(config, "DISABLE_OPTIMIZED_EXECUTION")
        self._profiling = _flag(config, "ENABLE_JIT_PROFILING")
        # INFERENCE_MODE "false" falls back to no_grad, for models that keep tensors alive.
        self._inference_mode = _flag(config, "INFERENCE_MODE") is not False
        path = self.model_path()
        self.module, arg_names = _load(name, path, self.device)
        self.inputs: Binding = bind_inputs(name, [t.name for t in config.input], arg_names)
        self.outputs: Binding = bind_outputs(name, [t.name for t in config.output])
        self._in_types = {
            t.name: _TORCH_TYPES[DataType.from_config(_type_name(t.data_type))]
            for t in config.input
        }
        self._out_types = {
            t.name: _TORCH_TYPES[DataType.from_config(_type_name(t.data_type))]
            for t in config.output
        }
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]
        # A lone request's short CPU call runs on the event loop's thread (``Instance``):
        # the two thread hand-offs cost more than a small model's compute. Under load the
        # instance's thread computes while the loop serves the other requests
        # (benchmarks/HISTORY.md, "PyTorch backend").
        self.inline_capable = self.device.type == "cpu"
        self.inline_only_alone = True
        log.info(
            "model '%s': %s on %s, inputs by %s, outputs by %s",
            name,
            path.name,
            self.device,
            self.inputs.convention,
            self.outputs.convention,
        )

    @staticmethod
    def _device(config: ModelConfig, instance: InstanceSpec) -> torch.device:
        if instance.kind != "gpu":
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise KilnError(
                f"model '{config.name}' asks for KIND_GPU but this torch build has no CUDA "
                f"(torch {torch.__version__}); install a CUDA build of torch on a machine "
                "with an NVIDIA GPU",
                Status.UNAVAILABLE,
            )
        if instance.device_id >= torch.cuda.device_count():
            raise KilnError(
                f"model '{config.name}': instance group {instance.name} asks for GPU "
                f"{instance.device_id}, but torch sees {torch.cuda.device_count()} GPU(s)",
                Status.INVALID_ARG,
            )
        return torch.device("cuda", instance.device_id)

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        grad = torch.inference_mode() if self._inference_mode else torch.no_grad()
        stream = torch.cuda.stream(self.stream) if self.stream else contextlib.nullcontext()
        with grad, stream, torch.jit.optimized_execution(self._optimized):  # type: ignore[attr-defined]
            if self._profiling is not None:
                torch._C._jit_set_profiling_executor(self._profiling)
            args = [self._tensor(n, inputs[n]) for n in self.inputs.names]
            result = self.module(*args)
            out = self._collect(result, output_names)
        if self.stream is not None:
            self.stream.synchronize()
        return out

    def _tensor(self, name: str, value: np.ndarray) -> torch.Tensor:
        dtype = self._in_types[name]
        if dtype is torch.bfloat16:
            tensor = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
        else:
            # from_numpy shares the buffer; a read-only buffer (from the wire) is copied
            # because torch may not alias memory it cannot write.
            array = value if value.flags.writeable else value.copy()
            tensor = torch.from_numpy(np.ascontiguousarray(array))
        return tensor.to(device=self.device, dtype=dtype)

    def _collect(self, result: Any, output_names: list[str]) -> dict[str, np.ndarray]:
        if isinstance(result, dict):
            by_name = result
        else:
            values = list(result) if isinstance(result, list | tuple) else [result]
            if len(values) != len(self.outputs.names):
                raise KilnError(
                    f"model '{self.config.name}' returned {len(values)} tensor(s), but its "
                    f"config declares {len(self.outputs.names)} output(s) "
                    f"({', '.join(self.outputs.names)})",
                    Status.INTERNAL,
                )
            by_name = dict(zip(self.outputs.names, values, strict=True))
        out = {}
        for name in output_names:
            value = by_name.get(name)
            if not isinstance(value, torch.Tensor):
                raise KilnError(
                    f"model '{self.config.name}' did not produce output '{name}' as a tensor "
                    f"(got {type(value).__name__})",
                    Status.INTERNAL,
                )
            if value.dtype != self._out_types[name]:
                raise KilnError(
                    f"model '{self.config.name}' produced output '{name}' as {value.dtype}, "
                    f"but its config declares {self._out_types[name]}",
                    Status.INTERNAL,
                )
            if value.dtype is torch.bfloat16:
                value = value.float()  # kiln holds BF16 as float32; NumPy has no bfloat16
            out[name] = value.detach().cpu().numpy()
        return out

    def close(self) -> None:
        del self.module
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _type_name(data_type: int) -> str:
    return str(PbDataType.Name(data_type))


def _load(model: str, path: Path, device: torch.device) -> tuple[Any, list[str] | None]:
    """The callable module and its positional argument names (None when unknown)."""
    if not path.exists():
        raise KilnError(f"unable to load model '{model}': no file '{path}'", Status.INVALID_ARG)
    try:
        if path.suffix == ".pt2":
            program = torch.export.load(str(path))
            names = [
                spec.arg.name
                for spec in program.graph_signature.input_specs
                if spec.kind == torch.export.graph_signature.InputKind.USER_INPUT
            ]
            if device.type != "cpu":
                from torch.export.passes import move_to_device_pass

                # .module().to() moves parameters and buffers only: lifted tensor constants
                # and the device burnt into factory ops (torch.ones(n) exported on the CPU
                # records device="cpu") stay behind; torch's pass moves them all.
                program = move_to_device_pass(program, device)
            module = program.module().to(device)
            return module, names
        script = torch.jit.load(str(path), map_location=device)  # type: ignore[no-untyped-call]
        script.eval()
        schema = script.forward.schema
        return script, [a.name for a in schema.arguments[1:]]  # [0] is self
    except KilnError:
        raise
    except Exception as exc:  # torch raises RuntimeError / pickle errors for bad files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KilnError(
            f"unable to load model '{model}' from {path.name}: {reason}", Status.INVALID_ARG
        ) from exc


def _apply_threads(config: ModelConfig) -> None:
    """Triton's thread keys. Torch's thread pools are per process: the last load wins."""
    intra = count_parameter(config, "INTRA_OP_THREAD_COUNT")
    if intra:
        torch.set_num_threads(intra)
    inter = count_parameter(config, "INTER_OP_THREAD_COUNT")
    if inter and torch.get_num_interop_threads() != inter:
        try:
            torch.set_num_interop_threads(inter)
        except RuntimeError:
            # torch fixes the inter-op pool once any parallel work has run in the process.
            log.warning(
                "model '%s': INTER_OP_THREAD_COUNT %s ignored, torch's inter-op pool is "
                "already running with %d threads",
                config.name,
                inter,
                torch.get_num_interop_threads(),
            )
