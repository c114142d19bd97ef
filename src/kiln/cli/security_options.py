"""``kiln serve``'s security flags (Triton's names where Triton has the flag), parsed into
:class:`kiln.security.SecurityOptions`. Kept apart from ``cli.py`` so that file stays a
list of serving options."""

from __future__ import annotations

import json
import logging
import re
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from kiln.core.access import AccessConfigError, AccessPolicy, Restriction, read_key_file
from kiln.security import (
    DEFAULT_MAX_INPUT_BYTES,
    GrpcTls,
    HttpTls,
    SecurityOptions,
    TlsConfigError,
)

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger(__name__)
_FILE = click.Path(exists=True, dir_okay=False, path_type=Path)

_OPTIONS = [
    click.option("--api-key", "api_keys", multiple=True, metavar="KEY",
                 help="Require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every HTTP "
                 "and gRPC call except health; may repeat."),
    click.option("--api-key-file", "api_key_file", type=_FILE, default=None,
                 help="API keys, one a line (keeps keys out of the process list)."),
    click.option("--http-restricted-api", "http_restricted", multiple=True,
                 metavar="API[,API...]:KEY=VALUE",
                 help="Triton's restricted HTTP APIs: calls in these groups need the header "
                 "KEY: VALUE (403 otherwise). Groups: health, metadata, inference, "
                 "shared-memory, model-config, model-repository, statistics, trace, logging."),
    click.option("--grpc-restricted-protocol", "grpc_restricted", multiple=True,
                 metavar="PROTOCOL[,PROTOCOL...]:KEY=VALUE",
                 help="Triton's restricted gRPC protocols: calls need the metadata "
                 "triton-grpc-protocol-KEY: VALUE (UNAVAILABLE otherwise)."),
    click.option("--ssl-certfile", type=_FILE, default=None, help="HTTPS: server certificate."),
    click.option("--ssl-keyfile", type=_FILE, default=None, help="HTTPS: server private key."),
    click.option("--ssl-ca-certs", type=_FILE, default=None,
                 help="HTTPS: CA bundle that client certificates must chain to."),
    click.option("--ssl-client-auth", type=click.Choice(["none", "optional", "required"]),
                 default=None, help="HTTPS client certificates (mTLS).  [default: none]"),
    click.option("--ssl-cert-reqs", type=click.IntRange(0, 2), default=None, hidden=True,
                 help="vLLM's spelling of --ssl-client-auth: 0 none, 1 optional, 2 required "
                 "(Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)."),
    click.option("--ssl-ciphers", default=None, metavar="CIPHERS",
                 help="HTTPS: the OpenSSL cipher list offered with TLS 1.2 and older, e.g. "
                 "'ECDHE+AESGCM:ECDHE+CHACHA20' (TLS 1.3's suites are OpenSSL's defaults)."),
    click.option("--grpc-use-ssl", is_flag=True, help="gRPC over TLS (Triton's flag)."),
    click.option("--grpc-server-cert", type=_FILE, default=None, help="gRPC TLS certificate."),
    click.option("--grpc-server-key", type=_FILE, default=None, help="gRPC TLS private key."),
    click.option("--grpc-root-cert", type=_FILE, default=None,
                 help="gRPC: CA that client certificates must chain to."),
    click.option("--grpc-use-ssl-mutual", is_flag=True,
                 help="gRPC mutual TLS: clients must present a certificate."),
    click.option("--grpc-max-message-bytes", type=click.IntRange(1, 2**31 - 1),
                 default=DEFAULT_MAX_INPUT_BYTES, show_default=True,
                 help="Largest gRPC message, both directions (RESOURCE_EXHAUSTED beyond); "
                 "the same default as --http-max-input-size."),
    click.option("--http-cors-allow-origin", "cors_origins", multiple=True, metavar="ORIGIN",
                 help="Send CORS headers for this browser origin; may repeat. Off by default."),
    click.option("--allowed-origins", "cors_origins_json", default=None, metavar="JSON",
                 hidden=True,
                 help="vLLM's spelling of --http-cors-allow-origin: a JSON list of origins."),
    click.option("--allowed-methods", "cors_methods", default=None, metavar="JSON",
                 help="CORS: the methods a browser may use cross-origin, a JSON list "
                 "(vLLM's flag; '[\"*\"]' any)  [default: [\"GET\", \"POST\"]]"),
    click.option("--allowed-headers", "cors_headers", default=None, metavar="JSON",
                 help="CORS: the request headers a browser may send cross-origin, a JSON "
                 "list (vLLM's flag; '[\"*\"]' any)  [default: authorization, x-api-key, "
                 "content-type, inference-header-content-length, content-encoding]"),
    click.option("--allow-credentials/--no-allow-credentials", "cors_credentials",
                 default=False, show_default=True,
                 help="CORS: let browsers send cookies and HTTP authentication cross-origin "
                 "(Access-Control-Allow-Credentials; vLLM's flag)."),
    click.option("--enable-request-id-headers", "request_id_headers", is_flag=True,
                 help="Every HTTP response carries X-Request-Id: the request's own, else a "
                 "new random one (vLLM's flag)."),
    click.option("--http-timeout-keep-alive", type=click.FloatRange(min=0.1), default=30.0,
                 show_default=True, help="Close idle keep-alive connections after this long."),
    click.option("--http-header-timeout-secs", type=click.FloatRange(min=0.01), default=30.0,
                 show_default=True,
                 help="Close a connection whose request headers take longer (slowloris)."),
    click.option("--http-read-timeout-secs", type=click.FloatRange(min=0), default=60.0,
                 show_default=True,
                 help="A request body must arrive within this long (408 beyond; 0: none)."),
    click.option("--http-limit-concurrency", type=click.IntRange(min=0), default=0,
                 show_default=True,
                 help="Beyond this many open HTTP connections answer 503 (0: no limit)."),
    click.option("--max-input-tensors", type=click.IntRange(min=0), default=0,
                 show_default=True, help="Most input tensors in one request (0: no limit)."),
    click.option("--max-tensor-elements", type=click.IntRange(min=0), default=0,
                 show_default=True, help="Most elements in one input tensor (0: no limit)."),
    click.option("--http-allowed-host", "http_allowed_hosts", multiple=True, metavar="HOST",
                 help="Also answer HTTP requests whose Host is HOST (default: localhost names "
                 "and the bind address on loopback, any on other addresses); may repeat."),
    click.option("--max-shm-regions", type=click.IntRange(min=1), default=1024,
                 show_default=True,
                 help="Most system shared memory regions registered at once (400 beyond)."),
    click.option("--max-load-file-bytes", type=click.IntRange(min=0), default=None,
                 help="Most bytes of 'file:' load parameters (decoded) that model loads may "
                 "hold at once, all loads together; a load that would pass it gets 503, try "
                 "again (one larger on its own: 413). 0: no limit.  [default: 256 MiB, or "
                 "twice the larger of --http-max-input-size and --grpc-max-message-bytes]"),
    click.option("--allow-shm-other-owners", is_flag=True,
                 help="Let clients register /dev/shm objects of other users too (the server "
                 "reads and writes them with its own rights)."),
    click.option("--http-max-header-size", "--h11-max-incomplete-event-size",
                 "http_max_header_size", type=click.IntRange(min=1024), default=64 * 1024,
                 show_default=True,
                 help="Largest HTTP request head (request line and headers) in bytes; 431 "
                 "beyond. Both the HTTP and the metrics port. (--h11-max-incomplete-event-size: "
                 "vLLM's name; kiln's parser, httptools, streams bodies, so only heads count.)"),
    click.option("--http-max-headers", "--h11-max-header-count", "http_max_headers",
                 type=click.IntRange(min=1), default=100, show_default=True,
                 help="Most header fields in one HTTP request; 431 beyond "
                 "(--h11-max-header-count: vLLM's name)."),
    click.option("--grpc-max-connection-idle-secs", type=click.FloatRange(min=0), default=300.0,
                 show_default=True,
                 help="Close gRPC connections with no call for this long (GOAWAY; 0: never); "
                 "grpc's max_connection_idle."),
]  # fmt: skip


