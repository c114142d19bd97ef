"""What every OpenAI route shares: its JSON body, read under the HTTP frontend's limits; its
JSON answer; the model a body names; its errors in OpenAI's (or Anthropic's) shape; and the
count of the requests in flight (``GET /load``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route, request_response
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.core.errors import KilnError, Status
from kiln.core.trace import FrontendSlot
from kiln.frontends import disconnect, json_pieces
from kiln.frontends.json_pieces import OFF_LOOP_PARSE_BYTES
from kiln.frontends.openai import lora, messages
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.request_ids import RequestIdError, remember_header
from kiln.llm.engine_client import EngineClient
from kiln.server.server import Server

# the name the routes' log lines have carried since they were one module
log = logging.getLogger("kiln.frontends.openai.routes")

Handler = Callable[[Request], Awaitable[Response]]


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status, media_type="application/json")


def engine_named(server: Server, name: str, body: dict[str, Any] | None = None) -> EngineClient:
    """The model's engine through core: an unknown or unloaded model is core's error (the
    one infer gives), in OpenAI's shape. ``body``: a rollout's sticky key is one of its
    fields (e.g. ``user``)."""
    try:
        return server.llm_engine(name, parameters=body)
    except KilnError as exc:
        if exc.status is Status.NOT_FOUND:
            bound = lora.adapter(server, name)  # a LoRA adapter of a served model
            if bound is not None:
                return bound
            raise OpenAIError(str(exc), 404, param="model", code="model_not_found") from None
        if exc.status is Status.INVALID_ARG:
            raise OpenAIError(str(exc), param="model") from None
        raise


def generator_named(
    server: Server, name: str, api: str, body: dict[str, Any] | None = None
) -> EngineClient:
    """A model that generates: one served with ``runner: pooling`` answers embeddings
    only, as vLLM's pooling runner does."""
    llm = engine_named(server, name, body)
    if llm.runner == "pooling":
        raise OpenAIError(
            f"The model '{name}' does not support {api} API: it is served with runner "
            "'pooling' (embeddings, or classification for a classifier)",
            param="model",
        )
    return llm


def model_for(server: Server, body: dict[str, Any]) -> EngineClient:
    """``/tokenize`` and ``/detokenize``: ``model`` may be left out when one model serves."""
    model = body.get("model")
    if model is None:
        models = server.llm_engines()
        if len(models) == 1:
            return next(iter(models.values()))
        raise OpenAIError(f"'model' is required: {len(models)} llm models are ready", param="model")
    if not isinstance(model, str):
        raise OpenAIError("'model' must be a string", param="model")
    return engine_named(server, model)


class BodyReader(Protocol):
    """The HTTP frontend these routes are mounted on (``HttpFrontend``): it reads bodies
    under its limits. Passed in: ``frontends.http`` sits above ``frontends.openai``."""

    async def read_body(self, request: Request) -> bytes: ...


async def read_json(request: Request, reader: BodyReader) -> dict[str, Any]:
    try:  # X-Request-Id names the answer (vLLM's rule): request_ids.py
        remember_header(request)
    except RequestIdError as exc:
        raise OpenAIError(str(exc)) from None
    read: dict[str, Any] | None = getattr(request.state, "openai_body", None)
    if read is not None:  # /invocations read it to pick the route
        return read
    # the HTTP frontend's reader: --http-max-input-size (413) and --http-read-timeout-secs
    # (408) hold here as on the KServe routes
    raw = await reader.read_body(request)
    disconnect.watch(request)  # a client that leaves from now on cancels the handler
    if len(raw) > OFF_LOOP_PARSE_BYTES:
        # on a worker thread, a piece at a time (json_pieces): one orjson call holds the
        # GIL throughout, so a single call on a thread held the loop as long (0.5 s for
        # 62 MB of token ids); between pieces the loop gets its turns
        return await asyncio.to_thread(json_object, raw)
    return json_object(raw)


def json_object(raw: bytes) -> dict[str, Any]:
    """A body that must be a JSON object, or the 400 saying why it is not."""
    try:
        body = json_pieces.loads(raw) if len(raw) > OFF_LOOP_PARSE_BYTES else orjson.loads(raw)
    except ValueError as exc:  # orjson.JSONDecodeError is one
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise OpenAIError("the request body must be a JSON object")
    return body


async def received(
    request: Request, slot: FrontendSlot | None, reader: BodyReader
) -> dict[str, Any]:
    """The request's JSON body; a traced request's receive ends here."""
    body = await read_json(request, reader)
    if slot is not None:
        slot.recv_end = time.monotonic_ns()
    return body


def answers_errors(handler: Handler) -> Handler:
    """OpenAI's error shape for what ``handler`` raises."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            return disconnect.answered_nobody(request)  # raises unless the client left
        except ClientDisconnect:
            return Response(status_code=400)  # nobody reads it
        except OpenAIError as exc:
            return json_response(exc.body(), exc.status)
        except KilnError as exc:
            err = OpenAIError.from_kiln(exc)
            return json_response(err.body(), err.status)
        except Exception:
            # a bug of kiln's, not the client's: logged with its traceback, and answered in
            # OpenAI's shape on a connection that stays open (a 500 escaping to the server
            # closes the client's keep-alive connection under its next request)
            log.exception("%s %s failed", request.method, request.url.path)
            err = OpenAIError("internal server error: see the server's log", 500,
                              type_="server_error")  # fmt: skip
            return json_response(err.body(), err.status)
        finally:
            disconnect.stop(request)

    return guarded


def anthropic_errors(handler: Handler) -> Handler:
    """Anthropic's error shape (``{"type": "error", "error": {...}}``) for what
    ``handler`` raises, with the same HTTP status."""
    guarded = answers_errors(handler)

    async def anthropic(request: Request) -> Response:
        response = await guarded(request)
        if response.status_code < 400 or isinstance(response, StreamingResponse):
            return response
        try:
            message = orjson.loads(response.body)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            return response  # no body (a client that left): nothing to reshape
        status = response.status_code
        return json_response(messages.error_body(status, message), status)

    return anthropic


class InFlight:
    """vLLM's server load (``GET /load``): the requests in flight on the routes that
    generate or pool, from their arrival until their answer, a streamed one too, has been
    sent (or its client left)."""

    def __init__(self) -> None:
        self.count = 0

    def route(self, path: str, handler: Handler, methods: list[str]) -> Route:
        return Route(path, _Counted(request_response(handler), self), methods=methods)


class _Counted:
    """An endpoint as an ASGI app counted in flight around its whole call."""

    def __init__(self, app: ASGIApp, load: InFlight) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1
