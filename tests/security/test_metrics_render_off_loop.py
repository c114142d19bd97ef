"""/metrics is collected and rendered on a thread of its own, one render at a time.

Before, the scrape's collect and render ran on the event loop: 200 models with every
latency distribution on are 1.4 MB of text that took 60 ms, during which no inference
request was read or answered. Which thread renders is checked, never how long it took."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import httpx
import pytest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kiln.core.stats import ModelStats
from kiln.metrics import app as metrics_module
from kiln.metrics.app import MetricsOptions, MetricsService, metrics_app
from kiln.metrics.exposition import CONTENT_TYPE, render
from kiln.server.server import Server, ServerOptions


class _Recorder:
    """Wraps the exposition ``render``: which thread ran it, and a gate holding it."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()  # made on the test's event loop
        self.threads: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def __call__(self, metrics: Iterable[Metric]) -> bytes:
        self.threads.append(threading.get_ident())
        self.entered.set()
        if threading.get_ident() == self.loop_thread:
            raise AssertionError("/metrics rendered on the event loop")  # never wait there
        assert self.release.wait(60), "the test never released the render"
        return render(metrics)


@pytest.fixture
async def service(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[MetricsService, _Recorder]]:
    recorder = _Recorder()
    monkeypatch.setattr(metrics_module, "render", recorder)
    server = Server(ServerOptions([tmp_path]))
    service = MetricsService(server, MetricsOptions(allow_gpu=False))
    service.start()
    try:
        yield service, recorder
    finally:
        recorder.release.set()
        service.stop()
        ModelStats.observer_factory = None


async def test_a_scrape_renders_on_a_worker_thread(
    service: tuple[MetricsService, _Recorder],
) -> None:
    metrics, recorder = service
    transport = httpx.ASGITransport(app=metrics_app(metrics))
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"] == CONTENT_TYPE
    names = {f.name for f in text_string_to_metric_families(response.text)}
    assert "process_resident_memory_bytes" in names
    assert recorder.threads and threading.get_ident() not in recorder.threads


async def test_concurrent_scrapes_share_the_render_in_flight(
    service: tuple[MetricsService, _Recorder],
) -> None:
    """Scrapes that come while a render runs wait for it and get its bytes: a burst of
    scrapes costs one render, not one each queued behind the other."""
    metrics, recorder = service
    recorder.release.clear()
    first = asyncio.create_task(metrics.render_async())
    assert await asyncio.to_thread(recorder.entered.wait, 60)
    others = [asyncio.create_task(metrics.render_async()) for _ in range(4)]
    await asyncio.sleep(0)  # each of them reaches its wait for the render in flight
    recorder.release.set()
    bodies = await asyncio.gather(first, *others)
    assert len(recorder.threads) == 1
    assert len(set(bodies)) == 1 and b"# TYPE process_resident_memory_bytes gauge" in bodies[0]
    # once it is done, the next scrape renders afresh
    await metrics.render_async()
    assert len(recorder.threads) == 2


async def test_a_scrape_that_goes_away_leaves_the_render_to_the_others(
    service: tuple[MetricsService, _Recorder],
) -> None:
    metrics, recorder = service
    recorder.release.clear()
    gone = asyncio.create_task(metrics.render_async())
    assert await asyncio.to_thread(recorder.entered.wait, 60)
    staying = asyncio.create_task(metrics.render_async())
    await asyncio.sleep(0)
    gone.cancel()
    recorder.release.set()
    assert b"process_resident_memory_bytes" in await staying
    assert len(recorder.threads) == 1
