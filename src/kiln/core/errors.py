"""One error type for the whole server; frontends map its status to HTTP/gRPC codes."""

from __future__ import annotations

import enum


class Status(enum.Enum):
    """Triton's error codes (plus the HTTP-only ones kiln needs)."""

    INVALID_ARG = "INVALID_ARG"
    UNKNOWN = "UNKNOWN"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    CANCELLED = "CANCELLED"
    NOT_FOUND = "NOT_FOUND"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    PERMISSION_DENIED = "PERMISSION_DENIED"
    INTERNAL = "INTERNAL"
    UNSUPPORTED = "UNSUPPORTED"
    UNAVAILABLE = "UNAVAILABLE"
    REQUEST_TIMEOUT = "REQUEST_TIMEOUT"  # HTTP-only: a client too slow to send its body
    CONFLICT = "CONFLICT"  # HTTP-only: the server's state refuses it now (409)

    @property
    def http_status(self) -> int:
        return _HTTP[self]

    @property
    def grpc_code(self) -> str:
        """The ``grpc.StatusCode`` member name (core does not import grpc)."""
        return _GRPC[self]


_HTTP = {
    Status.INVALID_ARG: 400,
    Status.UNKNOWN: 400,
    Status.ALREADY_EXISTS: 400,
    Status.CANCELLED: 400,
    Status.NOT_FOUND: 404,
    Status.PAYLOAD_TOO_LARGE: 413,
    Status.UNAUTHENTICATED: 401,
    Status.PERMISSION_DENIED: 403,
    Status.INTERNAL: 500,
    Status.UNSUPPORTED: 501,
    Status.UNAVAILABLE: 503,
    Status.REQUEST_TIMEOUT: 408,
    Status.CONFLICT: 409,
}

# Triton's mapping (src/grpc/grpc_utils.cc), plus the HTTP-only statuses kiln has.
_GRPC = {
    Status.INVALID_ARG: "INVALID_ARGUMENT",
    Status.UNKNOWN: "UNKNOWN",
    Status.ALREADY_EXISTS: "ALREADY_EXISTS",
    Status.CANCELLED: "CANCELLED",
    Status.NOT_FOUND: "NOT_FOUND",
    Status.PAYLOAD_TOO_LARGE: "RESOURCE_EXHAUSTED",
    Status.UNAUTHENTICATED: "UNAUTHENTICATED",
    Status.PERMISSION_DENIED: "PERMISSION_DENIED",
    Status.INTERNAL: "INTERNAL",
    Status.UNSUPPORTED: "UNIMPLEMENTED",
    Status.UNAVAILABLE: "UNAVAILABLE",
    Status.REQUEST_TIMEOUT: "DEADLINE_EXCEEDED",
    Status.CONFLICT: "ABORTED",
}


class KilnError(Exception):
    """An error a client should see: ``status`` decides the HTTP/gRPC code."""

    def __init__(self, message: str, status: Status = Status.INVALID_ARG) -> None:
        super().__init__(message)
        self.message = message
        self.status = status

    def __str__(self) -> str:
        return self.message


def invalid_arg(message: str) -> KilnError:
    return KilnError(message, Status.INVALID_ARG)


def not_found(message: str) -> KilnError:
    return KilnError(message, Status.NOT_FOUND)


def unavailable(message: str) -> KilnError:
    return KilnError(message, Status.UNAVAILABLE)


def internal(message: str) -> KilnError:
    return KilnError(message, Status.INTERNAL)


def unsupported(message: str) -> KilnError:
    return KilnError(message, Status.UNSUPPORTED)
