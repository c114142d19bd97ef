"""OpenAI's Responses API routes (``responses.py`` and the ``response_*`` modules hold its
wire format), with their state: the stored responses, the background responses still running
and the events of the streamed ones."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from kiln.core.trace import http_slot
from kiln.frontends.openai import response_events, response_fields, response_store, responses
from kiln.frontends.openai.answers import answer_body, outputs
from kiln.frontends.openai.endpoint import BodyReader, json_response, received
from kiln.frontends.openai.generation import started
from kiln.frontends.openai.generation_request import GenerationRequest
from kiln.frontends.openai.logprobs import chat_logprobs
from kiln.frontends.openai.preparation import chat_setup
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.engine_client import EngineClient
from kiln.llm.sequence import SamplingParams
from kiln.server.server import Server

if TYPE_CHECKING:  # importing the sampler imports torch
    from kiln.llm.sampler import TokenLogprobs

# the name the routes' log lines have carried since they were one module
log = logging.getLogger("kiln.frontends.openai.routes")

#: streamed background responses whose events are kept for GET ?stream=true
MAX_FEEDS = 64


class ResponseRoutes:
    """``reader``: the HTTP frontend whose body limits apply."""

    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server, self.reader = server, reader
        #: the Responses API's stored responses (``store``, ``previous_response_id``)
        self.stored = response_store.ResponseStore()
        #: background responses still running, by id (their engine requests bound them)
        self.running: dict[str, asyncio.Task[None]] = {}
        #: streamed background responses' events, by id (the MAX_FEEDS most recent)
        self.feeds: dict[str, response_events.EventFeed] = {}

    async def create_response(self, request: Request) -> Response:
        slot = http_slot(self.server.tracer, request.headers)
        body = await received(request, slot, self.reader)
        call = responses.ResponsesCall.read(body, self.stored)
        try:
            llm, req, prepared = await chat_setup(self.server, call.chat_body, "Responses")
        except OpenAIError as exc:
            raise response_fields.renamed(exc) from None
        rid = f"resp_{uuid.uuid4().hex}"
        if call.background:  # answered now, run on: GET fetches it, /cancel stops it
            response = call.skeleton(rid, req.model, "queued")
            self.stored.put(response, call.conversation)
            feed = None
            if req.stream:  # its events kept, for this request and GET ?stream=true
                feed = self.feeds[rid] = response_events.EventFeed()
                while len(self.feeds) > MAX_FEEDS:
                    self.feeds.pop(next(iter(self.feeds)))
            task = asyncio.create_task(self._run_background(llm, req, prepared, call, rid, feed))
            self.running[rid] = task
            task.add_done_callback(lambda _: self.running.pop(rid, None))
            if feed is not None:
                return StreamingResponse(feed.read(), media_type="text/event-stream")
            return json_response(response)
        if req.stream:
            deltas = await started(outputs(llm, req, prepared, rid, True))
            counts = sum(len(ids) for ids, _ in prepared)
            tok = llm.tokenizer

            def entries(tokens: list[TokenLogprobs]) -> list[dict[str, Any]]:
                content: list[dict[str, Any]] = chat_logprobs(tok, tokens)["content"]
                return content

            scored = entries if call.logprobs else None
            events = response_events.events(call, rid, req, deltas, counts, self.stored, scored)
            return StreamingResponse(events, media_type="text/event-stream")
        answer = await answer_body(llm, req, prepared, chat=True)
        return json_response(call.finish(rid, answer, self.stored))

    async def _run_background(
        self,
        llm: EngineClient,
        req: GenerationRequest,
        prepared: list[tuple[list[int], SamplingParams]],
        call: responses.ResponsesCall,
        rid: str,
        feed: response_events.EventFeed | None = None,
    ) -> None:
        """A background response's run: its stored object goes ``in_progress``, then is
        replaced by the finished one (or marked ``failed`` with the error); a streamed
        one's events go to ``feed`` as they come."""

        def mark(status: str, error: dict[str, Any] | None = None) -> None:
            with contextlib.suppress(OpenAIError):  # evicted from the store meanwhile
                current = self.stored.get(rid)
                if current["status"] in ("queued", "in_progress"):
                    current["status"] = status
                    if error is not None:
                        current["error"] = error

        mark("in_progress")
        if feed is not None:
            try:
                deltas = outputs(llm, req, prepared, rid, True)
                scored = None
                if call.logprobs:
                    tok = llm.tokenizer
                    scored = lambda t: chat_logprobs(tok, t)["content"]  # noqa: E731
                counts = sum(len(ids) for ids, _ in prepared)
                stream = response_events.events(call, rid, req, deltas, counts, self.stored, scored)
                async with contextlib.aclosing(stream) as events:
                    async for event in events:
                        feed.append(event)
            except Exception:
                log.exception("background response %s failed", rid)
                mark("failed", {"code": "server_error", "message": "see the server's log"})
            finally:
                feed.close()
            return
        try:
            answer = await answer_body(llm, req, prepared, chat=True)
        except OpenAIError as exc:
            mark("failed", {"code": exc.code or exc.type, "message": exc.message})
            return
        except Exception:
            log.exception("background response %s failed", rid)
            mark("failed", {"code": "server_error", "message": "see the server's log"})
            return
        with contextlib.suppress(OpenAIError):
            if self.stored.get(rid)["status"] == "cancelled":
                return  # cancelled as it finished: stays cancelled
        call.finish(rid, answer, self.stored)

    async def get_response(self, request: Request) -> Response:
        """A stored response; with ``?stream=true`` a streamed background response's events
        (from after ``starting_after``, a sequence number), as they come."""
        rid = request.path_params["response_id"]
        response = self.stored.get(rid)
        if request.query_params.get("stream") not in ("true", "1"):
            return json_response(response)
        feed = self.feeds.get(rid)
        if feed is None:
            raise OpenAIError(
                f"response '{rid[:100]}' was not created with background and stream: it has "
                "no events to stream",
                param="stream",
            )
        raw = request.query_params.get("starting_after", "-1")
        if not raw.lstrip("-").isdigit() or not -1 <= int(raw) < 1 << 31:
            raise OpenAIError(
                "'starting_after' must be a sequence number (an integer, -1 for all)",
                param="starting_after",
            )
        return StreamingResponse(feed.read(int(raw)), media_type="text/event-stream")

    async def cancel_response(self, request: Request) -> Response:
        """OpenAI's ``POST /v1/responses/{id}/cancel``: a background response still queued
        or running is stopped (its engine request aborted) and marked ``cancelled``."""
        rid = request.path_params["response_id"]
        response = self.stored.get(rid)
        if response["status"] not in ("queued", "in_progress"):
            raise OpenAIError(
                f"Cannot cancel a response that is {response['status']} (only a background "
                "response still queued or in progress)",
                param="response_id",
            )
        response["status"] = "cancelled"
        task = self.running.get(rid)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return json_response(response)

    async def delete_response(self, request: Request) -> Response:
        return json_response(self.stored.delete(request.path_params["response_id"]))
