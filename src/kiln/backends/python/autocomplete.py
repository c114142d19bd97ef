"""``auto_complete_config``'s argument: the model config as a dict the model may extend.

A Python model's static ``auto_complete_config(auto_complete_model_config)`` runs at load
time (in a short-lived worker) to fill in what config.pbtxt leaves out. What the user wrote
wins; a contradiction (a different data type or dims for the same tensor, a config
``max_batch_size`` above what the model supports) fails the load with both values named.
"""

from __future__ import annotations

import json
from typing import Any


class ModelConfig:
    def __init__(self, config: dict[str, Any] | str) -> None:
        self._config: dict[str, Any] = json.loads(config) if isinstance(config, str) else config

    def as_dict(self) -> dict[str, Any]:
        return self._config

    def set_max_batch_size(self, max_batch_size: int) -> ModelConfig:
        current = int(self._config.get("max_batch_size", 0) or 0)
        if current > max_batch_size:
            raise ValueError(
                f"configuration specified max_batch_size {current}, but the model supports "
                f"at most {max_batch_size}"
            )
        if current == 0:
            self._config["max_batch_size"] = max_batch_size
        return self

    def set_dynamic_batching(self) -> ModelConfig:
        if "sequence_batching" in self._config:
            raise ValueError("set_dynamic_batching: the config already uses sequence_batching")
        self._config.setdefault("dynamic_batching", {})
        return self

    def set_model_transaction_policy(self, policy: dict[str, Any]) -> ModelConfig:
        current = self._config.setdefault("model_transaction_policy", {})
        for key, value in policy.items():
            if current.get(key) and current[key] != value:
                raise ValueError(
                    f"model_transaction_policy.{key} is {current[key]} in the configuration, "
                    f"but the model sets {value}"
                )
            current[key] = value
        return self

    def add_input(self, tensor: dict[str, Any]) -> ModelConfig:
        self._add("input", tensor)
        return self

    def add_output(self, tensor: dict[str, Any]) -> ModelConfig:
        self._add("output", tensor)
        return self

    def _add(self, kind: str, tensor: dict[str, Any]) -> None:
        if "name" not in tensor:
            raise ValueError(f"add_{kind}: the {kind} needs a 'name'")
        entries: list[dict[str, Any]] = self._config.setdefault(kind, [])
        existing = next((e for e in entries if e.get("name") == tensor["name"]), None)
        if existing is None:
            entries.append(dict(tensor))
            return
        for key in ("data_type", "dims"):
            mine, theirs = existing.get(key), tensor.get(key)
            if not _unset(mine) and theirs is not None and list_or(mine) != list_or(theirs):
                raise ValueError(
                    f"{kind} '{tensor['name']}': the configuration has {key} {mine}, "
                    f"auto_complete_config sets {theirs}"
                )
        for key, value in tensor.items():
            existing.setdefault(key, value)


def _unset(value: Any) -> bool:
    # The config JSON prints defaults: an unset data type reads TYPE_INVALID, unset dims [].
    return value in (None, "", "TYPE_INVALID", [])


def list_or(value: Any) -> Any:
    """Dims compare as lists of ints (the config JSON may hold them as strings)."""
    if isinstance(value, list | tuple):
        return [int(v) for v in value]
    return value
