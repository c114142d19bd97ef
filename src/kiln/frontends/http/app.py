"""KServe v2 REST (+ Triton's extensions) as an ASGI app. It only translates: every
decision is core's. Paths follow Triton's router (``src/http_server.cc``)."""

from __future__ import annotations

import asyncio
import gzip
import logging
import zlib
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import orjson
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive

from kiln.core.errors import KilnError, Status
from kiln.core.header_forward import header_forward
from kiln.frontends import shm_io
from kiln.frontends.http import generate
from kiln.frontends.http.codec import (
    decode_raw_request,
    decode_request,
    encode_elements,
    encode_response,
    parse_body,
)
from kiln.frontends.http.fast_infer import FastInfer
from kiln.frontends.http.openapi import openapi_document
from kiln.frontends.json_pieces import OFF_LOOP_PARSE_BYTES
from kiln.frontends.tensors import OFF_LOOP_DECODE_BYTES, OFF_LOOP_ENCODE_ELEMENTS
from kiln.server.server import Server

log = logging.getLogger(__name__)

# Compressed bodies above this inflate on a worker thread (``inflate``).
INLINE_INFLATE_BYTES = 2**10
# Response bodies above this are compressed on a worker thread (``compress``).
INLINE_COMPRESS_BYTES = 2**14
#: Accept-Encoding items read (a header is bounded by --http-max-header-size anyway)
MAX_ACCEPT_ITEMS = 64

Handler = Callable[[Request], Awaitable[Response]]


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(
        orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), status, media_type="application/json"
    )


def error_response(message: str, status: int) -> Response:
    return json_response({"error": message}, status)


def response_encoding(accept: str) -> str:
    """The response's Content-Encoding for an Accept-Encoding header, as Triton picks it:
    among ``gzip``, ``deflate`` and ``identity`` the one of highest ``q`` (the first on a
    tie; no ``q``: 1), ``q=0`` meaning "not this one"; "" for identity, also when nothing
    is acceptable. Case and spaces as RFC 9110 allows them; anything else is skipped."""
    best, weight = "", 0.0
    for item in accept.split(",")[:MAX_ACCEPT_ITEMS]:
        coding, _, params = item.partition(";")
        coding = coding.strip().lower()
        if coding not in ("gzip", "deflate", "identity"):
            continue
        q = 1.0
        name, _, value = params.partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value.strip()[:8])
            except ValueError:
                continue
            if not 0.0 <= q <= 1.0:
                continue
        if q > weight:
            best, weight = ("" if coding == "identity" else coding), q
    return best


