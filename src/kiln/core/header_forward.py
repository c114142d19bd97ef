"""Triton's header forwarding: request headers whose name matches the operator's pattern
become string request parameters (``--http-header-forward-pattern``,
``--grpc-header-forward-pattern``), which a model reads as any other parameter
(``request.parameters()`` in the Python backend) and a rollout can be sticky on
(``sticky_key: parameter:x-user-id``): a user id set by a gateway, without a client change.

As Triton: the pattern is searched for in the header's name (a partial match, ``^x-user``
anchors it), case-insensitively unless it starts with ``(?-i)``; every value is a string.
Names are lower case (HTTP/2 and gRPC send them so; kiln's HTTP/1.1 server lowers them). A
forwarded header replaces a body parameter of the same name. The parameters Triton reserves
(``sequence_id``, ``priority``, ``timeout``, ``triton_*``, ...) and gRPC's binary metadata
(``*-bin``) are never forwarded: a header must not steer what those steer.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

#: request parameters with a meaning of their own (Triton's reserved ones, and kiln's
#: ``binary_data_output``): a header of that name is not forwarded
_TRITON_RESERVED = ("sequence_id", "sequence_start", "sequence_end", "priority", "timeout")
RESERVED = frozenset((*_TRITON_RESERVED, "headers", "binary_data_output"))
#: RE2's way to turn case-insensitivity off, which Triton's users write
_CASE_SENSITIVE = "(?-i)"


class HeaderForward:
    """A compiled ``--*-header-forward-pattern``."""

    def __init__(self, pattern: str, flag: str) -> None:
        text, flags = pattern, int(re.IGNORECASE)
        if text.startswith(_CASE_SENSITIVE):
            text, flags = text[len(_CASE_SENSITIVE) :], 0
        try:
            self.regex = re.compile(text, flags)
        except re.error as exc:
            raise ValueError(f"{flag}: '{pattern}' is not a regular expression: {exc}") from None
        self.pattern = pattern

    def select(self, headers: Iterable[tuple[str, str]]) -> dict[str, str]:
        """The headers to forward, by lower-case name (the last of a repeated one)."""
        out: dict[str, str] = {}
        search = self.regex.search
        for name, value in headers:
            key = name.lower()
            if search(name) is None or key in RESERVED or key.startswith("triton_"):
                continue
            if key.endswith("-bin"):  # gRPC binary metadata: bytes, not a string
                continue
            out[key] = value
        return out

    def select_raw(self, headers: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
        """``select`` over an HTTP server's raw (name, value) byte pairs (ISO-8859-1)."""
        return self.select((k.decode("latin-1"), v.decode("latin-1")) for k, v in headers)


def header_forward(pattern: str | None, flag: str) -> HeaderForward | None:
    """The compiled pattern (None when unset or empty); ``ValueError`` names ``flag``."""
    if not pattern:
        return None
    return HeaderForward(pattern, flag)
