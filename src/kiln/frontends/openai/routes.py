"""``/v1/*`` routes: OpenAI-shaped JSON, or Server-Sent Events when ``stream`` is true.

The handlers live in groups (``completion_routes``, ``response_routes``, ``pooling_routes``,
``token_routes``) over the plumbing they share (``endpoint``), a generation's preparation
(``preparation``) and its answer (``answers``); this module holds the route table and the
small routes about the server itself."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from kiln import __version__
from kiln.frontends.openai import lora
from kiln.frontends.openai.completion_routes import CompletionRoutes
from kiln.frontends.openai.derender_stream import DerenderRoutes
from kiln.frontends.openai.dev_routes import dev_routes
from kiln.frontends.openai.endpoint import (
    BodyReader,
    Handler,
    InFlight,
    answers_errors,
    anthropic_errors,
    engine_named,
    json_response,
    read_json,
)
from kiln.frontends.openai.pooling_routes import PoolingRoutes
from kiln.frontends.openai.profile_routes import ProfileRoutes
from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.render import RenderRoutes
from kiln.frontends.openai.response_routes import ResponseRoutes
from kiln.frontends.openai.token_routes import TokenRoutes
from kiln.frontends.openai.tokens_only import check_body, gated, invocation_kind
from kiln.frontends.openai.tokens_out import TokensOutRoutes
from kiln.frontends.openai.weight_routes import weight_routes
from kiln.server.server import Server

SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")
SCALE_OUT_OFF = (
    "Scale-out endpoints are disabled. Restart kiln serve with --enable-scale-out to enable them."
)


def openai_routes(server: Server, reader: BodyReader) -> list[BaseRoute]:
    """``reader``: the HTTP frontend whose body limits apply."""
    completion = CompletionRoutes(server, reader)
    response = ResponseRoutes(server, reader)
    pooling = PoolingRoutes(server, reader)
    tokens = TokenRoutes(server, reader)
    profile = ProfileRoutes(server, reader)
    render = RenderRoutes(server, reader)
    derender = DerenderRoutes(server, reader)
    tokens_out = TokensOutRoutes(server, reader)

    def text(kind: str, handler: Handler) -> Handler:
        """vLLM's --tokens-only: a route that needs the tokenizer (``kind``:
        ``tokens_only.check_body``) answers its 400 instead."""
        return gated(server, reader, kind, handler)

    async def models(request: Request) -> Response:
        created = int(time.time())
        engines = server.llm_engines()
        names = [(name, name) for name in engines]  # (served name, its model)
        names += [(a, m) for a, m in server.options.llm_aliases.items() if m in engines]
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "kiln",
                "root": model,
                "parent": None,
                "max_model_len": engines[model].max_model_len,
                "permission": [_permission(created)],
            }
            for name, model in sorted(names)
        ]
        adapters = lora.cards(server, created)
        data += [{**card, "permission": [_permission(created)]} for card in adapters]
        return json_response({"object": "list", "data": data})

    async def load_lora(request: Request) -> Response:
        return await lora.load(server, await read_json(request, reader))

    async def unload_lora(request: Request) -> Response:
        return await lora.unload(server, await read_json(request, reader))

    async def model_card(request: Request) -> Response:
        """OpenAI's ``GET /v1/models/{model}`` (``client.models.retrieve``)."""
        name = request.path_params["model"]
        body = orjson.loads((await models(request)).body)
        for card in body["data"]:
            if card["id"] == name:
                return json_response(card)
        raise OpenAIError(
            f"The model '{name[:200]}' does not exist", 404, param="model", code="model_not_found"
        )

    async def invocations(request: Request) -> Response:
        """vLLM's SageMaker route: the body's shape picks the API (``messages``: chat,
        ``prompt``: completions, ``input``: embeddings, ``text_1``: score, ``query``:
        rerank), as vLLM tries them in turn."""
        body = await read_json(request, reader)
        request.state.openai_body = body
        if server.options.tokens_only:
            check_body(invocation_kind(body), body)
        if "messages" in body:
            return await completion.chat(request)
        if "prompt" in body:
            return await completion.completions(request)
        if "input" in body:
            model = body.get("model")
            llm = engine_named(server, model) if isinstance(model, str) else None
            if llm is not None and llm.engine.args.num_labels:  # the model's task decides
                return await pooling.classify(request)
            if llm is not None and llm.engine.args.is_token_classifier:
                return await pooling.pool(request)  # each token's labels: /pooling's answer
            return await pooling.embed(request)
        if "text_1" in body or "data_1" in body:
            return await pooling.score(request)
        if "query" in body:
            return await pooling.rerank(request)
        raise OpenAIError(
            "/invocations needs a chat ('messages'), completions ('prompt'), embeddings "
            "('input'), score ('text_1') or rerank ('query') request body"
        )

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def version(request: Request) -> Response:
        return json_response({"version": __version__})

    inflight = InFlight()

    async def load(request: Request) -> Response:
        """vLLM's ``GET /load`` (its ``--enable-server-load-tracking``, always on here):
        the generation and pooling requests in flight, for a load-aware router."""
        return json_response({"server_load": inflight.count})

    def scale_out(handler: Handler) -> Handler:
        """vLLM's ``--enable-scale-out`` routes: 403 in vLLM's words unless it (or
        ``--tokens-only``, whose routes they are) is on."""

        async def allowed(request: Request) -> Response:
            if not (server.options.enable_scale_out or server.options.tokens_only):
                raise OpenAIError(SCALE_OUT_OFF, 403, type_="PermissionDeniedError")
            return await handler(request)

        return answers_errors(allowed)

    def counted(path: str, handler: Handler) -> Route:
        return inflight.route(path, handler, ["POST"])

    dev = dev_routes(server, reader)  # VLLM_SERVER_DEV_MODE's alone
    # vLLM's unauthenticated legacy abort path of --tokens-only, unless dev mode serves its
    # own /abort_requests (kiln keeps it behind the API key: frontends/http/access.py)
    legacy = [] if dev or not server.options.tokens_only else [
        Route("/abort_requests", scale_out(tokens_out.abort_requests), methods=["POST"])
    ]  # fmt: skip
    return [
        *dev,
        *weight_routes(server, reader),  # VLLM_SERVER_DEV_MODE's too
        *legacy,
        Route("/v1/models", models, methods=["GET"]),
        counted("/v1/completions", answers_errors(text("prompt", completion.completions))),
        counted("/v1/chat/completions", answers_errors(text("text", completion.chat))),
        counted("/v1/chat/completions/batch", answers_errors(text("text", completion.batch_chat))),
        counted("/generative_scoring", answers_errors(text("text", pooling.score_generatively))),
        counted("/v2/embed", answers_errors(text("text", pooling.cohere_embed))),
        counted("/v1/embeddings", answers_errors(text("input", pooling.embed))),
        counted("/pooling", answers_errors(text("input", pooling.pool))),
        counted("/classify", answers_errors(text("input", pooling.classify))),
        # vLLM's score and rerank APIs: its own paths, the /v1 ones it still answers, and
        # /v2/rerank (Cohere's v2 path)
        *(counted(path, answers_errors(text("text", pooling.score))) for path in SCORE_PATHS),
        *(counted(path, answers_errors(text("text", pooling.rerank))) for path in RERANK_PATHS),
        counted("/v1/responses", answers_errors(text("text", response.create_response))),
        # Anthropic's Messages API, as vLLM serves it
        counted("/v1/messages", anthropic_errors(text("text", completion.anthropic_messages))),
        counted(
            "/v1/messages/count_tokens",
            anthropic_errors(text("text", completion.anthropic_count_tokens)),
        ),
        Route(
            "/v1/responses/{response_id}", answers_errors(response.get_response), methods=["GET"]
        ),
        Route(
            "/v1/responses/{response_id}",
            answers_errors(response.delete_response),
            methods=["DELETE"],
        ),
        Route(
            "/v1/responses/{response_id}/cancel",
            answers_errors(response.cancel_response),
            methods=["POST"],
        ),
        Route("/v1/load_lora_adapter", answers_errors(load_lora), methods=["POST"]),
        Route("/v1/unload_lora_adapter", answers_errors(unload_lora), methods=["POST"]),
        # vLLM's scale-out API: render, generate (tokens in, tokens out), derender, abort
        Route(
            "/v1/chat/completions/render", scale_out(text("text", render.chat)), methods=["POST"]
        ),
        Route(
            "/v1/completions/render",
            scale_out(text("prompt", render.completions)),
            methods=["POST"],
        ),
        Route("/v1/messages/render", scale_out(text("text", render.messages)), methods=["POST"]),
        Route("/v1/responses/render", scale_out(text("text", render.responses)), methods=["POST"]),
        counted("/inference/v1/generate", scale_out(tokens_out.generate)),
        # (vLLM's legacy /abort_requests, above, is its --tokens-only's; otherwise, as in
        # vLLM, that path is the development routes')
        Route(
            "/inference/v1/abort_requests", scale_out(tokens_out.abort_requests), methods=["POST"]
        ),
        Route(
            "/v1/chat/completions/derender",
            scale_out(text("text", derender.chat)),
            methods=["POST"],
        ),
        Route(
            "/v1/completions/derender",
            scale_out(text("text", derender.completions)),
            methods=["POST"],
        ),
        Route("/tokenize", answers_errors(text("text", tokens.tokenize)), methods=["POST"]),
        Route("/detokenize", answers_errors(text("text", tokens.detokenize)), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/ping", health, methods=["GET", "POST"]),  # SageMaker's health check
        Route("/invocations", answers_errors(invocations), methods=["POST"]),
        Route("/v1/models/{model:path}", answers_errors(model_card), methods=["GET"]),
        Route("/version", version, methods=["GET"]),
        Route("/load", load, methods=["GET"]),
        Route("/tokenizer_info", answers_errors(tokens.get_tokenizer_info), methods=["GET"]),
        Route("/start_profile", answers_errors(profile.start), methods=["POST"]),
        Route("/stop_profile", answers_errors(profile.stop), methods=["POST"]),
    ]


def _permission(created: int) -> dict[str, Any]:
    """vLLM's ``ModelPermission`` entry (OpenAI's legacy field; nothing is restricted)."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": created,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