class HttpFrontend:
    def __init__(self, server: Server, read_timeout_secs: float = 0.0) -> None:
        self.server = server
        self.max_body = server.options.max_request_bytes
        #: --http-header-forward-pattern (None: no header becomes a parameter)
        self.header_forward = header_forward(
            server.options.http_header_forward_pattern, "--http-header-forward-pattern"
        )
        # A body trickling in slower than this is cut off (slow-client protection); 0: none.
        self.read_timeout = read_timeout_secs

    # ---- plumbing --------------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        h = request.headers
        return await self.read_asgi_body(
            h.get("content-length"), h.get("content-encoding", ""), request.receive
        )

    async def read_asgi_body(self, declared: str | None, encoding: str, receive: Receive) -> bytes:
        """The whole body of a request from its ASGI ``receive``: bounded in size and time,
        and inflated when ``encoding`` (its Content-Encoding) says so."""
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            raise KilnError(
                f"request body of {declared} bytes exceeds the limit of {self.max_body} bytes "
                "(--http-max-input-size)",
                Status.PAYLOAD_TOO_LARGE,
            )
        chunks: list[bytes] = []
        try:
            # the first chunk too: a client that sends the head and no body byte waits here
            async with asyncio.timeout(self.read_timeout or None):
                await self._read_chunks(receive, chunks, 0)
        except TimeoutError:
            raise KilnError(
                f"request body not received within {self.read_timeout:g}s "
                "(--http-read-timeout-secs)",
                Status.REQUEST_TIMEOUT,
            ) from None
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        return await self.inflate(body, encoding) if encoding else body

    async def inflate(self, body: bytes, encoding: str) -> bytes:
        """:meth:`decode_body`, on a worker thread for all but tiny compressed bodies:
        deflate inflates up to ~1,000-fold, so 60 KB of gzip took a quarter of a second of
        the event loop (zlib gives up the GIL while it works on a thread)."""
        if len(body) > INLINE_INFLATE_BYTES and encoding.lower() in ("gzip", "deflate"):
            return await asyncio.to_thread(self.decode_body, body, encoding)
        return self.decode_body(body, encoding)

    def decode_body(self, body: bytes, encoding: str) -> bytes:
        """``body`` inflated as its Content-Encoding says (gzip, deflate or identity)."""
        encoding = encoding.lower()
        if encoding in ("gzip", "deflate"):
            return self._decompress(body, encoding)
        if encoding not in ("", "identity"):
            raise KilnError(f"unsupported Content-Encoding '{encoding}'", Status.UNSUPPORTED)
        return body

    def _check_size(self, body: bytes, before: int = 0) -> bytes:
        if before + len(body) > self.max_body:
            raise KilnError(
                f"request body exceeds the limit of {self.max_body} bytes (--http-max-input-size)",
                Status.PAYLOAD_TOO_LARGE,
            )
        return body

    async def _read_chunks(self, receive: Receive, chunks: list[bytes], total: int) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            chunk = self._check_size(message.get("body", b""), total)
            total += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return

    def _decompress(self, body: bytes, encoding: str) -> bytes:
        wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
        d = zlib.decompressobj(wbits)
        try:
            out = d.decompress(body, self.max_body + 1)
        except zlib.error as exc:
            raise KilnError(f"unable to {encoding}-decompress the request body: {exc}") from None
        if len(out) > self.max_body or d.unconsumed_tail:
            raise KilnError(
                f"decompressed request body exceeds the limit of {self.max_body} bytes",
                Status.PAYLOAD_TOO_LARGE,
            )
        # The stream must end exactly where the body does: zlib stops at the end of the first
        # gzip member, so trailing bytes or a second member would be dropped unseen.
        if not d.eof:
            raise KilnError(f"the {encoding}-compressed request body is truncated")
        if d.unused_data:
            raise KilnError(
                f"{len(d.unused_data)} bytes follow the end of the {encoding}-compressed "
                "request body (trailing data or a second gzip member)"
            )
        return out

    async def compress(self, accept: str, body: bytes, headers: dict[str, str]) -> bytes:
        """:meth:`encode_body`, on a worker thread for bodies over 16 KiB: level-1 deflate
        runs at ~30 ms a MB, so 32 MB of tensor output held every other client for most
        of a second (zlib gives up the GIL on a thread). Under it, the hop costs more."""
        chosen = response_encoding(accept)
        if len(body) > INLINE_COMPRESS_BYTES and chosen:
            body, encoding = await asyncio.to_thread(self.encode_body, chosen, body)
        else:
            body, encoding = self.encode_body(chosen, body)
        if encoding:
            headers["Content-Encoding"] = encoding
        return body

    @staticmethod
    def encode_body(encoding: str, body: bytes) -> tuple[bytes, str]:
        """``body`` compressed as ``encoding`` (``response_encoding``'s choice), and its
        Content-Encoding ("" when it is sent as it is)."""
        if encoding == "gzip":
            return gzip.compress(body, compresslevel=1), "gzip"
        if encoding == "deflate":
            return zlib.compress(body, 1), "deflate"
        return body, ""

    async def json_body(self, request: Request) -> dict[str, Any]:
        body = await self.read_body(request)
        return await parse_body(body) if body.strip() else {}

    # ---- health / metadata -----------------------------------------------------------
    async def live(self, request: Request) -> Response:
        return Response(status_code=200 if self.server.live else 400)

    async def ready(self, request: Request) -> Response:
        return Response(status_code=200 if self.server.ready else 400)

    async def metadata(self, request: Request) -> Response:
        return json_response(self.server.metadata())

    async def model_metadata(self, request: Request) -> Response:
        p = request.path_params
        return json_response(self.server.model_metadata(p["model"], p.get("version", "")))

    async def model_ready(self, request: Request) -> Response:
        p = request.path_params
        ok = self.server.model_ready(p["model"], p.get("version", ""))
        return Response(status_code=200 if ok else 400)

    async def model_config(self, request: Request) -> Response:
        p = request.path_params
        return json_response(self.server.model_config(p["model"], p.get("version", "")))

    async def stats(self, request: Request) -> Response:
        p = request.path_params
        return json_response(self.server.statistics(p.get("model", ""), p.get("version", "")))

    # ---- inference -------------------------------------------------------------------
    async def infer_body(
        self,
        name: str,
        version: str,
        body: bytes,
        raw_length: str | None,
        accept: str,
        forwarded: dict[str, str] | None = None,
    ) -> tuple[bytes, dict[str, str]]:
        """One inference from a request body to a response body and its headers; shared by
        the protocol-level fast path (:mod:`kiln.frontends.http.fast_protocol`) and its
        ASGI fallback (:mod:`kiln.frontends.http.fast_infer`). ``forwarded``: the headers
        ``--http-header-forward-pattern`` picked, as request parameters."""
        header_length: int | None = None
        if raw_length is not None:
            # ASCII digits only: int() also takes '+5', '1_0' and surrounding spaces
            if not (raw_length.isascii() and raw_length.isdigit()):
                raise KilnError(
                    f"Inference-Header-Content-Length must be an integer >= 0, got '{raw_length}'"
                )
            header_length = int(raw_length)
        if header_length == 0:
            sig = self.server.model(name, version).signature
            req = decode_raw_request(body, sig, name, version)
        else:
            limit = self.server.options.max_tensor_elements
            args = (body, header_length, name, version, limit)
            json_bytes = len(body) if header_length is None else header_length
            if len(body) > OFF_LOOP_DECODE_BYTES or json_bytes > OFF_LOOP_PARSE_BYTES:
                # JSON tensors cost Python work per element: a big body decodes on a thread,
                # its JSON parsed a piece at a time (json_pieces), so other clients are
                # answered meanwhile (small ones stay on the loop, where a thread hop would
                # cost more than the decode)
                req = await asyncio.to_thread(decode_request, *args)
            else:
                req = decode_request(*args)
        if forwarded:
            req.parameters.update(forwarded)
        resp = await shm_io.infer(self.server, req)
        if encode_elements(resp, req) > OFF_LOOP_ENCODE_ELEMENTS:
            # orjson holds the GIL for a whole call: a slice of elements a call, on a
            # thread, lets the loop answer others between slices; BYTES elements cost
            # Python work each, binary too (small responses stay inline)
            out, json_length = await asyncio.to_thread(encode_response, resp, req, True)
        else:
            out, json_length = encode_response(resp, req)
        headers: dict[str, str] = {}
        if json_length is not None:
            headers["Inference-Header-Content-Length"] = str(json_length)
            headers["Content-Type"] = "application/octet-stream"
        else:
            headers["Content-Type"] = "application/json"
        if accept:
            out = await self.compress(accept, out, headers)
        return out, headers

    async def generate(self, request: Request) -> Response:
        return await generate.generate(self, request)

    async def generate_stream(self, request: Request) -> Response:
        return await generate.generate_stream(self, request)

    # ---- repository ------------------------------------------------------------------
    async def repository_index(self, request: Request) -> Response:
        body = await self.json_body(request)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise KilnError("'ready' must be a boolean")
        return json_response(self.server.repository_index(ready))

    async def load(self, request: Request) -> Response:
        body = await self.json_body(request)
        # the server checks them (an object), naming the model
        await self.server.load_model(request.path_params["model"], body.get("parameters"))
        return Response(status_code=200)

    async def unload(self, request: Request) -> Response:
        body = await self.json_body(request)
        await self.server.unload_model(request.path_params["model"], body.get("parameters"))
        return Response(status_code=200)

    async def rollout(self, request: Request) -> Response:
        """GET: the model's rollout; POST: replace its policy (docs/rollouts.md)."""
        model = request.path_params["model"]
        if request.method == "GET":
            return json_response(self.server.rollout(model))
        body = await self.read_body(request)
        fields = await parse_body(body) if body.strip() else {}
        return json_response(self.server.set_rollout(model, fields))

    # ---- trace / logging -------------------------------------------------------------
    async def trace_setting(self, request: Request) -> Response:
        model = request.path_params.get("model", "")
        if model:
            self.server.model(model)  # unknown model -> 404, as for every model route
        updates: dict[str, list[str]] = {}
        if request.method == "POST":
            for key, value in (await self.json_body(request)).items():
                if value is None:
                    updates[key] = []  # null clears the setting
                elif isinstance(value, list):
                    updates[key] = value  # core checks its length, then its items
                elif isinstance(value, str | int) and not isinstance(value, bool):
                    updates[key] = [str(value)]
                else:
                    raise KilnError(f"trace setting '{key}' must be a string or list of strings")
        settings = self.server.trace_settings(model, updates)
        # Triton's JSON: trace_level is a list, every other setting a single string.
        return json_response(
            {k: v if k == "trace_level" else (v[0] if v else "") for k, v in settings.items()}
        )

    async def logging(self, request: Request) -> Response:
        logs = self.server.log_settings
        if request.method == "POST":
            updates = await self.json_body(request)
            return json_response(logs.update(updates) if updates else logs.get())
        return json_response(logs.get())

    async def openapi(self, request: Request) -> Response:
        return json_response(openapi_document())

    # ---- system shared memory --------------------------------------------------------
    async def shm_status(self, request: Request) -> Response:
        return json_response(self.server.shm.status(request.path_params.get("region", "")))

    async def shm_register(self, request: Request) -> Response:
        body = await self.json_body(request)
        key = body.get("key")
        if not isinstance(key, str):
            raise KilnError("shared memory register needs a 'key' string")
        self.server.shm.register(
            request.path_params["region"], key, body.get("offset", 0), body.get("byte_size", 0)
        )
        return Response(status_code=200)

    async def shm_unregister(self, request: Request) -> Response:
        self.server.shm.unregister(request.path_params.get("region", ""))
        return Response(status_code=200)

    async def cuda_shm_status(self, request: Request) -> Response:
        region = request.path_params.get("region", "")
        if region:
            raise KilnError(
                f"Unable to find cuda shared memory region: '{region}'", Status.NOT_FOUND
            )
        return json_response([])

    async def cuda_shm_unsupported(self, request: Request) -> Response:
        raise KilnError(
            "CUDA shared memory is not available: kiln was started without a CUDA device",
            Status.UNSUPPORTED,
        )

    # ---- app -------------------------------------------------------------------------
    def routes(self) -> list[Route]:
        def guard(handler: Handler) -> Handler:
            async def wrapped(request: Request) -> Response:
                try:
                    return await handler(request)
                except KilnError as exc:
                    return error_response(exc.message, exc.status.http_status)
                except Exception as exc:  # never let one request take the server down
                    log.exception("unhandled error on %s", request.url.path)
                    return error_response(f"internal error: {type(exc).__name__}: {exc}", 500)

            return wrapped

        r: list[Route] = []

        def add(path: str, handler: Handler, methods: list[str]) -> None:
            r.append(Route(path, guard(handler), methods=methods))

        def model_routes(suffix: str, handler: Handler, methods: list[str]) -> None:
            add("/v2/models/{model}/versions/{version}" + suffix, handler, methods)
            add("/v2/models/{model}" + suffix, handler, methods)

        # /infer is answered before Starlette (fast_infer.py, fast_protocol.py); then the
        # busiest first: Starlette tries routes in order, one regex each.
        model_routes("/generate", self.generate, ["POST"])
        model_routes("/generate_stream", self.generate_stream, ["POST"])
        add("/v2", self.metadata, ["GET"])
        add("/v2/health/live", self.live, ["GET"])
        add("/v2/health/ready", self.ready, ["GET"])
        add("/v2/models/stats", self.stats, ["GET"])
        model_routes("", self.model_metadata, ["GET"])
        model_routes("/ready", self.model_ready, ["GET"])
        model_routes("/config", self.model_config, ["GET"])
        model_routes("/stats", self.stats, ["GET"])
        for prefix in ("/v2/repository", "/v2/repository/{repository}"):
            add(prefix + "/index", self.repository_index, ["POST"])
            # {model:path}: an encoded '/' (..%2Fetc) arrives decoded; matching it here lets
            # core refuse the name precisely instead of a generic 404.
            add(prefix + "/models/{model:path}/load", self.load, ["POST"])
            add(prefix + "/models/{model:path}/unload", self.unload, ["POST"])
            add(prefix + "/models/{model:path}/rollout", self.rollout, ["GET", "POST"])
        add("/v2/trace/setting", self.trace_setting, ["GET", "POST"])
        add("/v2/models/{model}/trace/setting", self.trace_setting, ["GET", "POST"])
        add("/v2/logging", self.logging, ["GET", "POST"])
        add("/v2/openapi.json", self.openapi, ["GET"])
        shm = "/v2/systemsharedmemory"
        add(shm + "/status", self.shm_status, ["GET"])
        add(shm + "/region/{region}/status", self.shm_status, ["GET"])
        add(shm + "/region/{region}/register", self.shm_register, ["POST"])
        add(shm + "/unregister", self.shm_unregister, ["POST"])
        add(shm + "/region/{region}/unregister", self.shm_unregister, ["POST"])
        cuda = "/v2/cudasharedmemory"
        add(cuda + "/status", self.cuda_shm_status, ["GET"])
        add(cuda + "/region/{region}/status", self.cuda_shm_status, ["GET"])
        add(cuda + "/region/{region}/register", self.cuda_shm_unsupported, ["POST"])
        add(cuda + "/unregister", self.cuda_shm_status, ["POST"])
        add(cuda + "/region/{region}/unregister", self.cuda_shm_unsupported, ["POST"])
        return r

    def app(self, extra_routes: Sequence[BaseRoute] = ()) -> ASGIApp:
        """``extra_routes``: non-KServe routes on the same port (e.g. ``/api/history``).
        Inference takes the fast path; the rest goes through Starlette."""

        async def http_error(request: Request, exc: Exception) -> Response:
            assert isinstance(exc, HTTPException)
            return error_response(exc.detail, exc.status_code)

        routes = Starlette(
            routes=[*self.routes(), *extra_routes], exception_handlers={HTTPException: http_error}
        )
        return FastInfer(self, routes)
