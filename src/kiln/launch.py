"""Launch kiln's process (what ``kiln serve`` runs once its flags are parsed): the Server and
its HTTP, gRPC and metrics listeners on one event loop, with graceful shutdown.

On SIGTERM/SIGINT: readiness goes false, listeners stop accepting, in-flight requests
finish (bounded by ``exit_timeout_secs``), models unload, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import socket
import stat
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.middleware.cors import CORSMiddleware

from kiln.cache.config import CacheConfigError
from kiln.core.heap import freeze_startup_heap
from kiln.frontends.http.access import AccessMiddleware
from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.http.browser import BrowserGuard, BrowserGuardMiddleware
from kiln.frontends.http.fast_protocol import fast_infer_protocol
from kiln.frontends.http.request_id import RequestIdMiddleware
from kiln.frontends.http.slow_clients import header_timeout_protocol
from kiln.frontends.http.unread_body import CloseUnreadBody
from kiln.frontends.openai.routes import openai_routes
from kiln.metrics.app import MetricsOptions, MetricsService, metrics_app
from kiln.monitoring.live_routes import live_routes
from kiln.monitoring.routes import monitor_routes
from kiln.monitoring.service import MonitorOptions, MonitorService
from kiln.security import SecurityOptions
from kiln.server.server import ControlMode, Server, ServerOptions

log = logging.getLogger("kiln")


@dataclass
class Endpoints:
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    allow_grpc: bool = True
    allow_metrics: bool = True
    metrics: MetricsOptions = field(default_factory=MetricsOptions)
    monitor: MonitorOptions = field(default_factory=MonitorOptions)
    security: SecurityOptions = field(default_factory=SecurityOptions)
    # "kiln" (its own HTTP/2 + gRPC protocol) or "grpcio" (grpc.aio), see docs/grpc.md
    grpc_implementation: str = "kiln"
    # HTTP on this Unix domain socket instead of host:http_port (vLLM's --uds); gRPC and
    # metrics stay on host's TCP ports
    uds: str | None = None
    # uvicorn's own log records (vLLM's --uvicorn-log-level); kiln's are --log-level's
    uvicorn_log_level: str = "warning"

    @property
    def http_address(self) -> str:
        return f"unix:{self.uds}" if self.uds else f"{self.host}:{self.http_port}"


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: kiln orchestrates shutdown itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def _uvicorn(
    app: object,
    host: str,
    port: int,
    timeout: float,
    security: SecurityOptions | None = None,
    fast: HttpFrontend | None = None,
    browser: BrowserGuard | None = None,
    head: SecurityOptions | None = None,
    log_level: str = "warning",
) -> _Uvicorn:
    """``security``: the main HTTP listener's TLS and limits; None for the metrics port.
    ``fast``: answer inference inside the HTTP protocol with this frontend; ``browser``: the
    guard ``app`` applies, whose host names the fast path checks too. ``head``: whose
    request-head limits apply (both listeners share them); ``security``'s by default."""
    sec = security or SecurityOptions()
    head = head or sec
    tls: dict[str, object] = {}
    if security is not None and security.http_tls is not None:
        t = security.http_tls
        tls = {
            "ssl_certfile": str(t.certfile),
            "ssl_keyfile": str(t.keyfile),
            "ssl_ca_certs": str(t.ca_certs) if t.ca_certs else None,
            "ssl_cert_reqs": t.cert_reqs,
        }
        if t.ciphers is not None:
            tls["ssl_ciphers"] = t.ciphers
    protocol = header_timeout_protocol(
        sec.http_header_timeout_secs, head.http_max_header_size, head.http_max_headers
    )
    # KILN_HTTP_FAST_PATH=0 leaves /infer to the ASGI app: an A/B switch for benchmarks.
    if fast is not None and os.environ.get("KILN_HTTP_FAST_PATH", "1") != "0":
        access = sec.http_access if sec.http_access.enabled else None
        protocol = fast_infer_protocol(protocol, fast, access, browser, sec.request_id_headers)
    config = uvicorn.Config(
        CloseUnreadBody(app),  # type: ignore[arg-type]
        host=host,
        port=port,
        loop="none",
        http=protocol,
        lifespan="off",
        log_level=log_level,  # uvicorn's own log (vLLM's --uvicorn-log-level)
        access_log=False,
        timeout_keep_alive=sec.http_timeout_keep_alive,  # type: ignore[arg-type]
        limit_concurrency=sec.http_limit_concurrency or None,
        # 0: in-flight requests are cancelled at once (vLLM's --shutdown-timeout 0)
        timeout_graceful_shutdown=math.ceil(timeout),
        server_header=False,
        date_header=False,
        **tls,  # type: ignore[arg-type]
    )
    return _Uvicorn(config)


