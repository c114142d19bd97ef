"""HTTP adapter of :mod:`kiln.core.access`: an ASGI middleware in front of every route.

It maps a path to Triton's API group (the groups of Triton's HTTP router), asks the
shared policy, and answers 401 (``WWW-Authenticate: Bearer``) or 403 in Triton's words.
"""

from __future__ import annotations

import re
from http.cookies import SimpleCookie
from urllib.parse import parse_qs

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.core.access import AccessPolicy, ApiGroup

# The dashboard's page loads without a key (it holds no data); its fetches of /api/* carry
# this cookie, set when the page is opened as /dashboard/?api_key=KEY.
COOKIE = "kiln_api_key"

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
_RULES: list[tuple[re.Pattern[str], ApiGroup | None]] = [
    (re.compile(_MODEL + r"/infer$"), ApiGroup.INFERENCE),
    (re.compile(r"/v2/health/(live|ready)$"), ApiGroup.HEALTH),
    (re.compile(_MODEL + r"/ready$"), ApiGroup.HEALTH),
    (re.compile(r"/v2/models/stats$"), ApiGroup.STATISTICS),
    (re.compile(_MODEL + r"/stats$"), ApiGroup.STATISTICS),
    (re.compile(_MODEL + r"/config$"), ApiGroup.MODEL_CONFIG),
    (re.compile(r"/v2/models/[^/]+/trace/setting$"), ApiGroup.TRACE),
    (re.compile(r"/v2/trace/setting$"), ApiGroup.TRACE),
    (re.compile(r"/v2/logging$"), ApiGroup.LOGGING),
    (re.compile(r"/v2/repository(/.*)?$"), ApiGroup.MODEL_REPOSITORY),
    (re.compile(r"/v2/(system|cuda)sharedmemory(/.*)?$"), ApiGroup.SHARED_MEMORY),
    (re.compile(r"/v2/openapi\.json$"), None),
    (re.compile(_MODEL + r"$"), ApiGroup.METADATA),
    (re.compile(r"/v2/?$"), ApiGroup.METADATA),
    (re.compile(r"/v1/.*"), ApiGroup.INFERENCE),  # OpenAI-compatible routes
    (re.compile(r"/dashboard(/.*)?$"), None),
]


def api_group(path: str) -> ApiGroup | None:
    """The group of ``path``; ``None`` for public pages (dashboard shell, OpenAPI)."""
    for pattern, group in _RULES:
        if pattern.match(path):
            return group
    return ApiGroup.MONITORING  # /api/* and unknown paths: key required, never restricted


class AccessMiddleware:
    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        group = api_group(path)
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        if group is None:
            if path.startswith("/dashboard"):
                await self._dashboard(scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        cookie_keys: list[str] = []
        if group is ApiGroup.MONITORING and scope["method"] == "GET":
            # Only read-only monitoring GETs take the cookie: it cannot be used to change
            # anything even if a browser were tricked into sending it.
            cookie_keys = _cookie_key(headers.get("cookie"))
        denial = self.policy.check(group, headers.get, cookie_keys)
        if denial is None:
            await self.app(scope, receive, send)
            return
        if denial.kind == "unauthenticated":
            await _reply(send, 401, denial.message, [(b"www-authenticate", b"Bearer")])
        else:
            await _reply(send, 403, denial.message)

    async def _dashboard(self, scope: Scope, receive: Receive, send: Send) -> None:
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        key = (query.get("api_key") or [""])[0]
        if not key or not self.policy.api_keys:
            await self.app(scope, receive, send)
            return
        if not self.policy.key_matches(key):
            await _reply(send, 401, "invalid API key", [(b"www-authenticate", b"Bearer")])
            return
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{COOKIE}={key}; Path=/api; HttpOnly; SameSite=Strict{secure}"

        async def with_cookie(message: Message) -> None:
            if message["type"] == "http.response.start":
                raw = list(message.get("headers", []))
                raw.append((b"set-cookie", cookie.encode("latin-1")))
                message = {**message, "headers": raw}
            await send(message)

        await self.app(scope, receive, with_cookie)


def _cookie_key(header: str | None) -> list[str]:
    if not header:
        return []
    jar: SimpleCookie = SimpleCookie()
    try:
        jar.load(header)
    except Exception:  # a malformed Cookie header is just no credential
        return []
    morsel = jar.get(COOKIE)
    return [morsel.value] if morsel is not None and morsel.value else []


async def _reply(
    send: Send, status: int, message: str, extra: list[tuple[bytes, bytes]] | None = None
) -> None:
    body = orjson.dumps({"error": message})
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
