"""The ``kiln`` command."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import click

from kiln import __version__
from kiln.cli_bench_openai import OPENAI_ONLY, check_flags, openai_options
from kiln.cli_llm import ENGINE_FLAGS, llm_options, served_models
from kiln.cli_security import build_security, security_options
from kiln.optimize.cli import optimize_options
from kiln.security import DEFAULT_MAX_INPUT_BYTES


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kiln")
def main() -> None:
    """kiln: optimize, serve and monitor models."""


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


@main.command()
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
@click.option("--http-port", default=8000, show_default=True)
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
    "--exit-timeout-secs",
    default=30.0,
    show_default=True,
    help="On SIGTERM/SIGINT, how long in-flight requests may take to finish.",
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
@security_options
@llm_options
def serve(
    model_repository: tuple[str, ...],
    models: tuple[Path, ...],
    served_model_names: tuple[str, ...],
    model_control_mode: str,
    load_model: tuple[str, ...],
    host: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    allow_grpc: bool,
    grpc_implementation: str,
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
    exit_timeout_secs: float,
    http_max_input_size: int,
    repository_poll_secs: float,
    cache_config: tuple[str, ...],
    rate_limit: str,
    rate_limit_resources: tuple[str, ...],
    trace_config: tuple[str, ...],
    trace_file: str | None,
    trace_level: tuple[str, ...],
    trace_rate: str | None,
    trace_count: str | None,
    trace_log_frequency: str | None,
    log_level: str,
    **security_params: Any,
) -> None:
    """Serve a model repository, or checkpoints (--model), over KServe v2 HTTP/gRPC,
    OpenAI's API and metrics.

    Security (API keys, restricted APIs, TLS, CORS, limits): see docs/security.md."""
    from kiln.cache.config import CacheConfig, CacheConfigError
    from kiln.core.settings import parse_trace_config
    from kiln.metrics.app import MetricsOptions
    from kiln.metrics.config import MetricsConfig, MetricsConfigError
    from kiln.scheduling.rate_limit import ResourceOverride
    from kiln.serve import Endpoints
    from kiln.serve import serve as run_server
    from kiln.server.server import ControlMode, ServerOptions

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    repositories = _open_repositories(model_repository)
    llm_settings = {k: security_params.pop(k) for k in ENGINE_FLAGS}
    served = served_models(models, served_model_names, llm_settings)
    if not repositories and not served:
        raise click.UsageError("give --model-repository, or --model to serve a checkpoint")
    for config in served:
        clash = [r for r in repositories if isinstance(r, Path) and (r / config.name).is_dir()]
        if clash:
            raise click.BadParameter(
                f"'{config.name}' is also a model of {clash[0]}: give --served-model-name",
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
        trace, trace_otel = parse_trace_config(trace_config, legacy)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--trace-config") from None
    options = ServerOptions(
        model_repositories=repositories,
        served_models=served,
        model_control_mode=ControlMode(model_control_mode),
        load_models=list(load_model),
        strict_readiness=strict_readiness,
        exit_timeout_secs=exit_timeout_secs,
        auto_complete_config=not disable_auto_complete_config,
        max_request_bytes=http_max_input_size,
        repository_poll_secs=repository_poll_secs,
        cache=parsed_cache_config,
        max_input_tensors=security_params["max_input_tensors"],
        max_tensor_elements=security_params["max_tensor_elements"],
        max_shm_regions=security_params["max_shm_regions"],
        allow_shm_other_owners=security_params["allow_shm_other_owners"],
        rate_limit=rate_limit == "execution_count",
        rate_limit_resources=overrides,
        trace=trace,
        trace_otel=trace_otel,
    )
    security = build_security(security_params)
    metrics = MetricsOptions(
        parsed_metrics_config, metrics_interval_ms, allow_gpu_metrics, allow_cpu_metrics
    )
    from kiln.metrics.cli_options import monitor_options

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
    )
    sys.exit(run_server(options, endpoints))


@main.command(context_settings={"show_default": True})
@click.argument("model", required=False)
@click.option("-m", "--model", "model_opt", default=None, help="The model (perf_analyzer's -m).")
@click.option("-u", "--url", default=None, help="Server host:port [8000 HTTP / 8001 gRPC].")
@click.option("-i", "--protocol", type=click.Choice(["http", "grpc"]), default="http")
@click.option("--binary/--json-data", default=True, help="HTTP: binary tensor extension or JSON.")
@click.option("--model-version", "-x", default="", help="Model version (default: the server's).")
@click.option(
    "--concurrency",
    "--concurrency-range",
    "concurrency",
    default=None,
    help="Closed loop levels 'start[:end[:step]]', e.g. 1:64:2 or 8 [1].",
)
@click.option(
    "--request-rate",
    "--request-rate-range",
    "request_rate",
    default=None,
    help="Open loop: requests/s 'start[:end[:step]]' instead of concurrency "
    "(--openai: one rate, or inf [default] to send every request at once).",
)
@click.option(
    "--request-distribution",
    "distribution",
    type=click.Choice(["constant", "poisson"]),
    default="constant",
)
@click.option(
    "--max-outstanding",
    default=64,
    type=click.IntRange(min=1),
    help="Open loop: sends beyond this many in flight are dropped (and reported).",
)
@click.option("-b", "--batch-size", default=1, type=click.IntRange(min=1))
@click.option("--input-data", default="random", help="random | zero | FILE.json | FILE.npz")
@click.option(
    "--shape",
    multiple=True,
    metavar="NAME:D1,D2",
    help="Dims of a variable-shape input (batch dim excluded); may repeat.",
)
@click.option("--shared-memory", type=click.Choice(["none", "system"]), default="none")
@click.option(
    "--sequence-length",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="A model with sequence_batching: requests per sequence (START on the first, END on "
    "the last), each concurrent client its own sequence.",
)
@click.option(
    "--streaming",
    is_flag=True,
    help="gRPC: send over a ModelStreamInfer stream, a request done at its final response "
    "(always for a decoupled model).",
)
@click.option(
    "--sequence-id-start",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="A model with sequence_batching: client N sends sequence id START+N.",
)
@click.option(
    "--measurement-interval-ms",
    "--measurement-interval",
    "-p",
    "measurement_interval",
    default=2000,
    type=click.IntRange(min=1),
    help="Length of one measurement window (ms).",
)
@click.option(
    "--duration",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="Measure one window of this many seconds instead of windows until stable.",
)
@click.option("--stability-percentage", "-s", default=10.0, type=float)
@click.option("--max-trials", "-r", default=10, type=click.IntRange(min=1))
@click.option(
    "--percentile",
    default=None,
    type=click.IntRange(1, 99),
    help="Judge stability on this latency percentile instead of the average.",
)
@click.option("--csv", "-f", "csv", default=None, type=click.Path(dir_okay=False))
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False))
@click.option(
    "--plot",
    default=None,
    type=click.Path(dir_okay=False),
    help="PNG of latency against throughput (--openai: latency histograms); "
    "needs kiln-serve[bench].",
)
@openai_options
def bench(model: str | None, model_opt: str | None, json_path: str | None,
          **params: object) -> None:  # fmt: skip
    """Load-test MODEL on a KServe v2 server (kiln, Triton, ...), like perf_analyzer.

    With --openai URL: a serving benchmark of an OpenAI-compatible LLM server (kiln, vLLM,
    ...), like vllm bench serve.
    """
    ctx = click.get_current_context()
    openai_url = params.pop("openai_url")
    check_flags(ctx, openai=openai_url is not None)
    if openai_url is not None:
        from kiln.bench.openai_cli import execute as execute_openai

        execute_openai({**params, "openai_url": openai_url, "model": model or model_opt,
                        "json_path": json_path})  # fmt: skip
        return
    for key in OPENAI_ONLY:
        params.pop(key)
    from kiln.bench.cli import execute

    name = model or model_opt
    if not name:
        raise click.UsageError("give the model: kiln bench MODEL (or -m MODEL)")
    execute({**params, "model": name, "json": json_path})


@main.command(context_settings={"show_default": True})
@optimize_options
def optimize(**params: Any) -> None:
    """Build, check, profile and pick the fastest accurate deployment of MODEL.

    MODEL is an ONNX file, a TorchScript file, or a PyTorch module:factory reference
    (with --input-shape). Writes REPO/NAME/{config.pbtxt,1/model.onnx} and report.{json,md,html};
    exits 2 when no candidate meets the constraints.
    """
    from kiln.optimize.cli import execute as run_optimize

    run_optimize(params)


class _MonitorGroup(click.Group):
    """``kiln monitor URL`` is ``kiln monitor live URL``; named subcommands still win."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["live", *args]
        return super().parse_args(ctx, args)