#: what browsers may send cross-origin unless --allowed-methods/--allowed-headers say
CORS_METHODS = ("GET", "POST")
CORS_HEADERS = (
    "authorization",
    "x-api-key",
    "content-type",
    "inference-header-content-length",
    "content-encoding",
)


def _http_app(
    frontend: HttpFrontend, routes: list[Any], security: SecurityOptions, browser: BrowserGuard
) -> Any:
    """The HTTP app inside its access check, inside CORS (so browsers' preflight requests,
    which carry no credentials, are answered before the key is asked for), inside the
    browser guard (a foreign Host or a cross-site state change reaches nothing), inside
    the X-Request-Id header when asked for (every answer carries it)."""
    app: Any = frontend.app(routes)
    if security.http_access.enabled:
        app = AccessMiddleware(app, security.http_access)
    if security.cors_origins:
        expose = ["inference-header-content-length"]
        if security.request_id_headers:
            expose.append("x-request-id")
        app = CORSMiddleware(
            app,
            allow_origins=list(security.cors_origins),
            allow_methods=list(security.cors_methods or CORS_METHODS),
            allow_headers=list(security.cors_headers or CORS_HEADERS),
            allow_credentials=security.cors_credentials,
            expose_headers=expose,
        )
    return _with_request_id(BrowserGuardMiddleware(app, browser), security)


def _with_request_id(app: Any, security: SecurityOptions) -> Any:
    return RequestIdMiddleware(app) if security.request_id_headers else app


