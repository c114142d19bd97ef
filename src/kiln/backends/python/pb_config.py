"""pb_utils' model config helpers: a model reads its config (``args["model_config"]``, a dict
or its JSON) with them (re-exported by ``pb_utils``)."""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "get_input_config_by_name",
    "get_output_config_by_name",
    "using_decoupled_model_transaction_policy",
]


def _config_dict(model_config: Any) -> dict[str, Any]:
    if isinstance(model_config, str):
        loaded: dict[str, Any] = json.loads(model_config)
        return loaded
    return dict(model_config)


def get_input_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return next((t for t in _config_dict(model_config).get("input", []) if t["name"] == name), None)


def get_output_config_by_name(model_config: Any, name: str) -> dict[str, Any] | None:
    return next(
        (t for t in _config_dict(model_config).get("output", []) if t["name"] == name), None
    )


def using_decoupled_model_transaction_policy(model_config: Any) -> bool:
    """Whether the config (``args["model_config"]``, as a dict or its JSON) is decoupled."""
    policy = _config_dict(model_config).get("model_transaction_policy") or {}
    return bool(policy.get("decoupled", False))
