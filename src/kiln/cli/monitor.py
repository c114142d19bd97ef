"""``kiln monitor``: live view, history, compare (of a running server) and the GPU agent."""

from __future__ import annotations

import logging
from pathlib import Path

import click


class _MonitorGroup(click.Group):
    """``kiln monitor URL`` is ``kiln monitor live URL``; named subcommands still win."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            args = ["live", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_MonitorGroup)
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
    from kiln.monitoring.history_cli import HistoryClientError
    from kiln.monitoring.live_cli import run_live

    if not (agents or prometheus):
        if url is None:
            raise click.UsageError("give a server URL, --agent HOST:PORT or --prometheus URL")
        try:
            run_live(url, interval, once, api_key=api_key)
        except HistoryClientError as exc:
            raise click.ClickException(str(exc)) from None
        return
    from kiln.monitoring.fleet import FleetError, FleetOptions
    from kiln.monitoring.fleet_cli import FleetView, run_fleet
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
    from kiln.monitoring.history_cli import HistoryClientError, print_history

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
    from kiln.monitoring.compare import (
        CompareError,
        compare,
        kiln_fetch,
        parse_window,
        print_compare,
        prometheus_fetch,
        to_json,
    )
    from kiln.monitoring.history_cli import HistoryClientError

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