@main.group(cls=_MonitorGroup)
def monitor() -> None:
    """Monitoring tools for a running kiln server.

    \b
    kiln monitor URL            live terminal view (same as: kiln monitor live URL)
    kiln monitor history URL    metrics history as tables
    kiln monitor --agent H:P    every host's GPUs (GPU agents, kiln servers, --prometheus)
    kiln monitor compare URL    one time window against another
    kiln monitor agent          this host's GPUs on :9400/metrics, dcgm-exporter's names
    """


@monitor.command("live")
@click.argument("url", required=False)
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between refreshes.",
)
@click.option("--once", is_flag=True, help="Print one frame and exit (for scripts).")
@click.option(
    "--api-key",
    envvar="KILN_API_KEY",
    default=None,
    help="API key of a server started with --api-key [env: KILN_API_KEY].",
)
@click.option(
    "--agent",
    "agents",
    multiple=True,
    metavar="HOST:PORT",
    help="Also show this GPU agent's (or kiln server metrics port's) GPUs; may repeat.",
)
@click.option("--prometheus", default="", metavar="URL", help="Show every DCGM_FI_* GPU it has.")
@click.option(
    "--alert-rules",
    "alert_rules",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="With --agent/--prometheus: evaluate these rules files on the fleet's series.",
)
def monitor_live(
    url: str | None,
    interval: float,
    once: bool,
    api_key: str | None,
    agents: tuple[str, ...],
    prometheus: str,
    alert_rules: tuple[Path, ...],
) -> None:
    """Live view of a server (GET URL/api/live) and/or of GPU agents: rates, latency,
    resources, every host's GPUs, alerts."""
    from kiln.metrics.history_cli import HistoryClientError
    from kiln.metrics.live_cli import run_live

    if not (agents or prometheus):
        if url is None:
            raise click.UsageError("give a server URL, --agent HOST:PORT or --prometheus URL")
        try:
            run_live(url, interval, once, api_key=api_key)
        except HistoryClientError as exc:
            raise click.ClickException(str(exc)) from None
        return
    from kiln.metrics.fleet_cli import FleetView, run_fleet
    from kiln.monitoring.fleet import FleetError, FleetOptions
    from kiln.monitoring.rules import AlertRulesError

    try:
        view = FleetView(FleetOptions(agents, prometheus), url, list(alert_rules), api_key)
    except (FleetError, AlertRulesError) as exc:
        raise click.ClickException(str(exc)) from None
    run_fleet(view, interval, once)


