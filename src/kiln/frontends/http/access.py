"""HTTP adapter of :mod:`kiln.core.access`: an ASGI middleware in front of every route.

It maps a path to Triton's API group (the groups of Triton's HTTP router), asks the
shared policy, and answers 401 (``WWW-Authenticate: Bearer``) or 403 in Triton's words.
"""

from __future__ import annotations

import re
from http.cookies import SimpleCookie

import orjson
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln.core.access import AccessPolicy, ApiGroup, presented_key

# The dashboard's page loads without a key (it holds no data); its fetches of /api/* carry
# this cookie, set by POST /dashboard/session with the key in a header (the page's form):
# never in a URL, where browser history, logs and Referer headers would keep it.
COOKIE = "kiln_api_key"
SESSION_PATH = "/dashboard/session"

_MODEL = r"/v2/models/[^/]+(?:/versions/[^/]+)?"
DEV_PATHS = (
    r"/(reset_prefix_cache|reset_mm_cache|reset_encoder_cache|server_info|sleep|wake_up"
    r"|is_sleeping|release_kv_cache_memory|pause|resume|is_paused|abort_requests"
    r"|get_world_size|update_weight_version|weight_info|init_weight_transfer_engine"
    r"|shutdown_weight_transfer_engine|start_weight_update|start_draft_weight_update"
    r"|update_weights|finish_weight_update|weight_checker)$"
)
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
    # vLLM's runtime LoRA loading reads server folders: model control, not inference
    (re.compile(r"/v1/(load|unload)_lora_adapter$"), ApiGroup.MODEL_REPOSITORY),
    # vLLM's development / RL control (VLLM_SERVER_DEV_MODE): they stop, free and reload
    # the models, so they are model control too
    (re.compile(DEV_PATHS), ApiGroup.MODEL_REPOSITORY),
    (re.compile(r"/v1/.*"), ApiGroup.INFERENCE),  # OpenAI-compatible routes
    (re.compile(r"/(de)?tokenize$"), ApiGroup.INFERENCE),  # vLLM's, beside them
    # vLLM's scale-out API (--enable-scale-out): tokens in, tokens out; abort
    (re.compile(r"/inference/v1/(generate|abort_requests)$"), ApiGroup.INFERENCE),
    (re.compile(r"/invocations$"), ApiGroup.INFERENCE),  # vLLM's SageMaker routes
    (re.compile(r"/(v2/)?(score|rerank|pooling|classify)$"), ApiGroup.INFERENCE),  # vLLM's
    (re.compile(r"/generative_scoring$"), ApiGroup.INFERENCE),  # vLLM's
    (re.compile(r"/v2/embed$"), ApiGroup.INFERENCE),  # vLLM's Cohere embed API
    (re.compile(r"/tokenizer_info$"), ApiGroup.METADATA),  # vLLM's: the template, the config
    (re.compile(r"/(health|ping)$"), ApiGroup.HEALTH),
    (re.compile(r"/version$"), ApiGroup.METADATA),
    (re.compile(r"/load$"), ApiGroup.METADATA),  # vLLM's server load: a count, no data
    # vLLM's profiler: traces into the operator's folder, as trace settings are
    (re.compile(r"/(start|stop)_profile$"), ApiGroup.TRACE),
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
            if path == SESSION_PATH and scope["method"] == "POST":
                await self._session(scope, headers, send)
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

    async def _session(self, scope: Scope, headers: dict[str, str], send: Send) -> None:
        key = presented_key(headers.get)
        if not key:
            message = "missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            await _reply(send, 401, message, [(b"www-authenticate", b"Bearer")])
            return
        if not self.policy.key_matches(key):
            await _reply(send, 401, "invalid API key", [(b"www-authenticate", b"Bearer")])
            return
        secure = "; Secure" if scope.get("scheme") == "https" else ""
        cookie = f"{COOKIE}={key}; Path=/api; HttpOnly; SameSite=Strict{secure}"
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [
                    (b"set-cookie", cookie.encode("latin-1")),
                    (b"cache-control", b"no-store"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": b""})


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
