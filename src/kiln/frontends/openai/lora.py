"""LoRA adapters on ``/v1``, as vLLM serves them: a request's ``model`` may name an
adapter of a served model (it runs on that model's engine with the adapter), ``/v1/models``
lists adapters with their base model as ``parent``, and ``POST /v1/load_lora_adapter`` /
``/v1/unload_lora_adapter`` change them at runtime when the operator set
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` (the routes are in the model-repository API group)."""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.responses import PlainTextResponse, Response

from kiln.core.errors import KilnError, Status
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.engine_client import EngineClient
from kiln.llm.lora import RUNTIME_UPDATING_ENV, runtime_updating_allowed
from kiln.server.server import Server


def adapter(server: Server, name: str) -> EngineClient | None:
    """The engine of the served model that has an adapter ``name``, bound to it."""
    for llm in server.llm_engines().values():
        loras = llm.loras
        request = loras.get(name) if loras is not None else None
        if request is not None:
            return llm.with_lora(request)
    return None


def ready_llm(server: Server, name: str) -> EngineClient | None:
    """A ready model's engine, or an adapter's (bound to it), by the name a request gives."""
    return server.llm_engines().get(server.llm_name(name)) or adapter(server, name)


def cards(server: Server, created: int) -> list[dict[str, Any]]:
    """vLLM's model cards of the adapters (``parent``: the base model)."""
    out = []
    for name, llm in sorted(server.llm_engines().items()):
        for request in llm.loras.all() if llm.loras is not None else ():
            out.append(
                {
                    "id": request.lora_name,
                    "object": "model",
                    "created": created,
                    "owned_by": "kiln",
                    # vLLM puts the adapter's folder here; kiln does not show clients its paths
                    "root": request.lora_name,
                    "parent": name,
                    "max_model_len": llm.max_model_len,
                }
            )
    return out


def _gate() -> None:
    if not runtime_updating_allowed():
        raise OpenAIError(
            "loading and unloading LoRA adapters at runtime is off: the operator sets "
            f"{RUNTIME_UPDATING_ENV[0]}=True to allow it",
            404,
        )


def _string(body: dict[str, Any], field: str) -> str:
    value = body.get(field)
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"'{field}' (a non-empty string) is required", param=field)
    return value


def _base(server: Server, body: dict[str, Any]) -> EngineClient:
    """The model a runtime adapter goes on: the one served with ``enable_lora`` (kiln may
    serve several: then ``base_model_name`` names it)."""
    enabled = {n: llm for n, llm in server.llm_engines().items() if llm.loras is not None}
    base = body.get("base_model_name")
    if base is not None:
        if not isinstance(base, str) or base not in enabled:
            raise OpenAIError(
                f"base_model_name {base!r} is not a model served with LoRA enabled "
                f"({', '.join(sorted(enabled)) or 'none is'})",
                param="base_model_name",
            )
        return enabled[base]
    if len(enabled) == 1:
        return next(iter(enabled.values()))
    if not enabled:
        raise OpenAIError("no model is served with LoRA enabled (--enable-lora)", param="model")
    raise OpenAIError(
        f"'base_model_name' is required: {len(enabled)} models serve LoRA adapters "
        f"({', '.join(sorted(enabled))})",
        param="base_model_name",
    )


async def load(server: Server, body: dict[str, Any]) -> Response:
    _gate()
    name, path = _string(body, "lora_name"), _string(body, "lora_path")
    if ready_llm(server, name) is not None:
        raise OpenAIError(
            f"The lora adapter '{name}' has already been loaded (or a model has that name).",
            param="lora_name",
        )
    llm = _base(server, body)
    try:  # reading and checking the weights takes time: off the event loop
        await asyncio.to_thread(llm.add_lora, name, path)
    except KilnError as exc:
        if exc.status is Status.INVALID_ARG:
            raise OpenAIError(str(exc), param="lora_path") from None
        raise
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload(server: Server, body: dict[str, Any]) -> Response:
    _gate()
    name = _string(body, "lora_name")
    bound = adapter(server, name)
    if bound is None:
        raise OpenAIError(f"The lora adapter '{name}' cannot be found.", 404, param="lora_name")
    bound.remove_lora(name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
