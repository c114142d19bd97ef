"""Browsers as confused deputies: cross-site requests (CSRF) and DNS rebinding.

A web page the operator opens can send a ``text/plain`` POST (a CORS "simple request": no
preflight) to kiln on 127.0.0.1; without an API key that loads models (code execution with
``file:`` parameters) or changes settings. A page can also rebind its own host name to
127.0.0.1 and then read kiln's answers as same-origin. So, on every HTTP port:

- a request whose ``Host`` is not a name kiln answers to gets **421** (checked when kiln
  listens on loopback, or whenever ``--http-allowed-host`` is given);
- a state-changing request (POST, PUT, DELETE, PATCH) from a browser gets **403** when its
  ``Origin`` is neither kiln's own nor a ``--http-cors-allow-origin`` one, or when it says
  ``Sec-Fetch-Site: cross-site`` without such an origin.

Non-browser clients (tritonclient, curl) send neither header and are never refused.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

STATE_CHANGING = frozenset({"POST", "PUT", "DELETE", "PATCH"})
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def host_name(host: str) -> str:
    """``host[:port]`` -> the lowercase name, an IPv6 literal keeping its brackets."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[: end + 1] if end > 0 else host
    return host.partition(":")[0]


def is_loopback(bind: str) -> bool:
    if bind.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind.strip("[]")).is_loopback
    except ValueError:
        return False


def _bracketed(address: str) -> str:
    try:
        if ipaddress.ip_address(address.strip("[]")).version == 6:
            return "[" + address.strip("[]").lower() + "]"
    except ValueError:
        pass
    return address.lower()


@dataclass(frozen=True, slots=True)
class BrowserGuard:
    """``hosts``: the host names answered (``None``: any); ``cors_origins``: the
    ``--http-cors-allow-origin`` list, lowercase ("*" allows every origin)."""

    hosts: frozenset[bytes] | None
    cors_origins: frozenset[str]
    bind: str = ""
    # Host values already judged: the fast path then pays one dict lookup per request.
    _seen: dict[bytes, bool] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def create(
        cls, bind: str, allowed_hosts: Iterable[str] = (), cors_origins: Iterable[str] = ()
    ) -> BrowserGuard:
        extra = [host_name(h) for h in allowed_hosts]
        hosts = None
        # On 0.0.0.0 or a public address, any name may lead to kiln (a load balancer, a
        # DNS name): only a list the operator gives can be enforced there.
        if extra or is_loopback(bind):
            names = {*LOCAL_NAMES, _bracketed(bind), *extra}
            hosts = frozenset(n.encode("latin-1") for n in names if n)
        origins = frozenset(o.strip().lower().rstrip("/") for o in cors_origins)
        return cls(hosts, origins, bind)

    def host_ok(self, host: bytes) -> bool:
        """Whether kiln answers to ``Host: host``; one dict lookup once a value was seen."""
        ok = self._seen.get(host)
        if ok is None:
            if len(self._seen) >= 64:  # made-up names must not grow it without bound
                self._seen.clear()
            ok = self._seen[host] = self._judge(host)
        return ok

    def _judge(self, host: bytes) -> bool:
        if self.hosts is None or not host:  # no Host: HTTP/1.0, never a browser
            return True
        host = host.strip().lower()
        if host[:1] == b"[":  # an IPv6 literal: its colons are not the port's
            return host[: host.find(b"]") + 1] in self.hosts
        return host.partition(b":")[0] in self.hosts

    def refusal(
        self, method: str, scheme: str, host: str | None, origin: str | None, site: str | None
    ) -> tuple[int, str] | None:
        """(status, message) when the request must be refused, else ``None``."""
        if host and not self.host_ok(host.encode("latin-1")):
            return 421, (
                f"kiln does not answer to host '{host_name(host)}' (it listens on {self.bind}): "
                "a browser page may have rebound that name to this address; add the name "
                "with --http-allowed-host if it is really kiln's"
            )
        if method not in STATE_CHANGING or (origin is None and site is None):
            return None
        if origin is not None:
            o = origin.strip().lower()
            if o in self.cors_origins or "*" in self.cors_origins:
                return None
            own = host is not None and o == f"{scheme}://{host.strip().lower()}"
            if not own:
                return 403, (
                    f"cross-origin {method} from '{origin}' refused: browsers may change "
                    "kiln's state only from its own pages or a --http-cors-allow-origin origin"
                )
        if site is not None and site.strip().lower() == "cross-site":
            return 403, (
                f"cross-site {method} refused (Sec-Fetch-Site: cross-site): browsers may change "
                "kiln's state only from its own pages or a --http-cors-allow-origin origin"
            )
        return None


class BrowserGuardMiddleware:
    """The outermost ASGI layer of each HTTP port: a refused request reaches nothing else
    (not CORS, not the API-key check, not a route)."""

    def __init__(self, app: ASGIApp, guard: BrowserGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = origin = site = None
            for key, value in scope["headers"]:
                if key == b"host":
                    host = value.decode("latin-1")
                elif key == b"origin":
                    origin = value.decode("latin-1")
                elif key == b"sec-fetch-site":
                    site = value.decode("latin-1")
            refused = self.guard.refusal(
                scope["method"], scope.get("scheme", "http"), host, origin, site
            )
            if refused is not None:
                await _reply(send, *refused)
                return
        await self.app(scope, receive, send)


async def _reply(send: Send, status: int, message: str) -> None:
    body = orjson.dumps({"error": message})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        # the body was not read: the connection cannot carry another request
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
