"""vLLM's weight-version and weight-transfer routes (``rl/online``), with its other
development routes only when ``VLLM_SERVER_DEV_MODE`` is set (404 without it).

- ``POST /update_weight_version`` ``{"new_version": "..."}`` labels the weights every LLM
  engine runs from its next step on; ``GET /weight_info`` reads the label. Finished samples
  of ``/inference/v1/generate`` carry ``weight_versions``: the spans of their output tokens
  sampled under each label (``kiln.llm.weight_versions``).
- vLLM's weight transfer (``/init_weight_transfer_engine``, ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``, ...) moves a trainer's tensors into the
  engine over NCCL or CUDA IPC. kiln has no transfer engine (vLLM's
  ``--weight-transfer-config`` is refused at start-up): the routes answer 501 saying so,
  instead of vLLM's "not configured" 500, and change nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kiln.frontends.openai.dev_routes import dev_mode
from kiln.frontends.openai.endpoint import BodyReader, answers_errors, json_response, read_json
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.engine_client import EngineClient
from kiln.llm.weight_versions import DEFAULT_VERSION, NO_TRANSFER, check_version
from kiln.server.server import Server

#: vLLM's weight-transfer routes, which need a transfer engine kiln does not have
TRANSFER_ROUTES = (
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/weight_checker",
)


def weight_routes(server: Server, reader: BodyReader) -> list[BaseRoute]:
    """The routes, when ``dev_mode()``; else none (404)."""
    if not dev_mode():
        return []

    def engines() -> list[EngineClient]:
        return list(server.llm_engines().values())

    async def update_weight_version(request: Request) -> Response:
        body = await read_json(request, reader)
        if "new_version" not in body:
            raise OpenAIError("Missing 'new_version' in request body", param="new_version")
        try:
            version = check_version(body["new_version"], "new_version")
        except ValueError as exc:
            raise OpenAIError(str(exc), param="new_version") from None
        llms = engines()
        await asyncio.gather(*(llm.control("set_weight_version", version=version) for llm in llms))
        return json_response({"success": True, "new_version": version})

    async def weight_info(request: Request) -> Response:
        llms = engines()
        version = DEFAULT_VERSION
        if llms:  # every engine is given the same label; the first one's
            version = (await llms[0].control("state"))["weight_version"]
        return json_response({"weight_version": version})

    async def no_transfer(request: Request) -> Response:
        raise OpenAIError(NO_TRANSFER, 501, type_="NotImplementedError")

    def route(path: str, handler: Callable[[Request], Awaitable[Response]], method: str) -> Route:
        return Route(path, answers_errors(handler), methods=[method])

    return [
        route("/update_weight_version", update_weight_version, "POST"),
        route("/weight_info", weight_info, "GET"),
        *(route(path, no_transfer, "POST") for path in TRANSFER_ROUTES),
    ]
