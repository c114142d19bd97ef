"""The metrics endpoint (port 8002 by default): Prometheus text format.

``MetricsService`` owns what /metrics needs for the server's lifetime: the collectors,
the telemetry poller thread, and the per-runtime observer factory bound into core.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.process_collector import ProcessCollector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kiln.core.stats import ModelStats
from kiln.llm.metrics import LLMCollector
from kiln.llm.sleep_metrics import SleepModeCollector
from kiln.metrics.collector import ServerCollector
from kiln.metrics.config import MetricsConfig
from kiln.metrics.custom import CustomMetricsCollector
from kiln.metrics.exposition import CONTENT_TYPE, render
from kiln.metrics.gpu import GpuCollector
from kiln.metrics.host import HostCollector
from kiln.metrics.observer import RuntimeMetrics
from kiln.metrics.readiness import ReadinessCollector
from kiln.metrics.rollout import RolloutCollector
from kiln.metrics.telemetry import Sampled, TelemetryPoller
from kiln.server.server import Server


@dataclass(frozen=True, slots=True)
class MetricsOptions:
    config: MetricsConfig = field(default_factory=MetricsConfig)
    interval_ms: int = 2000  # Triton's --metrics-interval-ms default
    allow_gpu: bool = True
    allow_cpu: bool = True


def observer_factory(config: MetricsConfig) -> Callable[[], RuntimeMetrics]:
    return lambda: RuntimeMetrics(config)


class MetricsService:
    def __init__(self, server: Server, options: MetricsOptions) -> None:
        self.options = options
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ServerCollector(server.repository.runtimes, options.config))
        self.registry.register(ReadinessCollector(server.repository))
        self.registry.register(LLMCollector(server.llm_engines))
        self.registry.register(SleepModeCollector())
        self.registry.register(CustomMetricsCollector(server.repository.runtimes))
        self.registry.register(RolloutCollector(server.rollouts))
        # process_resident_memory_bytes, process_cpu_seconds_total, open fds, start time.
        self.registry.register(ProcessCollector(registry=None))
        sources: list[Sampled] = []
        self.gpu: GpuCollector | None = None
        if options.allow_gpu:
            self.gpu = GpuCollector.create()
            if self.gpu is not None:
                self.registry.register(self.gpu)
                sources.append(self.gpu)
        if options.allow_cpu:
            host = HostCollector()
            self.registry.register(host)
            sources.append(host)
        self.poller = TelemetryPoller(sources, options.interval_ms / 1000)
        # One render at a time, on a thread of its own (see ``render_async``).
        self._render_pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-metrics-render")
        self._rendering: asyncio.Future[bytes] | None = None

    def start(self) -> None:
        # Bound before any model loads, so every runtime gets its distributions.
        ModelStats.observer_factory = observer_factory(self.options.config)
        self.poller.start()

    def stop(self) -> None:
        self.poller.stop()
        self._render_pool.shutdown(wait=False)
        if self.gpu is not None:
            self.gpu.close()

    def render(self) -> bytes:
        for _ in range(3):
            try:
                return render(self.registry.collect())
            except RuntimeError:
                # A model (un)loaded on the event loop while this thread walked the
                # runtimes ("dictionary changed size during iteration"): read again.
                continue
        return render(self.registry.collect())

    async def render_async(self) -> bytes:
        """:meth:`render` on the render thread: 200 models with every distribution on
        are 1.4 MB of text that took 60 ms to collect and render, all of it on the event
        loop while inference waited. One render runs at a time; a scrape that arrives
        while one is in flight gets that render's bytes instead of queueing another."""
        loop = asyncio.get_running_loop()
        rendering = self._rendering
        if rendering is None or rendering.get_loop() is not loop:
            rendering = loop.run_in_executor(self._render_pool, self.render)
            self._rendering = rendering
            rendering.add_done_callback(self._rendered)
        # shielded: a scrape that disconnects does not cancel the others' render
        return await asyncio.shield(rendering)

    def _rendered(self, done: asyncio.Future[bytes]) -> None:
        if self._rendering is done:
            self._rendering = None


def metrics_app(service: MetricsService) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(await service.render_async(), headers={"Content-Type": CONTENT_TYPE})

    return Starlette(routes=[Route("/metrics", metrics, methods=["GET"])])
