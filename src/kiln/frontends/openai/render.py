"""vLLM's render routes (its scale-out API): a chat, completions or Messages request
prepared exactly as its own route prepares it (the same ``chat_setup`` / ``completion_setup``:
template, tools, special tokens, truncation, the server's defaults, every check), answered
as vLLM's ``GenerateRequest`` (prompt token ids and vLLM's ``SamplingParams``) for
``/inference/v1/generate``, without generating."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.core.trace import http_slot
from kiln.frontends.openai import messages, responses
from kiln.frontends.openai.endpoint import BodyReader, json_response, received
from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.preparation import chat_setup, completion_setup
from kiln.frontends.openai.protocol import (
    CHAT_FIELDS,
    OpenAIError,
    body_request_id,
    check_fields,
)
from kiln.frontends.openai.request_ids import request_id
from kiln.frontends.openai.response_fields import renamed
from kiln.frontends.openai.response_store import ResponseStore
from kiln.llm.sequence import SamplingParams
from kiln.llm.structured import StructuredOutputsParams
from kiln.server.server import Server


def vllm_sampling_params(req: GenerationRequest, params: SamplingParams) -> dict[str, Any]:
    """``params`` (with the request's output options, which kiln keeps beside them) under
    vLLM's ``SamplingParams`` field names, as ``/inference/v1/generate`` reads them back."""
    out: dict[str, Any] = {
        "n": params.n,
        "presence_penalty": params.presence_penalty,
        "frequency_penalty": params.frequency_penalty,
        "repetition_penalty": params.repetition_penalty,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "seed": params.seed,
        "stop": list(req.stop),
        "stop_token_ids": list(params.stop_token_ids),
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.logprobs,
        "prompt_logprobs": params.prompt_logprobs if req.prompt_logprobs_field else None,
        "skip_special_tokens": req.skip_special_tokens,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "bad_words": list(req.bad_words),
    }
    optional: dict[str, Any] = {
        "logit_bias": {str(t): b for t, b in params.logit_bias} or None,
        "allowed_token_ids": list(params.allowed_token_ids) or None,
        "logprob_token_ids": list(params.logprob_token_ids) or None,
        "structured_outputs": _structured(params.structured_outputs),
        "thinking_token_budget": params.thinking_token_budget,
        "stream_interval": params.stream_interval,
    }
    out.update((k, v) for k, v in optional.items() if v is not None)
    return out


def _structured(spec: StructuredOutputsParams | None) -> dict[str, Any] | None:
    """kiln's constraint as vLLM's ``StructuredOutputsParams`` object."""
    if spec is None:
        return None
    value: Any
    if spec.kind == "json_object":
        value = True
    elif spec.kind in ("json", "choice"):
        value = json.loads(spec.spec)
    else:
        value = spec.spec
    out: dict[str, Any] = {spec.kind: value}
    if spec.disable_any_whitespace:
        out["disable_any_whitespace"] = True
    if spec.disable_additional_properties:
        out["disable_additional_properties"] = True
    if spec.whitespace_pattern is not None:
        out["whitespace_pattern"] = spec.whitespace_pattern
    return out


def generate_request(
    req: GenerationRequest, ids: list[int], params: SamplingParams, rid: str, body: dict[str, Any]
) -> dict[str, Any]:
    """vLLM's ``GenerateRequest`` of one prepared prompt."""
    given = body.get("stream_options") if req.stream else None
    options = None  # vLLM's StreamOptions, both fields written out
    if isinstance(given, dict):
        keys = ("include_usage", "continuous_usage_stats")
        options = {key: given.get(key) is True for key in keys}
    return {
        "request_id": rid,
        "token_ids": ids,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": vllm_sampling_params(req, params),
        "model": req.model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": req.stream,
        "stream_options": options,
        "cache_salt": params.cache_salt,
        "priority": req.priority,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
    }


class RenderRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def chat(self, request: Request) -> Response:
        """vLLM's ``POST /v1/chat/completions/render``: one ``GenerateRequest``."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        check_fields(body, CHAT_FIELDS, "chat completions render")
        return json_response(await self._chat(body, "Chat Completions"))

    async def messages(self, request: Request) -> Response:
        """vLLM's ``POST /v1/messages/render``: an Anthropic Messages request, converted as
        ``/v1/messages`` converts it, rendered as chat."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        return json_response(await self._chat(messages.chat_body(body), "Messages"))

    async def responses(self, request: Request) -> Response:
        """vLLM's ``POST /v1/responses/render``: a Responses request, converted as
        ``/v1/responses`` converts it, rendered as chat. Stateless, as vLLM's:
        ``previous_response_id`` is refused."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        if body.get("previous_response_id") is not None:
            raise OpenAIError(
                "previous_response_id is not supported by the stateless render endpoint.",
                param="previous_response_id",
            )
        call = responses.ResponsesCall.read(body, ResponseStore())
        try:
            _, req, prepared = await chat_setup(self.server, call.chat_body, "Responses")
        except OpenAIError as exc:
            raise renamed(exc) from None
        ((ids, params),) = prepared
        rid = body_request_id(body) or f"resp_{request_id(None)}"  # at most 512 characters
        return json_response(generate_request(req, ids, params, rid, body))

    async def _chat(self, body: dict[str, Any], api: str) -> dict[str, Any]:
        _refuse_beam_search(body)
        _, req, prepared = await chat_setup(self.server, body, api)
        ((ids, params),) = prepared
        return generate_request(req, ids, params, f"chatcmpl-{request_id(req.request_id)}", body)

    async def completions(self, request: Request) -> Response:
        """vLLM's ``POST /v1/completions/render``: a list of ``GenerateRequest``, one per
        prompt (``cmpl-<id>``, or ``cmpl-<id>-<i>`` when there are several)."""
        body = await received(request, http_slot(self.server.tracer, request.headers), self.reader)
        _refuse_beam_search(body)
        _, req, prepared = await completion_setup(self.server, body)
        base = f"cmpl-{request_id(req.request_id)}"
        names = [base] if len(prepared) == 1 else [f"{base}-{i}" for i in range(len(prepared))]
        return json_response(
            [
                generate_request(req, ids, params, name, body)
                for name, (ids, params) in zip(names, prepared, strict=True)
            ]
        )


def _refuse_beam_search(body: dict[str, Any]) -> None:
    if body.get("use_beam_search") is True:  # vLLM's rule: a search is no one request
        raise OpenAIError(
            "Beam search is not supported by the render endpoint", param="use_beam_search"
        )
