"""Security settings of ``kiln serve`` as one value: who may call (see
:mod:`kiln.core.access`), TLS for each listener, CORS, and the HTTP listener's limits."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
from pathlib import Path

from kiln.core.access import AccessPolicy

# The largest request either frontend takes by default: HTTP's --http-max-input-size and
# gRPC's --grpc-max-message-bytes.
DEFAULT_MAX_INPUT_BYTES = 64 * 2**20


class TlsConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class HttpTls:
    """uvicorn's TLS: ``client_auth`` none | optional | required (mTLS)."""

    certfile: Path
    keyfile: Path
    ca_certs: Path | None = None
    client_auth: str = "none"
    # OpenSSL cipher list of TLS 1.2 and older (--ssl-ciphers); None: uvicorn's default
    ciphers: str | None = None

    def __post_init__(self) -> None:
        if self.client_auth != "none" and self.ca_certs is None:
            raise TlsConfigError("--ssl-client-auth needs --ssl-ca-certs (the clients' CA)")

    @property
    def cert_reqs(self) -> int:
        return {
            "none": ssl.CERT_NONE,
            "optional": ssl.CERT_OPTIONAL,
            "required": ssl.CERT_REQUIRED,
        }[self.client_auth]


@dataclass(frozen=True, slots=True)
class GrpcTls:
    """Triton's ``--grpc-server-cert/--grpc-server-key/--grpc-root-cert/--grpc-use-ssl-mutual``."""

    server_cert: Path
    server_key: Path
    root_cert: Path | None = None
    mutual: bool = False

    def __post_init__(self) -> None:
        if self.mutual and self.root_cert is None:
            raise TlsConfigError("--grpc-use-ssl-mutual needs --grpc-root-cert (the clients' CA)")

    def ssl_context(self) -> ssl.SSLContext:
        """For kiln's own gRPC server: HTTP/2 over TLS, ALPN ``h2``; with a root
        certificate, client certificates are checked (required with ``mutual``)."""
        # not create_default_context: that trusts the system's CAs for client certificates
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2  # HTTP/2's floor (RFC 9113 §9.2)
        context.load_cert_chain(self.server_cert, self.server_key)
        context.set_alpn_protocols(["h2"])
        if self.root_cert is not None:
            context.load_verify_locations(cafile=self.root_cert)
            context.verify_mode = ssl.CERT_REQUIRED if self.mutual else ssl.CERT_OPTIONAL
        return context

    def credentials(self) -> object:
        import grpc

        root = self.root_cert.read_bytes() if self.root_cert else None
        return grpc.ssl_server_credentials(
            [(self.server_key.read_bytes(), self.server_cert.read_bytes())],
            root_certificates=root,
            require_client_auth=self.mutual,
        )


@dataclass(frozen=True, slots=True)
class SecurityOptions:
    http_access: AccessPolicy = field(default_factory=AccessPolicy)
    grpc_access: AccessPolicy = field(default_factory=AccessPolicy)
    http_tls: HttpTls | None = None
    grpc_tls: GrpcTls | None = None
    cors_origins: tuple[str, ...] = ()  # empty: no CORS headers at all
    # CORS preflight answers (vLLM's --allowed-methods/--allowed-headers/--allow-credentials);
    # None: kiln's own lists (launch.CORS_METHODS, launch.CORS_HEADERS)
    cors_methods: tuple[str, ...] | None = None
    cors_headers: tuple[str, ...] | None = None
    cors_credentials: bool = False
    # every HTTP response carries X-Request-Id (vLLM's --enable-request-id-headers)
    request_id_headers: bool = False
    # uvicorn: idle keep-alive connections close after this long.
    http_timeout_keep_alive: float = 30.0
    # uvicorn: beyond this many open connections/tasks new requests get 503 (0: no limit).
    http_limit_concurrency: int = 0
    # kiln: a request's headers must arrive within this long of its first byte (slowloris).
    http_header_timeout_secs: float = 30.0
    # kiln: a request body must arrive within this long (408 beyond; 0: no limit).
    http_read_timeout_secs: float = 60.0
    # kiln: Host names answered besides localhost's and the bind address (421 otherwise).
    http_allowed_hosts: tuple[str, ...] = ()
    # kiln: a request head (request line + headers) beyond this many bytes gets 431.
    http_max_header_size: int = 64 * 1024
    # kiln: a request with more header fields than this gets 431.
    http_max_headers: int = 100
    grpc_max_message_bytes: int = DEFAULT_MAX_INPUT_BYTES
    # kiln: gRPC connections without a stream for this long are closed (0: never).
    grpc_max_connection_idle_secs: float = 300.0
