"""vLLM's ``POST /start_profile`` and ``POST /stop_profile``: one profiling session over
every LLM model served with a ``profiler_config`` (``--profiler-config``).

A session records the engines' steps (kiln.llm.profiler) until ``/stop_profile``, which
answers once the traces are written. A second start while one runs is vLLM's 409; without
a profiled model both paths are 404, as vLLM does not serve them then."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from kiln.core.errors import KilnError
from kiln.frontends.openai.endpoint import BodyReader, json_object
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.engine_client import EngineClient
from kiln.llm.profiler_config import check_session
from kiln.server.server import Server

log = logging.getLogger("kiln.frontends.openai.profile")
#: a start body's size: its fields are a prefix and two integers
MAX_BODY = 4096


class ProfileRoutes:
    def __init__(self, server: Server, reader: BodyReader) -> None:
        self.server = server
        self.reader = reader
        self.lock = asyncio.Lock()  # one start or stop at a time
        #: the engines the running session started (empty: none runs)
        self.session: list[EngineClient] = []

    def _profiled(self) -> list[EngineClient]:
        engines = [e for e in self.server.llm_engines().values() if e.profiling]
        if not engines:
            raise OpenAIError(
                "profiling is not enabled: no model is served with --profiler-config "
                "(the parameter profiler_config)",
                404,
            )
        return engines

    async def _body(self, request: Request) -> dict[str, Any]:
        """vLLM's start body is optional: none, or an empty one, asks for the defaults. A
        declared length over ``MAX_BODY`` is refused before anything is read."""
        declared = request.headers.get("content-length", "")
        digits = len(declared) <= 20 and declared.isascii() and declared.isdigit()
        if digits and int(declared) > MAX_BODY:
            raise OpenAIError(
                f"the /start_profile body holds {declared} bytes, more than {MAX_BODY}", 413
            )
        raw = await self.reader.read_body(request)
        if not raw.strip():
            return {}
        if len(raw) > MAX_BODY:  # three small fields: never parsed on the loop at size
            raise OpenAIError(
                f"the /start_profile body holds {len(raw)} bytes, more than {MAX_BODY}", 413
            )
        return json_object(raw)

    async def start(self, request: Request) -> Response:
        engines = self._profiled()
        overrides = await self._body(request)
        try:
            prefix, delay, limit = check_session(
                overrides.get("profile_prefix"),
                overrides.get("delay_iterations"),
                overrides.get("max_iterations"),
            )
        except KilnError as exc:
            field = str(exc).split(" ", 1)[0]
            raise OpenAIError(str(exc), param=field) from None
        async with self.lock:
            if self.session:
                raise OpenAIError(
                    "A profiling session is already active. Call /stop_profile before "
                    "starting another session.",
                    409,
                )
            started: list[EngineClient] = []
            try:
                for engine in engines:
                    await engine.start_profile(prefix, delay, limit)
                    started.append(engine)
            except KilnError:
                for engine in started:  # all of them or none
                    await engine.stop_profile()
                raise
            self.session = started
        log.info("profiler started for %s", ", ".join(e.model_name for e in started))
        return Response(status_code=200)

    async def stop(self, request: Request) -> Response:
        self._profiled()
        async with self.lock:
            session, self.session = self.session, []
            for engine in session:
                try:
                    files = await engine.stop_profile()
                except KilnError as exc:  # unloaded meanwhile: nothing left to write
                    log.warning("profiler: model '%s': %s", engine.model_name, exc)
                    continue
                log.info("profiler: model '%s' wrote %s", engine.model_name, ", ".join(files))
        return Response(status_code=200)
