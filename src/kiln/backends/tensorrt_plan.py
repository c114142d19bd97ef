"""Pure decisions of the TensorRT backend: which engine file, which profile, which error.

Nothing here imports tensorrt or touches a GPU, so every rule is testable on any machine.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kiln.config.model_config_pb2 import DataType as PbDataType
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status

DEFAULT_PLAN = "model.plan"

# tensorrt.DataType member names -> config data types (FP8/INT4 have no config type).
TRT_TYPES: dict[str, int] = {
    "FLOAT": PbDataType.TYPE_FP32,
    "HALF": PbDataType.TYPE_FP16,
    "BF16": PbDataType.TYPE_BF16,
    "INT8": PbDataType.TYPE_INT8,
    "INT32": PbDataType.TYPE_INT32,
    "INT64": PbDataType.TYPE_INT64,
    "BOOL": PbDataType.TYPE_BOOL,
    "UINT8": PbDataType.TYPE_UINT8,
}

# tensorrt.DataType member names -> torch dtype attribute names (device buffers are torch's).
TORCH_TYPES: dict[str, str] = {
    "FLOAT": "float32",
    "HALF": "float16",
    "BF16": "bfloat16",
    "INT8": "int8",
    "INT32": "int32",
    "INT64": "int64",
    "BOOL": "bool",
    "UINT8": "uint8",
}

# TensorRT's log line when a plan was built for another GPU architecture. "expecting" is
# the GPU deserializing, "got" the one the plan was built on: an sm_86 plan on a T4 (sm_75)
# logs "... generated on an incompatible device, expecting compute 7.5 got compute 8.6 ...".
_MISMATCH = re.compile(r"expecting compute (\d+)\.(\d+),? got compute (\d+)\.(\d+)")


def sm(major: int, minor: int) -> str:
    return f"sm_{major}{minor}"


def engine_filename(config: ModelConfig, capability: tuple[int, int]) -> str:
    """Triton's rule: ``cc_model_filenames["<major>.<minor>"]``, else the default file."""
    key = f"{capability[0]}.{capability[1]}"
    if key in config.cc_model_filenames:
        return str(config.cc_model_filenames[key])
    return config.default_model_filename or DEFAULT_PLAN


def built_for(config: ModelConfig, filename: str) -> str | None:
    """The ``cc_model_filenames`` key that names ``filename`` (as ``sm_XY``), if any."""
    for key, name in config.cc_model_filenames.items():
        if name == filename:
            match = re.fullmatch(r"(\d+)\.(\d+)", key)
            if match:
                return sm(int(match.group(1)), int(match.group(2)))
    return None


def mismatch_from_log(messages: Iterable[str]) -> tuple[str, str] | None:
    """(built for, this GPU) as ``sm_XY`` from TensorRT's deserialization errors."""
    for message in messages:
        match = _MISMATCH.search(message)
        if match:
            here = sm(int(match.group(1)), int(match.group(2)))
            built = sm(int(match.group(3)), int(match.group(4)))
            return built, here
    return None


def deserialize_error(
    config: ModelConfig,
    filename: str,
    capability: tuple[int, int],
    log: Sequence[str],
) -> KilnError:
    """Why an engine did not deserialize, in the words a user can act on."""
    here = sm(*capability)
    found = mismatch_from_log(log)
    built = found[0] if found else built_for(config, filename)
    if built is not None and built != here:
        others = ", ".join(f"{k} -> {v}" for k, v in sorted(config.cc_model_filenames.items()))
        hint = f" (cc_model_filenames: {others})" if others else ""
        return KilnError(
            f"unable to load model '{config.name}': engines are GPU-specific: {filename} was "
            f"built for {built}, this GPU is {here}; rebuild the engine on this GPU or name one "
            f'for it in cc_model_filenames {{ key: "{capability[0]}.{capability[1]}" ... }}'
            f"{hint}",
            Status.INVALID_ARG,
        )
    reason = log[-1] if log else "TensorRT could not deserialize the plan"
    return KilnError(
        f"unable to load model '{config.name}': {filename} is not a TensorRT engine this "
        f"runtime can load ({reason})",
        Status.INVALID_ARG,
    )


@dataclass(frozen=True, slots=True)
class Profile:
    """One optimization profile: per input, the min and max of each dimension."""

    index: int
    bounds: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]

    def misfit(self, shapes: dict[str, tuple[int, ...]]) -> str | None:
        """Why ``shapes`` fall outside this profile (None: they fit)."""
        for name, (low, high) in self.bounds.items():
            shape = shapes.get(name)
            if shape is None:
                continue
            if len(shape) != len(low):
                return f"input '{name}' has {len(shape)} dimensions, the engine expects {len(low)}"
            for dim, (value, lo, hi) in enumerate(zip(shape, low, high, strict=True)):
                if not lo <= value <= hi:
                    return (
                        f"model expected the shape of dimension {dim} of input '{name}' to be "
                        f"between {lo} and {hi} but received {value}"
                    )
        return None


def choose_profile(
    model: str, profiles: Sequence[Profile], shapes: dict[str, tuple[int, ...]]
) -> Profile:
    """The first profile that admits every input shape; else INVALID_ARG naming the misfit."""
    reasons = []
    for profile in profiles:
        reason = profile.misfit(shapes)
        if reason is None:
            return profile
        reasons.append(f"profile {profile.index}: {reason}")
    raise KilnError(
        f"request specifies invalid shape for model '{model}'. Error details: "
        + "; ".join(reasons),
        Status.INVALID_ARG,
    )


def allowed_profiles(model: str, names: Sequence[str], count: int) -> list[int]:
    """``instance_group.profile`` (strings, as in Triton) -> indices; all when empty."""
    if not names:
        return list(range(count))
    indices = []
    for name in names:
        if not name.isdigit() or int(name) >= count:
            raise KilnError(
                f"model '{model}': instance_group profile '{name}' does not exist; the engine "
                f"has optimization profiles 0..{count - 1}",
                Status.INVALID_ARG,
            )
        indices.append(int(name))
    return indices
