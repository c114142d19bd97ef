"""``config.json``'s ``quantization_config`` -> what kiln loads, or a refusal naming why.

Method names are vLLM's (``--quantization``): ``fp8``, ``compressed-tensors``, ``awq``,
``gptq``, ``gguf``. Which layers are quantized is read from the checkpoint's tensors (a
layer with a ``weight_scale`` or a ``qweight`` is), so ``ignore`` / ``modules_to_not_convert``
lists need no interpretation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError, Status

#: vLLM's ``--quantization`` values kiln loads (and the kernel-specific aliases vLLM accepts
#: for the same checkpoints)
METHODS = ("fp8", "compressed-tensors", "awq", "gptq", "gguf")
ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "marlin": "gptq"}
#: int4 group sizes: torch's packed int4 kernels take these (-1: one group per row)
INT4_GROUP_SIZES = (-1, 32, 64, 128, 256)


@dataclass(slots=True)
class QuantConfig:
    #: vLLM's method name
    method: str
    #: ``fp8`` | ``int8`` | ``int4``: what the quantized layers' weights hold
    weights: str
    #: int4: the rows of ``K`` sharing a scale (-1: all of them)
    group_size: int = -1
    #: GPTQ's act-order: groups follow ``g_idx``, not the row order
    desc_act: bool = False
    #: GPTQ's legacy format stores each zero point minus one
    zero_offset: int = 0
    #: compressed-tensors W8A8: activations quantized per token at run time (kiln on the CPU
    #: computes with unquantized activations: docs/design/llm-quantization.md)
    activations: str = "none"


def _refuse(where: str, reason: str) -> KilnError:
    return KilnError(f"llm backend: {where}: {reason}", Status.INVALID_ARG)


def parse(config: dict[str, Any], where: str) -> QuantConfig | None:
    """The checkpoint's quantization (None: unquantized); ``where`` names the model."""
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _refuse(where, "quantization_config is not a JSON object")
    method = str(raw.get("quant_method", "")).lower()
    if method == "fp8":
        if raw.get("weight_block_size") is not None:
            block = raw["weight_block_size"]
            if not (isinstance(block, list) and len(block) == 2):
                raise _refuse(where, f"fp8 weight_block_size must be [n, k], got {block!r}")
        return QuantConfig("fp8", "fp8", activations=str(raw.get("activation_scheme", "dynamic")))
    if method == "compressed-tensors":
        return _compressed_tensors(raw, where)
    if method in ("awq", "gptq"):
        bits = raw.get("bits", raw.get("w_bit"))
        if bits != 4:
            raise _refuse(where, f"{method} with bits={bits} is not supported (4 only)")
        group = raw.get("group_size", raw.get("q_group_size"))
        if group not in INT4_GROUP_SIZES:
            raise _refuse(
                where,
                f"{method} group_size {group} is not supported (one of {list(INT4_GROUP_SIZES)})",
            )
        if method == "awq":
            version = str(raw.get("version", "gemm")).lower()
            if version != "gemm":
                raise _refuse(where, f"awq version '{version}' is not supported (gemm only)")
            if raw.get("zero_point", True) is not True:
                raise _refuse(where, "awq without zero_point is not supported")
            return QuantConfig("awq", "int4", group_size=int(group))
        fmt = str(raw.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise _refuse(where, f"gptq checkpoint_format '{fmt}' is not supported")
        return QuantConfig(
            "gptq",
            "int4",
            group_size=int(group),
            desc_act=bool(raw.get("desc_act", False)),
            zero_offset=1 if fmt == "gptq" else 0,
        )
    raise _refuse(
        where,
        f"quantization_config's quant_method '{method}' is not supported "
        f"(kiln loads {', '.join(m for m in METHODS if m != 'gguf')})",
    )


def _compressed_tensors(raw: dict[str, Any], where: str) -> QuantConfig:
    fmt = str(raw.get("format", "")).lower()
    groups = raw.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, "compressed-tensors quantization_config has no config_groups")
    kinds: set[str] = set()
    activations = "none"
    for name, group in groups.items():
        weights = (group or {}).get("weights") or {}
        kind = str(weights.get("type", "int"))
        bits = weights.get("num_bits")
        if bits != 8 or kind not in ("int", "float"):
            raise _refuse(
                where,
                f"compressed-tensors group '{name}': {bits}-bit {kind} weights are not "
                "supported (8-bit int or float only)",
            )
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel"):
            raise _refuse(
                where,
                f"compressed-tensors group '{name}': weight strategy '{strategy}' is not "
                "supported (tensor or channel)",
            )
        if weights.get("symmetric", True) is not True:
            raise _refuse(where, f"compressed-tensors group '{name}': asymmetric weights")
        kinds.add("fp8" if kind == "float" else "int8")
        if group.get("input_activations"):
            activations = "dynamic" if group["input_activations"].get("dynamic") else "static"
    expected = {"fp8": "float-quantized", "int8": "int-quantized"}
    if len(kinds) != 1:
        raise _refuse(where, "compressed-tensors groups mix int and float weights")
    kind = kinds.pop()
    if fmt not in (expected[kind], "naive-quantized"):
        raise _refuse(
            where,
            f"compressed-tensors format '{fmt}' is not supported for {kind} weights "
            f"(kiln loads '{expected[kind]}')",
        )
    return QuantConfig("compressed-tensors", kind, activations=activations)


def check_requested(requested: str, detected: QuantConfig | None, where: str) -> None:
    """vLLM's ``--quantization``: empty/``auto`` takes the checkpoint's; an explicit value
    must be the checkpoint's method."""
    name = ALIASES.get(requested.strip().lower(), requested.strip().lower())
    if name in ("", "auto"):
        return
    if name == "none":
        if detected is not None:
            raise _refuse(
                where, f"quantization 'none' was asked for but the checkpoint is {detected.method}"
            )
        return
    if name not in METHODS:
        raise _refuse(where, f"quantization '{requested}' is not one of {', '.join(METHODS)}")
    have = detected.method if detected else "none (an unquantized checkpoint)"
    if detected is None or detected.method != name:
        raise _refuse(
            where,
            f"quantization '{requested}' was asked for but the checkpoint's is {have}",
        )
