"""The routes that generate from a prompt or a conversation: OpenAI's completions and chat
completions, vLLM's batch chat completions, and Anthropic's Messages API (through chat)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.core.trace import http_slot
from kiln.frontends.openai import embeddings, messages
from kiln.frontends.openai.answers import answer_body, event_stream, respond
from kiln.frontends.openai.endpoint import (
    BodyReader,
    generator_named,
    json_response,
    read_json,
    received,
)
from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.preparation import chat_setup, completion_setup, tokenized
from kiln.frontends.openai.protocol import CHAT_FIELDS, OpenAIError, check_fields
from kiln.frontends.openai.request_ids import request_id
from kiln.frontends.openai.tokens_only import check_completion
from kiln.llm.engine_client import EngineClient
from kiln.llm.sequence import SamplingParams
from kiln.server.server import Server

#: conversations in one /v1/chat/completions/batch request
MAX_BATCH_CONVERSATIONS = 1024


class CompletionRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader

    async def completions(self, request: Request) -> Response:
        slot = http_slot(self.server.tracer, request.headers)
        body = await received(request, slot, self.reader)
        llm, req, prepared = await completion_setup(self.server, body)
        if self.server.options.tokens_only:  # token ids in (tokens_only.gated): no text out
            check_completion(req)
            req.detokenize = False
        return await respond(llm, req, prepared, chat=False)

    async def chat(self, request: Request) -> Response:
        slot = http_slot(self.server.tracer, request.headers)
        body = await received(request, slot, self.reader)
        check_fields(body, CHAT_FIELDS, "chat completions")
        llm, req, prepared = await chat_setup(self.server, body, "Chat Completions")
        return await respond(llm, req, prepared, chat=True)

    async def batch_chat(self, request: Request) -> Response:
        """vLLM's ``POST /v1/chat/completions/batch``: ``messages`` holds conversations,
        each rendered and generated as its own chat request with the body's other fields;
        one choice per conversation, indexed in order, usage summed. Not streamed, without
        tools, beam search or ``n`` > 1, as in vLLM."""
        slot = http_slot(self.server.tracer, request.headers)
        body = await received(request, slot, self.reader)
        check_fields(body, CHAT_FIELDS, "batch chat completions")
        conversations = body.get("messages")
        if (
            not isinstance(conversations, list)
            or not conversations
            or not all(isinstance(c, list) and c for c in conversations)
        ):
            raise OpenAIError(
                "'messages' must be a non-empty list of conversations, each a non-empty "
                "list of messages",
                param="messages",
            )
        if len(conversations) > MAX_BATCH_CONVERSATIONS:
            raise OpenAIError(
                f"'messages' holds {len(conversations)} conversations, more than "
                f"{MAX_BATCH_CONVERSATIONS}",
                param="messages",
            )
        for field, asks in (("stream", body.get("stream") not in (None, False)),
                            ("tools", bool(body.get("tools"))),
                            ("use_beam_search", body.get("use_beam_search") not in (None, False)),
                            ("n", body.get("n") not in (None, 1)),
                            ("echo", body.get("echo") not in (None, False))):  # fmt: skip
            if asks:
                raise OpenAIError(
                    f"Batch chat completions do not support '{field}': send each "
                    "conversation to /v1/chat/completions for it",
                    param=field,
                )
        llm: EngineClient | None = None
        first: GenerationRequest | None = None
        prompts: list[Any] = []
        prepared: list[tuple[list[int], SamplingParams]] = []
        for i, conversation in enumerate(conversations):
            try:
                llm, req, one = await chat_setup(
                    self.server, {**body, "messages": conversation}, "Chat Completions", llm
                )
            except OpenAIError as exc:
                if exc.param is not None and exc.param.startswith("messages"):
                    exc.param = f"messages[{i}]" + exc.param.removeprefix("messages")
                    exc.message = f"conversation {i}: {exc.message}"
                raise
            if first is None:  # the model known: the batch must fit its queue
                embeddings.check_queue(llm, req.priority, len(conversations),
                                       "{} conversations", "messages")  # fmt: skip
            first = first or req
            prompts += req.prompts
            prepared += one
        assert llm is not None and first is not None
        whole = replace(first, prompts=prompts)  # one request of every conversation's prompt
        return json_response(await answer_body(llm, whole, prepared, chat=True))

    async def anthropic_messages(self, request: Request) -> Response:
        """Anthropic's ``POST /v1/messages``, through chat completions (``messages.py``)."""
        slot = http_slot(self.server.tracer, request.headers)
        body = await received(request, slot, self.reader)
        chat_body = messages.chat_body(body)
        llm, req, prepared = await chat_setup(self.server, chat_body, "Messages")
        rid = f"msg_{request_id(None)}"  # X-Request-Id names it, as chat's
        if req.stream:
            events = await event_stream(llm, req, prepared, chat=True)
            prompt = sum(len(ids) for ids, _ in prepared)
            converted = messages.events(events, rid, req.model, prompt)
            return StreamingResponse(converted, media_type="text/event-stream")
        return json_response(
            messages.message(await answer_body(llm, req, prepared, chat=True), rid)
        )

    async def anthropic_count_tokens(self, request: Request) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens as the chat
        template renders the messages, the system prompt and the tools."""
        body = await read_json(request, self.reader)
        chat_body = messages.chat_body(body, count_only=True)
        if not isinstance(chat_body["model"], str):
            raise OpenAIError("'model' is required: a string", param="model")
        llm = generator_named(self.server, chat_body["model"], "Messages", body)
        counted = await asyncio.to_thread(tokenized, llm, chat_body)
        return json_response({"input_tokens": counted["count"]})
