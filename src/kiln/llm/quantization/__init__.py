"""Quantized checkpoints (vLLM's ``--quantization``): FP8, INT8 (compressed-tensors), AWQ
and GPTQ int4, driven by ``config.json``'s ``quantization_config``.

The model is built as usual; ``apply`` then swaps each projection the checkpoint holds
quantized for a ``CheckpointLinear`` with the checkpoint's own tensor names, so the usual
loader fills it; ``finalize`` turns those into the modules that compute
(``linear.py``), before the model fuses its projections.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.quantization.config import METHODS, QuantConfig, check_requested, parse
from kiln.llm.quantization.gguf_blocks import BLOCKS
from kiln.llm.quantization.linear import CheckpointLinear

__all__ = ["METHODS", "QuantConfig", "apply", "finalize", "tensor_info"]

log = logging.getLogger(__name__)

_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
#: a projection holding one of these is quantized
_MARKERS = ("weight_scale", "weight_scale_inv", "qweight")
#: what each kind of quantized projection must hold
_REQUIRED: dict[str, tuple[tuple[str, ...], ...]] = {
    "fp8": (("weight",), ("weight_scale", "weight_scale_inv")),
    "int8": (("weight",), ("weight_scale",)),
    "int4": (("qweight",), ("qzeros",), ("scales",)),
}
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)

TensorInfo = dict[str, tuple[tuple[int, ...], torch.dtype]]


def tensor_info(files: list[Path]) -> TensorInfo:
    """Every tensor's shape and dtype, from the safetensors headers (no data read)."""
    out: TensorInfo = {}
    for path in files:
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header: dict[str, Any] = json.loads(f.read(size))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(meta["dtype"])
            if dtype is None:
                raise KilnError(
                    f"llm backend: {path}: tensor {name} has dtype {meta['dtype']}",
                    Status.INVALID_ARG,
                )
            out[name] = (tuple(meta["shape"]), dtype)
    return out


def apply(
    model: nn.Module,
    checkpoint: Any,
    requested: str,
    dtype: torch.dtype,
    device: torch.device,
) -> QuantConfig | None:
    """Swap the projections the checkpoint holds quantized for ``CheckpointLinear``s (before
    loading); the checkpoint's quantization, or None."""
    if hasattr(checkpoint, "quantized_weights"):
        return _apply_gguf(model, checkpoint, requested, dtype, device)
    where = str(checkpoint.path)
    quant = parse(checkpoint.config(), where)
    check_requested(requested, quant, where)
    if quant is None:
        return None
    info = tensor_info(checkpoint.weight_files())
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        prefix = name + "."
        own = {
            k[len(prefix) :]: v
            for k, v in info.items()
            if k.startswith(prefix) and "." not in k[len(prefix) :]
        }
        layer = f"{where}: {name}"
        if not any(m in own for m in _MARKERS):
            weight = own.get("weight")
            if weight is not None and weight[1] in _QUANTIZED_DTYPES:
                raise KilnError(
                    f"llm backend: {layer} holds a {weight[1]} weight but no weight_scale",
                    Status.INVALID_ARG,
                )
            if quant.weights == "int4" and ("scales" in own or "qzeros" in own):
                raise KilnError(f"llm backend: {layer} has no qweight", Status.INVALID_ARG)
            continue
        if ".experts." in f".{name}.":
            # the experts' matrices are stacked into one grouped matmul at load (moe.py),
            # which takes float weights only: refused here rather than failing mid-load
            raise KilnError(
                f"llm backend: {layer}: quantized Mixture-of-Experts experts ({quant.method}) "
                "are not supported; serve the unquantized checkpoint",
                Status.INVALID_ARG,
            )
        for options in _REQUIRED[quant.weights]:
            if not any(o in own for o in options):
                raise KilnError(
                    f"llm backend: {layer} ({quant.method}) has no {' or '.join(options)}",
                    Status.INVALID_ARG,
                )
        if module.bias is not None and "bias" not in own:
            own["bias"] = ((module.out_features,), dtype)  # reported missing at load
        holder = CheckpointLinear(
            layer, module.in_features, module.out_features, own, quant, dtype, device
        )
        model.set_submodule(name, holder)
        swapped += 1
    if not swapped:
        raise KilnError(
            f"llm backend: {where}: quantization_config says {quant.method} but no layer holds "
            "quantized tensors",
            Status.INVALID_ARG,
        )
    log.info("llm: %s: %d projections quantized (%s)", where, swapped, quant.method)
    return quant


def _apply_gguf(
    model: nn.Module, checkpoint: Any, requested: str, dtype: torch.dtype, device: torch.device
) -> QuantConfig:
    """A GGUF file (vLLM's method ``gguf``): served in bfloat16, its 4-bit projections stay
    packed (the int4 kernel reads their blocks exactly); other types, and every type in
    another dtype, are dequantized at load as before (no torch kernel takes Q8_0's or the
    other K-quants' blocks)."""
    where = str(checkpoint.path)
    quant = QuantConfig("gguf", "gguf", group_size=32)
    check_requested(requested, quant, where)
    if dtype != torch.bfloat16:
        # the kernel rounds activations to bf16: a float32 (the CPU default) or float16
        # model keeps the exact dequantized weights, as before (token-identical with
        # transformers on real files)
        return quant
    stored = checkpoint.quantized_weights()
    kept = 0
    for name, module in list(model.named_modules()):
        entry = stored.get(f"{name}.weight")
        if type(module) is not nn.Linear or entry is None or entry[0] not in BLOCKS:
            continue
        kind, shape = entry
        if module.in_features % BLOCKS[kind][0]:
            continue
        own: TensorInfo = {"weight": (shape, torch.uint8)}
        if module.bias is not None:
            own["bias"] = ((module.out_features,), dtype)
        holder = CheckpointLinear(
            f"{where}: {name}",
            module.in_features,
            module.out_features,
            own,
            quant,
            dtype,
            device,
            ggml_type=kind,
        )
        model.set_submodule(name, holder)
        checkpoint.keep_quantized.add(f"{name}.weight")
        kept += 1
    if kept:
        log.info("llm: %s: %d projections kept 4-bit (%s)", where, kept, quant.method)
    return quant


def finalize(model: nn.Module) -> None:
    """Turn every loaded ``CheckpointLinear`` into the module that computes with it."""
    for name, module in list(model.named_modules()):
        if isinstance(module, CheckpointLinear):
            model.set_submodule(name, module.prepare())
