"""``kiln serve``: its flags, checked and turned into ``ServerOptions`` and ``Endpoints``."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import Any

import click

from kiln.cli.llm_options import ENGINE_FLAGS, llm_options, served_aliases, served_models
from kiln.cli.security_options import build_security, security_options
from kiln.cli.vllm_command import ServeCommand
from kiln.cli.vllm_flags import vllm_flags
from kiln.core.header_forward import header_forward
from kiln.security import DEFAULT_MAX_INPUT_BYTES


def _open_repositories(values: tuple[str, ...]) -> list[Any]:
    """Folders as paths; a bucket as its source, listed once here so that a bucket that
    cannot be read (unreachable, wrong credentials, missing) stops kiln at start."""
    from kiln.repository.source import LocalSource, RepositoryError, open_source

    opened: list[Any] = []
    for text in values:
        try:
            source = open_source(text)
            if isinstance(source, LocalSource):
                if not source.path.is_dir():
                    raise click.BadParameter(
                        f"'{text}' is not a folder", param_hint="--model-repository"
                    )
                opened.append(Path(text))
                continue
            source.refresh()
        except RepositoryError as exc:  # click prints "Error: <message>", exits 1
            raise click.ClickException(str(exc)) from None
        opened.append(source)
    return opened


def _otlp_flags(endpoint: str | None) -> list[str]:
    """vLLM's ``--otlp-traces-endpoint``: every request traced as spans to ``endpoint``,
    over the transport ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` names (gRPC by default, as
    in vLLM)."""
    if endpoint is None:
        return []
    import os

    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    return ["mode=opentelemetry", "rate=1", "count=-1", "level=TIMESTAMPS",
            f"opentelemetry,url={endpoint}", f"opentelemetry,protocol={protocol}"]  # fmt: skip


@click.command(cls=ServeCommand)
@click.argument(
    "model_paths", metavar="[MODEL]...", nargs=-1,
    type=click.Path(exists=True, path_type=Path),
)  # fmt: skip
@click.option(
    "--model-repository",
    "model_repository",
    multiple=True,
    help="Model repository (Triton layout): a folder, or s3://[host:port/]bucket/path "
    "(kiln[s3]); may be given several times. Optional with --model.",
)
@click.option(
    "--model-control-mode",
    type=click.Choice(["none", "explicit", "poll"]),
    default="none",
    show_default=True,
)
@click.option(
    "--load-model",
    "load_model",
    multiple=True,
    help="With explicit mode: a model to load at start ('*' = all).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option(
    "--http-port", "--port", "http_port", default=8000, show_default=True,
    help="HTTP port: KServe v2, OpenAI's API (--port: vLLM's name).",
)  # fmt: skip
@click.option(
    "--uds",
    default=None,
    metavar="PATH",
    help="Serve HTTP (KServe v2, OpenAI's API) on this Unix domain socket instead of "
    "--host:--http-port (vLLM's flag); gRPC and metrics stay on their TCP ports.",
)
@click.option("--grpc-port", default=8001, show_default=True)
@click.option("--metrics-port", default=8002, show_default=True)
@click.option("--allow-grpc/--no-allow-grpc", default=True, show_default=True)
@click.option(
    "--grpc-implementation",
    type=click.Choice(["kiln", "grpcio"]),
    default="kiln",
    show_default=True,
    help="gRPC server: kiln's own HTTP/2 protocol, or grpcio's grpc.aio (the fallback).",
)
@click.option(
    "--http-header-forward-pattern",
    default="",
    metavar="REGEX",
    help="HTTP headers whose name matches (searched, case-insensitive unless the pattern "
    "starts with (?-i)) become string request parameters of infer and generate (Triton's "
    "flag), e.g. '^x-user-' for a rollout's sticky_key parameter:x-user-id.",
)
@click.option(
    "--grpc-header-forward-pattern",
    default="",
    metavar="REGEX",
    help="The same for gRPC metadata (ModelInfer, ModelStreamInfer).",
)
@click.option("--allow-metrics/--no-allow-metrics", default=True, show_default=True)
@click.option(
    "--allow-gpu-metrics/--no-allow-gpu-metrics",
    default=True,
    show_default=True,
    help="GPU telemetry through NVML (absent without a GPU/driver).",
)
@click.option(
    "--allow-cpu-metrics/--no-allow-cpu-metrics",
    default=True,
    show_default=True,
    help="Host CPU/memory metrics from /proc.",
)
@click.option(
    "--metrics-interval-ms",
    default=2000,
    show_default=True,
    type=click.IntRange(min=10),
    help="How often GPU and CPU metrics are sampled.",
)
@click.option(
    "--metrics-config",
    "metrics_config",
    multiple=True,
    metavar="KEY=VALUE",
    help="Triton's metrics settings: counter_latencies, summary_latencies, "
    "summary_quantiles, histogram_latencies; kiln's latency_buckets. May repeat.",
)
@click.option(
    "--history/--no-history",
    "history",
    default=True,
    show_default=True,
    help="Sample metrics into an embedded SQLite store (GET /api/history).",
)
@click.option(
    "--history-path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="History database [default: $XDG_STATE_HOME/kiln/history-<http-port>.db].",
)
@click.option(
    "--history-interval-secs",
    default=5.0,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="How often history samples the metrics.",
)
@click.option(
    "--history-retention",
    default="24h",
    show_default=True,
    help="How long history keeps samples (Prometheus duration: 30m, 24h, 7d).",
)
@click.option(
    "--history-max-mb",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Size budget of the history database; the oldest samples go first.",
)
@click.option(
    "--alert-rules",
    "alert_rules",
    multiple=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="Alert rules file (YAML, Prometheus layout); may repeat. Replaces the defaults.",
)
@click.option(
    "--default-alert-rules/--no-default-alert-rules",
    default=True,
    show_default=True,
    help="Evaluate kiln's shipped rules when no --alert-rules is given.",
)
@click.option(
    "--alert-eval-interval-secs",
    default=15.0,
    show_default=True,
    type=click.FloatRange(min=0.05),
    help="How often alert rules are evaluated.",
)
@click.option(
    "--alert-webhook",
    "alert_webhooks",
    multiple=True,
    metavar="URL",
    help="POST alert notifications (Alertmanager webhook JSON) to this URL; may repeat.",
)
@click.option(
    "--alert-webhook-timeout-secs",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0.01),
    help="Timeout of one webhook POST before it is retried.",
)
@click.option(
    "--monitor-agent",
    "monitor_agents",
    multiple=True,
    metavar="HOST:PORT",
    help="Scrape this GPU agent (kiln monitor agent, dcgm-exporter) or kiln server's metrics "
    "port into history, alerts and the dashboard's fleet view; may repeat.",
)
@click.option(
    "--monitor-prometheus",
    default="",
    metavar="URL",
    help="Read every host's DCGM_FI_* series from this Prometheus (/api/v1/query).",
)
@click.option(
    "--disable-auto-complete-config",
    is_flag=True,
    help="Take each config.pbtxt as written: no inputs, outputs or max_batch_size read "
    "from the model, no auto_complete_config of Python models, no default dynamic_batching "
    "(Triton's flag of the same name).",
)
@click.option(
    "--strict-readiness/--no-strict-readiness",
    default=True,
    show_default=True,
    help="Ready only when every model is ready (Triton's default).",
)
@click.option(
    "--exit-on-error",
    type=click.BOOL,
    is_flag=False,
    flag_value=True,
    default=None,
    help="Exit (status 1) when a model named at start fails to load, as Triton's flag of "
    "the same name (--exit-on-error=false to keep serving the others). Default: true when "
    "serving only --model checkpoints (as vllm serve), false with a --model-repository "
    "(kiln's long-standing behaviour; Triton's default is true).",
)
@click.option(
    "--exit-timeout-secs",
    "--shutdown-timeout",
    "exit_timeout_secs",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, how long in-flight requests may take to finish; 0: they are "
    "cancelled at once (--shutdown-timeout: vLLM's name).",
)
@click.option(
    "--http-max-input-size",
    default=DEFAULT_MAX_INPUT_BYTES,
    show_default=True,
    help="Largest request body in bytes (413 beyond).",
)
@click.option("--repository-poll-secs", default=15.0, show_default=True)
@click.option(
    "--cache-config",
    "cache_config",
    multiple=True,
    metavar="CACHE,KEY=VALUE",
    help="Response cache for models with response_cache { enable: true }, as in Triton: "
    "--cache-config local,size=BYTES, or a Redis that servers share: --cache-config "
    "redis,host=HOST --cache-config redis,port=PORT (also user, password, db, "
    "connect_timeout, socket_timeout, pool_size, wait_timeout).",
)
@click.option(
    "--rate-limit",
    type=click.Choice(["off", "execution_count"]),
    default="off",
    show_default=True,
    help="Triton's rate limiter: with execution_count, a batch starts only once the "
    "resources its instance group lists (rate_limiter { resources [...] priority }) are "
    "free, across all models (docs/scheduling.md).",
)
@click.option(
    "--rate-limit-resource",
    "rate_limit_resources",
    multiple=True,
    metavar="NAME:COUNT[:DEVICE]",
    help="Copies of a rate limiter resource, on one GPU or (without DEVICE) on every "
    "device; by default the most any loaded instance needs.",
)
@click.option(
    "--trace-config",
    "trace_config",
    multiple=True,
    metavar="[MODE,]SETTING=VALUE",
    help="Request tracing as in Triton, written in its JSON trace format: "
    "--trace-config triton,file=PATH --trace-config level=TIMESTAMPS (or TENSORS; "
    "repeatable) --trace-config rate=N (every N-th request; default 1000) "
    "--trace-config count=N (-1: no limit) --trace-config triton,log-frequency=N "
    "(every N traces to PATH.0, PATH.1, ...). Changeable at run time through "
    "/v2/trace/setting (docs/tracing.md).",
)
@click.option(
    "--otlp-traces-endpoint",
    metavar="URL",
    default=None,
    help="vLLM's: trace every request as OpenTelemetry spans sent to this collector, over "
    "OTLP/gRPC (or OTLP/HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); "
    "--trace-config settings given as well win.",
)
@click.option("--trace-file", hidden=True, help="Triton's older spelling of triton,file=")
@click.option("--trace-level", multiple=True, hidden=True, help="Older spelling of level=")
@click.option("--trace-rate", hidden=True, help="Older spelling of rate=")
@click.option("--trace-count", hidden=True, help="Older spelling of count=")
@click.option("--trace-log-frequency", hidden=True, help="Older spelling of log-frequency=")
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
)
@click.option(
    "--disable-log-requests", "--disable-log-stats", "--trust-remote-code",
    "--enable-chunked-prefill",
    is_flag=True, expose_value=False,
    help="vLLM's flags, accepted so its command lines run unchanged; nothing to do: kiln "
    "logs no request contents nor periodic stats (its /metrics and dashboard have them), "
    "runs no code from a checkpoint, and always splits a prompt longer than a step's "
    "--max-num-batched-tokens into chunks (vLLM V1's default).",
)  # fmt: skip
@click.option(
    "--uvicorn-log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug", "trace"]),
    default="warning",
    show_default=True,
    help="vLLM's: the HTTP server's (uvicorn's) own log; kiln's is --log-level.",
)
@click.option(
    "--config",
    metavar="FILE.yaml",
    expose_value=False,
    help="vLLM's config file: each key a flag (port: 8000, enable-prefix-caching: true); "
    "the command line wins over it.",
)
@security_options
@llm_options
@vllm_flags
def serve(
    model_paths: tuple[Path, ...],
    model_repository: tuple[str, ...],
    models: tuple[Path, ...],
    served_model_names: tuple[str, ...],
    model_control_mode: str,
    load_model: tuple[str, ...],
    host: str,
    http_port: int,
    uds: str | None,
    grpc_port: int,
    metrics_port: int,
    allow_grpc: bool,
    grpc_implementation: str,
    http_header_forward_pattern: str,
    grpc_header_forward_pattern: str,
    allow_metrics: bool,
    allow_gpu_metrics: bool,
    allow_cpu_metrics: bool,
    metrics_interval_ms: int,
    metrics_config: tuple[str, ...],
    history: bool,
    history_path: Path | None,
    history_interval_secs: float,
    history_retention: str,
    history_max_mb: int,
    alert_rules: tuple[Path, ...],
    default_alert_rules: bool,
    alert_eval_interval_secs: float,
    alert_webhooks: tuple[str, ...],
    alert_webhook_timeout_secs: float,
    monitor_agents: tuple[str, ...],
    monitor_prometheus: str,
    disable_auto_complete_config: bool,
    strict_readiness: bool,
    exit_on_error: bool | None,
    exit_timeout_secs: float,
    http_max_input_size: int,
    repository_poll_secs: float,
    cache_config: tuple[str, ...],
    rate_limit: str,
    rate_limit_resources: tuple[str, ...],
    trace_config: tuple[str, ...],
    otlp_traces_endpoint: str | None,
    trace_file: str | None,
    trace_level: tuple[str, ...],
    trace_rate: str | None,
    trace_count: str | None,
    trace_log_frequency: str | None,
    log_level: str,
    uvicorn_log_level: str,
    **security_params: Any,
) -> None:
    """Serve a model repository, or checkpoints (MODEL or --model), over KServe v2
    HTTP/gRPC, OpenAI's API and metrics. ``kiln serve MODEL --port 8000`` reads as
    ``vllm serve MODEL --port 8000``.

    Security (API keys, restricted APIs, TLS, CORS, limits): see docs/security.md."""
    from kiln.cache.config import CacheConfig, CacheConfigError
    from kiln.core.settings import parse_trace_config
    from kiln.launch import Endpoints
    from kiln.launch import launch as run_server
    from kiln.metrics.app import MetricsOptions
    from kiln.metrics.config import MetricsConfig, MetricsConfigError
    from kiln.scheduling.rate_limit import ResourceOverride
    from kiln.server.server import ControlMode, ServerOptions

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    repositories = _open_repositories(model_repository)
    llm_settings = {k: security_params.pop(k) for k in ENGINE_FLAGS}
    enable_scale_out = bool(security_params.pop("enable_scale_out"))
    tokens_only = bool(security_params.pop("tokens_only"))
    # vLLM's positional MODEL: served first, before the --model ones
    served = served_models((*model_paths, *models), served_model_names, llm_settings)
    if not repositories and not served:
        raise click.UsageError("give --model-repository, or --model to serve a checkpoint")
    aliases = served_aliases((*model_paths, *models), served_model_names)
    for name in [c.name for c in served] + list(aliases):
        clash = [r for r in repositories if isinstance(r, Path) and (r / name).is_dir()]
        if clash:
            raise click.BadParameter(
                f"'{name}' is also a model of {clash[0]}: give --served-model-name",
                param_hint="--model",
            )
    try:
        parsed_metrics_config = MetricsConfig.parse(metrics_config)
    except MetricsConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--metrics-config") from None
    try:
        parsed_cache_config = CacheConfig.parse(cache_config)
    except CacheConfigError as exc:
        raise click.BadParameter(str(exc), param_hint="--cache-config") from None
    try:
        overrides = [ResourceOverride.parse(text) for text in rate_limit_resources]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--rate-limit-resource") from None
    if overrides and rate_limit == "off":
        raise click.BadParameter(
            "resources given, but the rate limiter is off: add --rate-limit=execution_count",
            param_hint="--rate-limit-resource",
        )
    legacy = {
        "trace_file": [trace_file] if trace_file is not None else [],
        "trace_level": list(trace_level),
        "trace_rate": [trace_rate] if trace_rate is not None else [],
        "trace_count": [trace_count] if trace_count is not None else [],
        "log_frequency": [trace_log_frequency] if trace_log_frequency is not None else [],
    }
    try:
        trace_flags = _otlp_flags(otlp_traces_endpoint) + list(trace_config)
        trace, trace_otel = parse_trace_config(trace_flags, legacy)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace-config") from None
    options = ServerOptions(
        model_repositories=repositories,
        served_models=served,
        llm_aliases=aliases,
        enable_scale_out=enable_scale_out,
        tokens_only=tokens_only,
        model_control_mode=ControlMode(model_control_mode),
        load_models=list(load_model),
        strict_readiness=strict_readiness,
        exit_on_error=exit_on_error if exit_on_error is not None else not repositories,
        exit_timeout_secs=exit_timeout_secs,
        auto_complete_config=not disable_auto_complete_config,
        max_request_bytes=http_max_input_size,
        repository_poll_secs=repository_poll_secs,
        cache=parsed_cache_config,
        max_input_tensors=security_params["max_input_tensors"],
        max_tensor_elements=security_params["max_tensor_elements"],
        max_shm_regions=security_params["max_shm_regions"],
        max_load_file_bytes=_load_file_bytes(security_params, http_max_input_size),
        allow_shm_other_owners=security_params["allow_shm_other_owners"],
        rate_limit=rate_limit == "execution_count",
        rate_limit_resources=overrides,
        trace=trace,
        trace_otel=trace_otel,
        http_header_forward_pattern=http_header_forward_pattern,
        grpc_header_forward_pattern=grpc_header_forward_pattern,
    )
    for flag, pattern in (
        ("--http-header-forward-pattern", http_header_forward_pattern),
        ("--grpc-header-forward-pattern", grpc_header_forward_pattern),
    ):
        try:
            header_forward(pattern, flag)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint=flag) from None
    security = build_security(security_params)
    metrics = MetricsOptions(
        parsed_metrics_config, metrics_interval_ms, allow_gpu_metrics, allow_cpu_metrics
    )
    from kiln.cli.monitor_options import monitor_options

    monitor = monitor_options(
        http_port=http_port,
        history=history,
        history_path=history_path,
        history_interval_secs=history_interval_secs,
        history_retention=history_retention,
        history_max_mb=history_max_mb,
        alert_rules=alert_rules,
        default_alert_rules=default_alert_rules,
        alert_eval_interval_secs=alert_eval_interval_secs,
        alert_webhooks=alert_webhooks,
        alert_webhook_timeout_secs=alert_webhook_timeout_secs,
        monitor_agents=monitor_agents,
        monitor_prometheus=monitor_prometheus,
    )
    endpoints = Endpoints(
        host,
        http_port,
        grpc_port,
        metrics_port,
        allow_grpc,
        allow_metrics=allow_metrics,
        metrics=metrics,
        monitor=monitor,
        security=security,
        grpc_implementation=grpc_implementation,
        uds=_socket_path(uds),
        uvicorn_log_level=uvicorn_log_level,
    )
    sys.exit(run_server(options, endpoints))


#: sun_path holds 108 bytes on Linux, the terminating NUL among them
_MAX_SOCKET_PATH = 107


def _socket_path(text: str | None) -> str | None:
    """--uds's path, checked before anything starts: bind() would fail on each of these."""
    if text is None:
        return None
    if not text or "\0" in text:
        raise click.BadParameter("needs a file path", param_hint="--uds")
    if len(os.fsencode(text)) > _MAX_SOCKET_PATH:
        raise click.BadParameter(
            f"'{text}' is {len(os.fsencode(text))} bytes long: a Unix socket's path holds at "
            f"most {_MAX_SOCKET_PATH} (use a shorter or relative path)",
            param_hint="--uds",
        )
    path = Path(text)
    if not path.parent.is_dir():
        raise click.BadParameter(f"'{path.parent}' is not a folder", param_hint="--uds")
    if path.is_dir():
        raise click.BadParameter(f"'{text}' is a folder", param_hint="--uds")
    return text


def _load_file_bytes(params: dict[str, Any], http_max_input_size: int) -> int:
    """--max-load-file-bytes, or its default: room for two of the largest loads the
    request limits let through, and never under 256 MiB."""
    from kiln.repository.load_files import DEFAULT_LOAD_FILE_BYTES

    given: int | None = params["max_load_file_bytes"]
    if given is not None:
        return given
    largest: int = max(http_max_input_size, params["grpc_max_message_bytes"])
    return max(DEFAULT_LOAD_FILE_BYTES, 2 * largest)