def security_options(fn: F) -> F:
    for option in reversed(_OPTIONS):
        fn = option(fn)
    return fn


def build_security(p: dict[str, Any]) -> SecurityOptions:
    keys = list(p["api_keys"])
    try:
        if p["api_key_file"] is not None:
            keys += read_key_file(str(p["api_key_file"]))
        http_r = tuple(Restriction.parse(t, "--http-restricted-api") for t in p["http_restricted"])
        grpc_r = tuple(
            Restriction.parse(t, "--grpc-restricted-protocol") for t in p["grpc_restricted"]
        )
        from kiln.frontends.grpc.access import GRPC_HEADER_PREFIX

        http_access = AccessPolicy(tuple(keys), http_r)
        grpc_access = AccessPolicy(tuple(keys), grpc_r, GRPC_HEADER_PREFIX)
    except (AccessConfigError, OSError) as exc:
        raise click.UsageError(str(exc)) from None
    if any(not k or any(c.isspace() for c in k) for k in keys):
        raise click.BadParameter(
            "an API key cannot be empty or hold spaces", param_hint="--api-key"
        )
    client_auth = _client_auth(p["ssl_client_auth"], p["ssl_cert_reqs"])
    ciphers = _ciphers(p["ssl_ciphers"])
    try:
        http_tls = None
        if p["ssl_certfile"] or p["ssl_keyfile"]:
            if not (p["ssl_certfile"] and p["ssl_keyfile"]):
                raise TlsConfigError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
            http_tls = HttpTls(
                p["ssl_certfile"], p["ssl_keyfile"], p["ssl_ca_certs"], client_auth, ciphers
            )
        elif client_auth != "none":
            flag = "--ssl-client-auth" if p["ssl_client_auth"] else "--ssl-cert-reqs"
            raise TlsConfigError(f"{flag} needs --ssl-certfile and --ssl-keyfile")
        elif ciphers is not None:
            raise TlsConfigError("--ssl-ciphers needs --ssl-certfile and --ssl-keyfile")
        grpc_tls = None
        if p["grpc_use_ssl"] or p["grpc_use_ssl_mutual"]:
            if not (p["grpc_server_cert"] and p["grpc_server_key"]):
                raise TlsConfigError(
                    "--grpc-use-ssl needs --grpc-server-cert and --grpc-server-key"
                )
            grpc_tls = GrpcTls(
                p["grpc_server_cert"],
                p["grpc_server_key"],
                p["grpc_root_cert"],
                p["grpc_use_ssl_mutual"],
            )
    except TlsConfigError as exc:
        raise click.UsageError(str(exc)) from None
    origins = _origins(p["cors_origins"], p["cors_origins_json"])
    methods = _json_list(p["cors_methods"], "--allowed-methods", _token)
    headers = _json_list(p["cors_headers"], "--allowed-headers", _token)
    if not origins and (methods is not None or headers is not None or p["cors_credentials"]):
        log.warning(
            "--allowed-methods, --allowed-headers and --allow-credentials take effect only "
            "with an origin (--allowed-origins or --http-cors-allow-origin): no CORS headers"
        )
    elif p["cors_credentials"] and "*" in origins:
        log.warning(
            "--allow-credentials with the origin '*': every web page a user opens may call "
            "kiln with that user's cookies or HTTP authentication"
        )
    return SecurityOptions(
        http_access=http_access,
        grpc_access=grpc_access,
        http_tls=http_tls,
        grpc_tls=grpc_tls,
        cors_origins=origins,
        cors_methods=methods,
        cors_headers=headers,
        cors_credentials=p["cors_credentials"],
        request_id_headers=p["request_id_headers"],
        http_timeout_keep_alive=p["http_timeout_keep_alive"],
        http_limit_concurrency=p["http_limit_concurrency"],
        http_read_timeout_secs=p["http_read_timeout_secs"],
        http_header_timeout_secs=p["http_header_timeout_secs"],
        grpc_max_message_bytes=p["grpc_max_message_bytes"],
        http_allowed_hosts=_allowed_hosts(p["http_allowed_hosts"]),
        http_max_header_size=p["http_max_header_size"],
        http_max_headers=p["http_max_headers"],
        grpc_max_connection_idle_secs=p["grpc_max_connection_idle_secs"],
    )