def bind_unix_socket(path: str) -> socket.socket:
    """A listening socket at ``path``, made with the process's umask (as vLLM's: with the
    usual 022 only this user may connect, since connecting needs write permission). A
    socket file left by a kiln that is gone is replaced; one a live server answers on, or
    a file that is not a socket, is an error (OSError naming it)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None:
        if not stat.S_ISSOCK(mode):
            raise OSError(f"{path} exists and is not a socket: kiln will not replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # nobody listens: a stale socket of an earlier run
        else:
            raise OSError(f"{path}: another server listens on this socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError:
        sock.close()
        raise
    return sock


async def run(options: ServerOptions, endpoints: Endpoints) -> int:
    try:
        server = Server(options)
        await server.open()  # before listening: a redis cache out of reach stops it here
    except CacheConfigError as exc:
        log.error("--cache-config: %s", exc)
        return 1
    metrics: MetricsService | None = None
    monitor: MonitorService | None = None
    # History and alerts read the metrics collectors, so those run whenever any is on.
    if endpoints.allow_metrics or endpoints.monitor.enabled:
        metrics = MetricsService(server, endpoints.metrics)
        metrics.start()
        if endpoints.monitor.enabled:
            external_url = f"http://{endpoints.host}:{endpoints.http_port}"
            if endpoints.uds:  # a link alerts carry: no URL reaches a Unix socket
                external_url = f"http+unix://{endpoints.uds}"
            monitor = MonitorService(metrics, endpoints.monitor, external_url)
            if monitor.alerts is not None:  # a rollout's guard rolls back on a firing alert
                server.rollouts.alert_firing = monitor.alerts.firing
    security = endpoints.security
    # a Unix socket has no host name a page could rebind (any Host is answered, unless
    # --http-allowed-host lists names); browsers' cross-site requests are judged as ever
    browser = BrowserGuard.create(
        f"unix:{endpoints.uds}" if endpoints.uds else endpoints.host,
        security.http_allowed_hosts,
        security.cors_origins,
    )
    frontend = HttpFrontend(server, security.http_read_timeout_secs)
    http = _uvicorn(
        _http_app(
            frontend,
            [
                *monitor_routes(monitor),
                *live_routes(server, metrics, monitor),
                *openai_routes(server, frontend),
            ],
            security,
            browser,
        ),
        endpoints.host,
        endpoints.http_port,
        options.exit_timeout_secs,
        security,
        fast=frontend,
        browser=browser,
        log_level=endpoints.uvicorn_log_level,
    )
    servers = [http]
    sockets: list[list[socket.socket] | None] = [None]
    if endpoints.uds:
        try:
            sockets[0] = [bind_unix_socket(endpoints.uds)]
        except OSError as exc:
            log.error("HTTP cannot listen on unix:%s: %s", endpoints.uds, exc)
            if metrics is not None:
                metrics.stop()
            return 1
    if metrics is not None and endpoints.allow_metrics:
        servers.append(
            _uvicorn(
                _with_request_id(BrowserGuardMiddleware(metrics_app(metrics), browser), security),
                endpoints.host,
                endpoints.metrics_port,
                options.exit_timeout_secs,
                head=security,
                log_level=endpoints.uvicorn_log_level,
            )
        )
        sockets.append(None)
    grpc_server = None
    if endpoints.allow_grpc:
        from kiln.frontends.grpc.listener import start_grpc

        try:
            grpc_server = await start_grpc(
                server,
                endpoints.host,
                endpoints.grpc_port,
                security.grpc_max_message_bytes,
                access=security.grpc_access,
                tls=security.grpc_tls,
                implementation=endpoints.grpc_implementation,
                idle_timeout=security.grpc_max_connection_idle_secs,
                # one slowloris limit for both: an HTTP/2 header block as HTTP headers
                header_timeout=security.http_header_timeout_secs,
            )
        except (OSError, RuntimeError) as exc:  # grpcio reports a failed bind as RuntimeError
            log.error("gRPC cannot listen on %s:%d: %s", endpoints.host, endpoints.grpc_port, exc)
            if metrics is not None:
                metrics.stop()
            _remove_socket(endpoints)
            return 1

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    tasks = [asyncio.create_task(s.serve(sockets=k)) for s, k in zip(servers, sockets, strict=True)]
    while not all(s.started for s in servers):
        if any(t.done() for t in tasks):
            for t in tasks:
                if t.done() and t.exception():
                    raise t.exception()  # type: ignore[misc]
            log.error("a listener failed to start (port in use?)")
            _remove_socket(endpoints)
            return 1
        await asyncio.sleep(0.01)
    log.info(
        "kiln listening: HTTP %s, gRPC %s:%d, metrics %s:%d",
        endpoints.http_address,
        endpoints.host,
        endpoints.grpc_port,
        endpoints.host,
        endpoints.metrics_port,
    )
    if options.model_control_mode is ControlMode.EXPLICIT and not security.http_access.api_keys:
        log.warning(
            "model control mode is explicit and no API key is set: anyone who can reach "
            "the HTTP or gRPC port can load models, and a load with file: parameters runs "
            "code as this user; set --api-key (docs/security.md)"
        )
    if monitor is not None:
        monitor.start()
    await server.start()
    rc = 0
    if server.failed_at_start and options.exit_on_error:
        # Triton's --exit-on-error: a model that was asked for and is missing is an error
        # of the whole server (its clients would meet 404s/503s), so say so and stop
        log.error(
            "failed to load all models: %s; exiting (--exit-on-error)",
            "; ".join(f"'{n}': {why}" for n, why in server.failed_at_start.items()),
        )
        rc = 1
        stop.set()
    else:
        frozen = freeze_startup_heap()
        log.info("models loaded; server ready=%s", server.ready)
        log.debug("gc.freeze: %d startup objects out of the collector's passes", frozen)
    await stop.wait()

    log.info("shutting down: draining in-flight requests (up to %.0fs)", options.exit_timeout_secs)
    deadline = loop.time() + options.exit_timeout_secs
    server.shutting_down = True
    for s in servers:
        s.should_exit = True
    if grpc_server is not None:
        await grpc_server.stop(options.exit_timeout_secs)
    await asyncio.gather(*tasks, return_exceptions=True)
    try:
        await asyncio.wait_for(server.stop(), max(deadline - loop.time(), 0.5))
    except TimeoutError:
        # A backend still computing cannot be interrupted, and interpreter exit would join
        # its thread: leave now so the exit timeout really bounds the shutdown.
        log.warning("models still busy after %.0fs: exiting anyway", options.exit_timeout_secs)
        logging.shutdown()
        # os._exit skips atexit: the Python backend's arenas would stay in /dev/shm.
        from kiln.backends.python.process import remove_private_dirs

        remove_private_dirs()
        _remove_socket(endpoints)
        os._exit(rc)
    _remove_socket(endpoints)
    if monitor is not None:
        monitor.stop()
    if metrics is not None:
        metrics.stop()
    log.info("kiln stopped")
    return rc


def _remove_socket(endpoints: Endpoints) -> None:
    """The HTTP socket file, once kiln stops listening on it (as a port is freed)."""
    if endpoints.uds:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(endpoints.uds).st_mode):
                os.unlink(endpoints.uds)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard limit: clients' connections and the
    Python backend's shared-memory arenas (one descriptor each before Python 3.13, 16 per
    instance by default) all take descriptors, and a soft limit of 1,024 is common.
    ``(old soft, new soft)``."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def launch(options: ServerOptions, endpoints: Endpoints) -> int:
    """Run until SIGTERM/SIGINT; the process's exit status."""
    old, new = raise_fd_limit()
    if new != old:
        log.debug("open files limit raised from %d to %d", old, new)
    try:
        import uvloop

        return uvloop.run(run(options, endpoints))
    except ImportError:  # pragma: no cover - uvloop missing on this platform
        return asyncio.run(run(options, endpoints))
