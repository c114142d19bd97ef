"""The id of an OpenAI answer, as vLLM builds it: ``chatcmpl-<X-Request-Id>`` when the
request carries that header, else ``chatcmpl-<the body's request_id>``, else a random one.

:func:`remember_header` runs where a route reads its body (``endpoint.read_json``), in the task
that answers the request, so a context variable carries the header to wherever the id is
made (a streamed answer's generator runs in the same task's context).
"""

from __future__ import annotations

import uuid
from contextvars import ContextVar

from starlette.requests import Request

#: the longest X-Request-Id a request may carry (400 beyond)
MAX_LENGTH = 512

_HEADER_ID: ContextVar[str | None] = ContextVar("kiln_openai_request_id", default=None)


class RequestIdError(ValueError):
    pass


def remember_header(request: Request) -> None:
    """Keep the request's ``X-Request-Id`` (an empty one counts as none) for
    :func:`request_id`; :class:`RequestIdError` when it is too long or not printable
    ASCII (it becomes part of the answer's id)."""
    value = request.headers.get("x-request-id") or None
    if value is not None:
        if len(value) > MAX_LENGTH:
            raise RequestIdError(
                f"the X-Request-Id header is {len(value)} characters long: at most "
                f"{MAX_LENGTH} are taken"
            )
        if not (value.isascii() and value.isprintable()):
            raise RequestIdError("the X-Request-Id header must be printable ASCII")
    _HEADER_ID.set(value)


def request_id(body_id: str | None) -> str:
    """The header's id, else ``body_id`` (the body's ``request_id``), else a random one."""
    return _HEADER_ID.get() or body_id or uuid.uuid4().hex
