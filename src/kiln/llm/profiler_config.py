"""vLLM's ``--profiler-config``: whether ``/start_profile`` and ``/stop_profile`` record
the engine's steps with ``torch.profiler`` (or mark them for an outside CUDA profiler),
and where the traces go. Importing this module does not import torch (the CLI and config
parsing read it)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError, Status

#: ``torch``: ``torch.profiler`` traces (Chrome/Perfetto JSON) and an op table written to
#: ``torch_profiler_dir``; ``cuda``: ``cudaProfilerStart``/``Stop`` around the steps, for
#: Nsight Systems' ``--capture-range=cudaProfilerApi`` (a GPU only)
PROFILERS = ("torch", "cuda")
#: what ``torch.profiler`` may record; the default is the engine's device's: CPU, or CPU
#: and CUDA (vLLM's XPU and PrivateUse1 have no kiln device)
ACTIVITIES = ("CPU", "CUDA")
_BOOLS = {
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
    "torch_profiler_dump_cuda_time_total": True,
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
    "ignore_frontend": False,
}
_INTS = {  # default, least
    "delay_iterations": (0, 0),
    "max_iterations": (0, 0),
    "warmup_iterations": (0, 0),
    "active_iterations": (5, 1),
    "wait_iterations": (0, 0),
}
#: vLLM's fields kiln has no counterpart of: a 400/exit naming them, never ignored
_UNSUPPORTED = {
    "capture_torch_profiler": "kiln does not profile CUDA-graph capture",
    "detailed_trace_annotation": "kiln's steps are annotated by name only",
}
_FIELDS = ("profiler", "torch_profiler_dir", "torch_profiler_activities", *_BOOLS, *_INTS)
#: iterations a request may ask to wait or record (a uint32, as counters elsewhere)
MAX_ITERATIONS = 2**32 - 1
#: a trace file name's prefix (vLLM's rule: ASCII letters, digits, '.', '_', '-')
MAX_PREFIX = 128


def _refuse(message: str) -> KilnError:
    return KilnError(f"llm backend: profiler_config: {message}", Status.INVALID_ARG)


@dataclass(frozen=True, slots=True)
class ProfilerConfig:
    profiler: str
    #: an absolute local folder (created at start); ``torch`` only
    torch_profiler_dir: str = ""
    #: None: the device's default
    torch_profiler_activities: tuple[str, ...] | None = None
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    torch_profiler_dump_cuda_time_total: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    #: accepted (vLLM's): kiln profiles the engine's process only either way
    ignore_frontend: bool = False
    #: steps after ``/start_profile`` before recording starts (0: at once)
    delay_iterations: int = 0
    #: steps recorded before the profiler stops on its own (0: until ``/stop_profile``)
    max_iterations: int = 0
    #: ``torch.profiler.schedule``: with ``wait``/``warmup`` > 0, steps skipped, then run
    #: but discarded, then ``active`` recorded
    warmup_iterations: int = 0
    active_iterations: int = 5
    wait_iterations: int = 0

    @classmethod
    def parse(cls, raw: str | dict[str, Any]) -> ProfilerConfig | None:
        """vLLM's JSON (``{"profiler": "torch", "torch_profiler_dir": "/tmp/traces"}``) or
        its object; None when ``profiler`` is unset or null (no profiling, as vLLM)."""
        fields: Any = raw
        if isinstance(raw, str):
            try:
                fields = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _refuse(f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise _refuse("must be a JSON object")
        for key in fields:
            if key in _UNSUPPORTED:
                raise _refuse(f"field '{key}' is not supported by kiln: {_UNSUPPORTED[key]}")
            if key.startswith("proton_"):
                raise _refuse(f"field '{key}': kiln has no Proton profiler (profiler 'torch')")
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise _refuse(
                f"field '{unknown[0]}' is not supported by kiln (supported: {', '.join(_FIELDS)})"
            )
        kind = fields.get("profiler")
        if kind is None:
            if fields.get("torch_profiler_dir"):
                raise _refuse("torch_profiler_dir is only applicable when profiler is 'torch'")
            return None
        if kind not in PROFILERS:
            raise _refuse(
                f"profiler {kind!r} is not supported by kiln (supported: {', '.join(PROFILERS)})"
            )
        folder = fields.get("torch_profiler_dir", "")
        if not isinstance(folder, str):
            raise _refuse(f"'torch_profiler_dir' must be a string, got {folder!r}")
        if kind == "torch" and not folder:
            raise _refuse("torch_profiler_dir must be set when profiler is 'torch'")
        if folder and kind != "torch":
            raise _refuse("torch_profiler_dir is only applicable when profiler is 'torch'")
        if "://" in folder:
            raise _refuse(
                f"torch_profiler_dir '{folder}': kiln writes traces to a local folder, not to a URI"
            )
        if "\x00" in folder:
            raise _refuse("torch_profiler_dir holds a NUL byte")
        if folder:
            folder = os.path.abspath(os.path.expanduser(folder))
        out: dict[str, Any] = {"profiler": kind, "torch_profiler_dir": folder}
        out["torch_profiler_activities"] = _activities(fields, kind)
        for key, default in _BOOLS.items():
            value = fields.get(key, default)
            if not isinstance(value, bool):
                raise _refuse(f"'{key}' must be true or false, got {value!r}")
            out[key] = value
        for key, (number, least) in _INTS.items():
            out[key] = _integer(key, fields.get(key, number), least)
        return cls(**out)


def _activities(fields: dict[str, Any], kind: str) -> tuple[str, ...] | None:
    raw = fields.get("torch_profiler_activities")
    if raw is None:
        return None
    if kind != "torch":
        raise _refuse("torch_profiler_activities is only applicable when profiler is 'torch'")
    if not isinstance(raw, list) or not raw or len(raw) > len(ACTIVITIES):
        raise _refuse(
            f"'torch_profiler_activities' must be a list of 1 to {len(ACTIVITIES)} of "
            f"{', '.join(ACTIVITIES)}, got {raw!r}"
        )
    for activity in raw:
        if activity not in ACTIVITIES:
            raise _refuse(
                f"torch_profiler_activities: {activity!r} is not supported by kiln "
                f"(supported: {', '.join(ACTIVITIES)})"
            )
    if len(set(raw)) != len(raw):
        raise _refuse("torch_profiler_activities must not contain duplicates")
    return tuple(raw)


def _integer(key: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(f"'{key}' must be an integer, got {value!r}")
    if not least <= value <= MAX_ITERATIONS:
        raise _refuse(f"'{key}' must be between {least} and {MAX_ITERATIONS}, got {value}")
    return value


def check_session(prefix: Any, delay: Any, limit: Any) -> tuple[str | None, int | None, int | None]:
    """A ``/start_profile`` body's overrides, checked as vLLM checks them (its messages):
    ``profile_prefix`` names the trace files, ``delay_iterations`` / ``max_iterations``
    replace the configured ones for this session. Raises INVALID_ARG naming the field."""
    if prefix is not None and (
        not isinstance(prefix, str)
        or not 1 <= len(prefix) <= MAX_PREFIX
        or not prefix.isascii()
        or not prefix[0].isalnum()
        or any(not (c.isalnum() or c in "._-") for c in prefix[1:])
    ):
        raise KilnError(
            f"profile_prefix must be 1-{MAX_PREFIX} ASCII characters, start with a "
            "letter or number, and contain only letters, numbers, '.', '_', or '-'",
            Status.INVALID_ARG,
        )
    checked: list[int | None] = []
    for key, value in (("delay_iterations", delay), ("max_iterations", limit)):
        if value is None:
            checked.append(None)
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise KilnError(f"{key} must be an integer, got {value!r}", Status.INVALID_ARG)
        if not 0 <= value <= MAX_ITERATIONS:
            raise KilnError(
                f"{key} must be between 0 and {MAX_ITERATIONS}, got {value}", Status.INVALID_ARG
            )
        checked.append(value)
    return prefix, checked[0], checked[1]
