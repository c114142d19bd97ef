"""``kiln serve``'s security flags (Triton's names where Triton has the flag), parsed into
:class:`kiln.security.SecurityOptions`. Kept apart from ``cli.py`` so that file stays a
list of serving options."""

from __future__ import annotations

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
                 default="none", show_default=True, help="HTTPS client certificates (mTLS)."),
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
    click.option("--allow-shm-other-owners", is_flag=True,
                 help="Let clients register /dev/shm objects of other users too (the server "
                 "reads and writes them with its own rights)."),
    click.option("--http-max-header-size", type=click.IntRange(min=1024), default=64 * 1024,
                 show_default=True,
                 help="Largest HTTP request head (request line and headers) in bytes; 431 "
                 "beyond. Both the HTTP and the metrics port."),
    click.option("--http-max-headers", type=click.IntRange(min=1), default=100,
                 show_default=True,
                 help="Most header fields in one HTTP request; 431 beyond."),
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
    try:
        http_tls = None
        if p["ssl_certfile"] or p["ssl_keyfile"]:
            if not (p["ssl_certfile"] and p["ssl_keyfile"]):
                raise TlsConfigError("HTTPS needs both --ssl-certfile and --ssl-keyfile")
            http_tls = HttpTls(
                p["ssl_certfile"], p["ssl_keyfile"], p["ssl_ca_certs"], p["ssl_client_auth"]
            )
        elif p["ssl_client_auth"] != "none":
            raise TlsConfigError("--ssl-client-auth needs --ssl-certfile and --ssl-keyfile")
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
    return SecurityOptions(
        http_access=http_access,
        grpc_access=grpc_access,
        http_tls=http_tls,
        grpc_tls=grpc_tls,
        cors_origins=tuple(p["cors_origins"]),
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