def _allowed_hosts(hosts: tuple[str, ...]) -> tuple[str, ...]:
    for h in hosts:
        if not h or "/" in h or any(c.isspace() for c in h):
            raise click.BadParameter(
                f"'{h}' is not a host name (HOST or HOST:PORT, no scheme)",
                param_hint="--http-allowed-host",
            )
    return tuple(hosts)


#: vLLM's --ssl-cert-reqs values (Python's ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED)
_CERT_REQS = {0: "none", 1: "optional", 2: "required"}


def _client_auth(client_auth: str | None, cert_reqs: int | None) -> str:
    """kiln's --ssl-client-auth, or vLLM's --ssl-cert-reqs; both only when they agree."""
    if cert_reqs is None:
        return client_auth or "none"
    vllm = _CERT_REQS[cert_reqs]
    if client_auth is not None and client_auth != vllm:
        raise click.BadParameter(
            f"{cert_reqs} ({vllm}) contradicts --ssl-client-auth {client_auth}: give one",
            param_hint="--ssl-cert-reqs",
        )
    return vllm


def _ciphers(text: str | None) -> str | None:
    """An OpenSSL cipher list that selects at least one cipher (checked now, not at bind)."""
    if text is None:
        return None
    if not text.strip() or not text.isascii() or not text.isprintable():
        raise click.BadParameter("not an OpenSSL cipher list", param_hint="--ssl-ciphers")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).set_ciphers(text)
    except ssl.SSLError:
        raise click.BadParameter(
            f"'{text}' selects no cipher OpenSSL knows (see 'openssl ciphers')",
            param_hint="--ssl-ciphers",
        ) from None
    return text


