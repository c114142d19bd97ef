"""vLLM's development and RL control routes, served only when the operator sets
``VLLM_SERVER_DEV_MODE=1`` (or kiln's ``KILN_SERVER_DEV_MODE``): without it they do not
exist (404), as in vLLM, and with it the log says so in vLLM's words. With API keys on they
are in the model-repository group (``frontends/http/access.py``), beside the LoRA routes.

- ``POST /reset_prefix_cache``, ``/reset_mm_cache``, ``/reset_encoder_cache``,
  ``GET /server_info`` (vLLM's ``serve/dev``);
- ``POST /sleep``, ``/wake_up``, ``/release_kv_cache_memory``, ``GET /is_sleeping``;
- ``POST /pause``, ``/resume``, ``/abort_requests``, ``GET /is_paused``, ``/get_world_size``
  (vLLM's ``rl/online``).

Every operation applies to each LLM model served (vLLM serves one); the engine side is
``kiln.llm.engine_control``. Query parameters are checked here, before anything reaches an
engine: integers in ASCII digits and in range, enums by name, a parameter given twice
refused, ``tags`` at most ``MAX_TAGS`` times.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import platform
import sys
from collections.abc import Awaitable, Callable
from importlib import metadata
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kiln import __version__
from kiln.core.errors import KilnError
from kiln.frontends.openai.endpoint import BodyReader, answers_errors, json_response, read_json
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.engine_client import EngineClient
from kiln.llm.sleep_metrics import OPERATIONS_METRICS
from kiln.server.server import Server

log = logging.getLogger(__name__)

#: vLLM's switch, and kiln's spelling of it (either turns the routes on)
DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "KILN_SERVER_DEV_MODE")
PAUSE_MODES = ("abort", "wait", "keep")
WAKE_TAGS = ("weights", "kv_cache", "scheduling")
#: ``tags`` given more often than this is refused (vLLM's executor knows two tags)
MAX_TAGS = 8
#: ``request_ids`` of ``/abort_requests``: at most this many, each at most this long
MAX_ABORT_IDS = 4096
MAX_ID_LENGTH = 512
_TRUE = ("1", "true", "yes", "on", "t", "y")
_FALSE = ("0", "false", "no", "off", "f", "n")


def dev_mode() -> bool:
    return any(
        os.environ.get(name, "").strip().lower() in ("1", "true", "yes") for name in DEV_MODE_ENV
    )


# ---- query parameters ---------------------------------------------------------------------
def _one(request: Request, name: str) -> str | None:
    values = request.query_params.getlist(name)
    if len(values) > 1:
        raise OpenAIError(f"query parameter '{name}' was given {len(values)} times", param=name)
    return values[0] if values else None


def _bool(request: Request, name: str, default: bool) -> bool:
    raw = _one(request, name)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise OpenAIError(f"query parameter '{name}' must be a boolean (true or false)", param=name)


def _choice(request: Request, name: str, allowed: tuple[str, ...], default: str) -> str:
    raw = _one(request, name)
    if raw is None:
        return default
    if raw not in allowed:
        raise OpenAIError(
            f"query parameter '{name}' must be one of {', '.join(allowed)}, got {raw[:64]!r}",
            param=name,
        )
    return raw


def _level(request: Request) -> int:
    raw = _one(request, "level")
    if raw is None:
        return 1
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 4 or int(raw) > 2:
        raise OpenAIError(
            f"query parameter 'level' must be 0, 1 or 2, got {raw[:64]!r}", param="level"
        )
    return int(raw)


def _tags(request: Request) -> list[str] | None:
    tags = request.query_params.getlist("tags")
    if len(tags) > MAX_TAGS:
        raise OpenAIError(
            f"query parameter 'tags' was given {len(tags)} times: at most {MAX_TAGS}",
            param="tags",
        )
    for tag in tags:
        if tag not in WAKE_TAGS:
            raise OpenAIError(
                f"query parameter 'tags' must be among {', '.join(WAKE_TAGS)}, got {tag[:64]!r}",
                param="tags",
            )
    return tags or None  # none: every tag, as vLLM


def _abort_ids(body: dict[str, Any]) -> list[str] | None:
    ids = body.get("request_ids")
    if not ids:
        return None  # empty or missing: every request, as vLLM
    if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids):
        raise OpenAIError("'request_ids' must be a list of strings", param="request_ids")
    if len(ids) > MAX_ABORT_IDS:
        raise OpenAIError(
            f"'request_ids' has {len(ids)} entries: at most {MAX_ABORT_IDS}", param="request_ids"
        )
    if any(len(i) > MAX_ID_LENGTH for i in ids):
        raise OpenAIError(
            f"a request id of 'request_ids' is longer than {MAX_ID_LENGTH} characters",
            param="request_ids",
        )
    return ids


# ---- the routes -------------------------------------------------------------------------------
def dev_routes(server: Server, reader: BodyReader) -> list[BaseRoute]:
    """The routes, when ``dev_mode()``; else none (404)."""
    if not dev_mode():
        return []
    log.warning(
        "SECURITY WARNING: Development endpoints are enabled! This should NOT be used in "
        "production!"
    )

    def engines() -> list[EngineClient]:
        return list(server.llm_engines().values())

    async def each(op: str, **args: Any) -> list[dict[str, Any]]:
        """``op`` on every served LLM model's engine at once (each runs its own one at a
        time); a refusal is the first engine's."""
        return list(await asyncio.gather(*(llm.control(op, **args) for llm in engines())))

    async def rl(op: str, **args: Any) -> Response | None:
        """vLLM's RL routes answer an engine's refusal as ``{"error": message}``."""
        try:
            await each(op, **args)
        except KilnError as exc:
            return json_response({"error": exc.message}, exc.status.http_status)
        return None

    async def reset_prefix_cache(request: Request) -> Response:
        running = _bool(request, "reset_running_requests", False)
        _bool(request, "reset_external", False)  # kiln has no external (connector) cache
        log.info("Resetting prefix cache...")
        results = await each("reset_prefix_cache", reset_running_requests=running)
        return json_response({"success": all(r["success"] for r in results)})

    async def reset_nothing(request: Request) -> Response:
        # kiln keeps no multimodal or encoder cache: nothing to reset, vLLM's answer
        return Response(status_code=200)

    async def server_info(request: Request) -> Response:
        fmt = _choice(request, "config_format", ("text", "json"), "text")
        configs = {name: llm.engine.config for name, llm in server.llm_engines().items()}
        config: Any = (
            str(configs) if fmt == "text" else {n: _jsonable(c) for n, c in configs.items()}
        )
        return json_response(
            {
                "vllm_config": config,
                "vllm_env": _vllm_env(),
                "system_env": await asyncio.to_thread(_system_env),
            }
        )

    async def sleep(request: Request) -> Response:
        level, mode = _level(request), _choice(request, "mode", PAUSE_MODES, "abort")
        with OPERATIONS_METRICS.record("sleep"):
            await each("sleep", level=level, mode=mode)
        return json_response({"status": "sleeping", "level": level})

    async def release_kv_cache_memory(request: Request) -> Response:
        with OPERATIONS_METRICS.record("release_kv_cache_memory"):
            await each("release_kv_cache_memory")
        return json_response({"status": "kv_cache_released"})

    async def wake_up(request: Request) -> Response:
        tags = _tags(request)
        log.info("wake up the engine with tags: %s", tags)
        with OPERATIONS_METRICS.record("wake"):
            results = await each("wake_up", tags=tags)
        awake = all(r["fully_awake"] for r in results)
        return json_response({"status": "awake" if awake else "sleeping", "tags": tags})

    async def is_sleeping(request: Request) -> Response:
        states = await each("state")
        return json_response({"is_sleeping": any(s["sleeping"] for s in states)})

    async def pause(request: Request) -> Response:
        mode = _choice(request, "mode", PAUSE_MODES, "abort")
        clear = _bool(request, "clear_cache", True)
        refused = await rl("pause", mode=mode, clear_cache=clear)
        return refused or json_response({"status": "paused"})

    async def resume(request: Request) -> Response:
        refused = await rl("resume")
        return refused or json_response({"status": "resumed"})

    async def is_paused(request: Request) -> Response:
        states = await each("state")
        return json_response({"is_paused": any(s["paused"] for s in states)})

    async def abort_requests(request: Request) -> Response:
        ids = _abort_ids(await read_json(request, reader))
        if ids is None:
            results = await each("abort", request_ids=None)
            return json_response(
                {"status": "aborted", "aborted": sum(r["aborted"] for r in results)}
            )
        wanted = set(ids)
        await asyncio.gather(
            *(llm.control("abort", request_ids=llm.engine_ids(wanted)) for llm in engines())
        )
        return json_response({"status": "aborted", "aborted": len(ids)})

    async def get_world_size(request: Request) -> Response:
        _bool(request, "include_dp", True)  # kiln runs no data parallelism: the same size
        sizes = [llm.engine.config.tensor_parallel_size for llm in engines()]
        return json_response({"world_size": max(sizes, default=1)})

    def post(path: str, handler: Callable[[Request], Awaitable[Response]]) -> Route:
        return Route(path, answers_errors(handler), methods=["POST"])

    def get(path: str, handler: Callable[[Request], Awaitable[Response]]) -> Route:
        return Route(path, answers_errors(handler), methods=["GET"])

    return [
        post("/reset_prefix_cache", reset_prefix_cache),
        post("/reset_mm_cache", reset_nothing),
        post("/reset_encoder_cache", reset_nothing),
        get("/server_info", server_info),
        post("/sleep", sleep),
        post("/wake_up", wake_up),
        post("/release_kv_cache_memory", release_kv_cache_memory),
        get("/is_sleeping", is_sleeping),
        post("/pause", pause),
        post("/resume", resume),
        get("/is_paused", is_paused),
        post("/abort_requests", abort_requests),
        get("/get_world_size", get_world_size),
    ]


def _jsonable(config: Any) -> dict[str, Any]:
    fields = getattr(config, "__dataclass_fields__", {})
    out: dict[str, Any] = {}
    for name in fields:
        value = getattr(config, name, None)
        ok = value is None or isinstance(value, (str, int, float, bool))
        out[name] = value if ok else str(value)
    return out


#: a variable whose name holds one of these is never shown (its value may be a secret)
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "AUTH", "PRIVATE")


def _vllm_env() -> dict[str, str]:
    """The ``VLLM_*`` (and ``KILN_*``) variables set, none whose name says it may hold a
    secret (``SECRET_WORDS``)."""
    return {
        k: v
        for k, v in sorted(os.environ.items())
        if k.startswith(("VLLM_", "KILN_")) and not any(w in k.upper() for w in SECRET_WORDS)
    }


@functools.lru_cache(maxsize=1)
def _system_env() -> dict[str, Any]:
    """A few of vLLM's ``collect_env`` fields (read once, off the event loop)."""
    try:
        torch_version: str | None = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = None
    return {
        "kiln_version": __version__,
        "torch_version": torch_version,
        "python_version": sys.version,
        "python_platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