@monitor.command("history")
@click.argument("url")
@click.option(
    "--metric",
    "metrics",
    multiple=True,
    help="History metric (default: throughput, avg_request_us, avg_queue_us, "
    "avg_compute_us, kiln_request_duration_p99_seconds); may repeat.",
)
@click.option("--since", default="10m", show_default=True, help="How far back (duration).")
@click.option("--step", default=None, help="Seconds (or a duration) per row [default: auto].")
@click.option("--model", default="", help="Only this model.")
@click.option(
    "--api-key",
    envvar="KILN_API_KEY",
    default=None,
    help="API key of a server started with --api-key [env: KILN_API_KEY].",
)
def monitor_history(
    url: str,
    metrics: tuple[str, ...],
    since: str,
    step: str | None,
    model: str,
    api_key: str | None,
) -> None:
    """Print a server's metrics history (GET URL/api/history) as tables."""
    from kiln.metrics.history_cli import HistoryClientError, print_history

    try:
        print_history(url, list(metrics), since, step, model, api_key=api_key)
    except HistoryClientError as exc:
        raise click.ClickException(str(exc)) from None


@monitor.command("compare")
@click.argument("url", required=False)
@click.option("--metric", required=True, help="History metric (or PromQL with --prometheus).")
@click.option("--before", required=True, help="Window: HH:MM-HH:MM (today) or START..END.")
@click.option("--after", required=True, help="Window: HH:MM-HH:MM (today) or START..END.")
@click.option("--prometheus", default="", metavar="URL", help="Read from Prometheus instead.")
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
@click.option(
    "--api-key",
    envvar="KILN_API_KEY",
    default=None,
    help="API key of a server started with --api-key [env: KILN_API_KEY].",
)
def monitor_compare(
    url: str | None,
    metric: str,
    before: str,
    after: str,
    prometheus: str,
    as_json: bool,
    api_key: str | None,
) -> None:
    """Compare a metric over two time windows (e.g. the hour before and after a deployment):
    mean, p50, p99 and max per series, and the change."""
    from kiln.metrics.history_cli import HistoryClientError
    from kiln.monitoring.compare import (
        CompareError,
        compare,
        kiln_fetch,
        parse_window,
        print_compare,
        prometheus_fetch,
        to_json,
    )

    if bool(url) == bool(prometheus):
        raise click.UsageError("give either a kiln server URL or --prometheus URL")
    fetch = prometheus_fetch(prometheus) if prometheus else kiln_fetch(str(url), api_key)
    try:
        result = compare(fetch, metric, parse_window(before), parse_window(after))
    except (CompareError, HistoryClientError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(to_json(result))
    else:
        print_compare(result)


@monitor.command("agent")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", default=9400, show_default=True, type=int, help="Port (dcgm-exporter's).")
@click.option(
    "--interval",
    default=1.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between NVML readings.",
)
def monitor_agent(host: str, port: int, interval: float) -> None:
    """Serve this host's GPUs on /metrics with dcgm-exporter's names and labels (no models)."""
    from kiln.metrics.agent import AgentError, run_agent

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        run_agent(host, port, interval)
    except (AgentError, OSError) as exc:
        raise click.ClickException(str(exc)) from None


@main.group()
def trace() -> None:
    """Read request traces (kiln serve --trace-config; docs/tracing.md)."""


@trace.command("summary")
@click.argument("files", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def trace_summary(files: tuple[Path, ...], as_json: bool) -> None:
    """Mean time per phase of the traced requests in FILES (Triton's trace format; several
    files, e.g. trace.json.0 trace.json.1, are read as one), per model and protocol:
    request (first to last stamp), receive, handler (REQUEST_START to REQUEST_END),
    queue, compute and its input / infer / output parts, send."""
    from rich.console import Console
    from rich.table import Table

    from kiln.trace_summary import PHASES, TraceFileError, read_entries, summarize, to_json

    try:
        groups = summarize(read_entries(list(files)))
    except TraceFileError as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(to_json(groups), indent=2))
        return
    if not groups:
        click.echo("no traces in " + ", ".join(map(str, files)))
        return
    table = Table(title="Traced requests: mean µs per phase")
    table.add_column("phase")
    for g in groups:
        version = f" v{g.version}" if g.version >= 0 else ""
        table.add_column(f"{g.model}{version}\n{g.protocol}", justify="right")
    table.add_row("traces", *(str(g.count) for g in groups))
    for phase, _, _ in PHASES:
        means = [g.mean_us(phase) for g in groups]
        table.add_row(phase, *("" if m is None else f"{m:,.0f}" for m in means))
    Console().print(table)


@main.group()
def repo() -> None:
    """Model repository tools."""


@repo.command("check")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def repo_check(directory: Path) -> None:
    """Validate every config in a model repository; report every problem with file and line."""
    from kiln.config.check import check_repository

    problems = check_repository(directory)
    for p in problems:
        click.echo(str(p), err=True)
    if problems:
        click.echo(f"{len(problems)} problem(s) found", err=True)
        sys.exit(1)
    click.echo(f"{directory}: OK")


@repo.command("example")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "models", multiple=True, help="Only these models (default: all).")
@click.option("--overwrite", is_flag=True, help="Replace existing model folders.")
def repo_example(directory: Path, models: tuple[str, ...], overwrite: bool) -> None:
    """Build the example model repository (simple, simple_string, mlp, cnn,
    simple_sequence*, image_preprocess, postprocess, cnn_pipeline, torch_mlp)."""
    from kiln.examples import build_example_repository
    from kiln.examples.repository import unavailable_examples

    try:
        built = build_example_repository(directory, models or None, overwrite=overwrite)
        skipped = unavailable_examples(models or None)
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in built:
        click.echo(f"built {path}")
    for name, reason in skipped.items():
        click.echo(f"skipped {name} ({reason})")


if __name__ == "__main__":  # pragma: no cover
    main()
