"""Multi-LoRA, vLLM's interface: the adapters a model serves, their settings, and which
folders they may come from. Torch-free (the OpenAI frontend imports it); the weights and
the batched matmul are in ``lora_layers.py``.

An adapter is a ``LoRARequest`` (vLLM's): a name clients put in ``model``, a path, and an
int id that is never reused, so a name unloaded and loaded again with other weights never
matches the first one's prefix-cache blocks or device slot.
"""

from __future__ import annotations

import itertools
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import KilnError, Status

#: vLLM's switch for ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``, and kiln's
RUNTIME_UPDATING_ENV = ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "KILN_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_updating_allowed() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes")
        for name in RUNTIME_UPDATING_ENV
    )


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One loaded adapter (vLLM's names)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry (vLLM's ``LoRAModulePath``)."""

    name: str
    path: str
    base_model_name: str | None = None


def _module(entry: object) -> LoRAModulePath:
    if isinstance(entry, str):
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"'{entry}' is not name=path")
        return LoRAModulePath(name, path)
    if isinstance(entry, dict):
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"unknown field '{unknown[0]}' (name, path, base_model_name)")
        named, at, base = entry.get("name"), entry.get("path"), entry.get("base_model_name")
        if not isinstance(named, str) or not isinstance(at, str) or not named or not at:
            raise ValueError(f"{json.dumps(entry)} needs a string name and path")
        if base is not None and not isinstance(base, str):
            raise ValueError("base_model_name must be a string")
        return LoRAModulePath(named, at, base)
    raise ValueError(f"{entry!r} is neither name=path nor a JSON object")


def _entries(text: str) -> list[object]:
    text = text.strip()
    if text.startswith("["):  # one per repeated flag: each may hold several
        listed = json.loads(text)
        if not isinstance(listed, list):
            raise ValueError("not a JSON list")
        return [e for item in listed
                for e in (_entries(item) if isinstance(item, str) else [item])]  # fmt: skip
    if text.startswith("{"):
        return [json.loads(text)]
    return list(text.split())


def parse_lora_modules(raw: str) -> tuple[LoRAModulePath, ...]:
    """vLLM's ``--lora-modules`` values: ``name=path`` entries (space separated), a JSON
    object ``{"name", "path", "base_model_name"}``, or a JSON list of such values."""
    try:
        modules = tuple(_module(e) for e in _entries(raw))
    except (ValueError, json.JSONDecodeError) as exc:
        raise KilnError(f"lora_modules: {exc}", Status.INVALID_ARG) from None
    names = [m.name for m in modules]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise KilnError(f"lora_modules: the name '{twice[0]}' is given twice", Status.INVALID_ARG)
    return modules


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """vLLM's ``--max-loras`` (adapters in one batch: the device slots), ``--max-lora-rank``,
    ``--max-cpu-loras`` (adapters held in host memory; default ``max_loras``) and
    ``--lora-modules``; ``allowed_paths``: kiln's, the folders runtime loads may read."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allowed_paths: tuple[str, ...] = ()

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def check(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise KilnError(
                    f"llm backend: {name} must be at least 1, got {getattr(self, name)}",
                    Status.INVALID_ARG,
                )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise KilnError(
                f"llm backend: max_cpu_loras ({self.max_cpu_loras}) must be at least "
                f"max_loras ({self.max_loras})",
                Status.INVALID_ARG,
            )


#: the config.pbtxt parameters (and ``kiln serve`` flags) of LoRA
LORA_PARAMETERS = (
    "enable_lora",
    "lora_modules",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "allowed_lora_paths",
)


def lora_config(get: Callable[[str], str | None], model: str) -> LoRAConfig | None:
    """The LoRA settings from a model's parameters (None: ``enable_lora`` is not set)."""
    enabled = (get("enable_lora") or "false").strip().lower()
    if enabled not in ("true", "1", "yes", "false", "0", "no"):
        raise KilnError(
            f"model '{model}': parameter enable_lora must be true or false, got '{enabled}'",
            Status.INVALID_ARG,
        )
    given = [k for k in LORA_PARAMETERS[1:] if get(k)]
    if enabled in ("false", "0", "no"):
        if given:
            raise KilnError(
                f"model '{model}': parameter {given[0]} needs enable_lora (--enable-lora)",
                Status.INVALID_ARG,
            )
        return None
    ints: dict[str, int] = {}
    for key in ("max_loras", "max_lora_rank", "max_cpu_loras"):
        raw = get(key)
        if raw:
            try:
                ints[key] = int(raw)
            except ValueError:
                raise KilnError(
                    f"model '{model}': parameter {key} must be an integer, got '{raw}'",
                    Status.INVALID_ARG,
                ) from None
    raw_paths = (get("allowed_lora_paths") or "").strip()
    paths: list[str] = json.loads(raw_paths) if raw_paths.startswith("[") else [
        p for p in raw_paths.split(os.pathsep) if p
    ]  # fmt: skip
    try:
        modules = parse_lora_modules(get("lora_modules") or "")
    except KilnError as exc:
        raise KilnError(f"model '{model}': {exc}", Status.INVALID_ARG) from None
    config = LoRAConfig(lora_modules=modules, allowed_paths=tuple(paths), **ints)
    config.check()
    return config


def check_allowed_path(path: str, allowed: tuple[str, ...]) -> Path:
    """A runtime load's folder, resolved (links followed), if it lies inside one of the
    folders the operator allowed; a client must not make the server read anywhere else."""
    if not allowed:
        raise KilnError(
            "loading LoRA adapters at runtime needs the folders they may come from: start "
            "kiln with --allowed-lora-path DIR (parameter allowed_lora_paths)",
            Status.INVALID_ARG,
        )
    if "\x00" in path:  # the file system takes no NUL (Path.resolve raises ValueError)
        raise KilnError("lora_path must not contain a NUL character", Status.INVALID_ARG)
    folder = Path(path).resolve()
    for root in allowed:
        if folder.is_relative_to(Path(root).resolve()):
            return folder
    raise KilnError(
        f"lora_path '{path}' is outside the folders allowed for LoRA adapters "
        "(--allowed-lora-path)",
        Status.INVALID_ARG,
    )


class LoRARegistry:
    """The adapters a model serves, by name (vLLM's ``OpenAIServingModels.lora_requests``)."""

    _ids = itertools.count(1)  # process-wide: an id is never reused, by any model

    def __init__(self) -> None:
        self._by_name: dict[str, LoRARequest] = {}
        self._lock = threading.Lock()

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def named(self, name: object) -> LoRARequest:
        """The adapter a request's ``lora_name`` names (Triton's vLLM-backend field);
        KilnError INVALID_ARG naming the served ones otherwise."""
        found = self._by_name.get(name) if isinstance(name, str) else None
        if found is None:
            served = ", ".join(r.lora_name for r in self.all()) or "none"
            raise KilnError(f"lora_name {name!r} is not an adapter of this model "
                            f"(served: {served})", Status.INVALID_ARG)  # fmt: skip
        return found

    def all(self) -> list[LoRARequest]:
        return sorted(self._by_name.values(), key=lambda r: r.lora_name)

    @classmethod
    def new_request(cls, name: str, path: str, base: str | None = None) -> LoRARequest:
        return LoRARequest(name, next(cls._ids), path, base)

    def check_new(self, name: str) -> None:
        if name in self._by_name:
            raise KilnError(
                f"The lora adapter '{name}' has already been loaded.", Status.INVALID_ARG
            )

    def add(self, request: LoRARequest) -> None:
        with self._lock:
            self.check_new(request.lora_name)
            self._by_name[request.lora_name] = request

    def remove(self, name: str) -> LoRARequest:
        with self._lock:
            request = self._by_name.pop(name, None)
        if request is None:
            raise KilnError(f"The lora adapter '{name}' cannot be found.", Status.NOT_FOUND)
        return request