#: an HTTP token (RFC 9110 section 5.6.2): a method or header name
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: an origin: scheme://host[:port], or "*"
_ORIGIN = re.compile(r"\*|[A-Za-z][A-Za-z0-9+.\-]*://[^\s/?#@]+")


def _token(text: str) -> bool:
    return _TOKEN.fullmatch(text) is not None


def _origin(text: str) -> bool:
    return _ORIGIN.fullmatch(text.rstrip("/")) is not None


def _json_list(text: str | None, flag: str, valid: Callable[[str], bool]) -> tuple[str, ...] | None:
    """vLLM's JSON-list flags: ``'["GET", "POST"]'``; None when not given."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON ({exc}): give a list, e.g. '[\"*\"]'",
                                 param_hint=flag) from None  # fmt: skip
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise click.BadParameter("must be a JSON list of strings", param_hint=flag)
    bad = [v for v in value if not valid(v)]
    if bad:
        raise click.BadParameter(f"{bad[0]!r} is not valid in the list", param_hint=flag)
    return tuple(value)


def _origins(kiln: tuple[str, ...], vllm: str | None) -> tuple[str, ...]:
    """--http-cors-allow-origin's origins, then --allowed-origins' (vLLM's JSON list)."""
    for origin in kiln:
        if not _origin(origin):
            raise click.BadParameter(
                f"'{origin}' is not an origin (scheme://host[:port], or *)",
                param_hint="--http-cors-allow-origin",
            )
    more = _json_list(vllm, "--allowed-origins", _origin) or ()
    return tuple(dict.fromkeys((*kiln, *more)))
