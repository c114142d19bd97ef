"""Monitoring reads (``/api/history`` queries, ``/api/live`` summaries) are anyone's who can
reach ``/api/*``: they run on a small executor of their own, never on asyncio's default
one, which decodes large inference bodies, inflates gRPC messages and tokenizes prompts.
Before: enough slow history queries at once (a long range of a fine-grained history)
took every default worker, and inference waited behind them. Beyond a bound of reads
running and waiting, a read is a 503 at once."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from kiln.monitoring import routes
from kiln.monitoring.routes import monitor_routes

QUERIES = 40  # more than asyncio's default executor has workers (at most 32)


class _Gate:
    def __init__(self) -> None:
        self.open = threading.Event()
        self.started = 0

    def run_query(self, path: Path, q: Any) -> dict[str, Any]:
        self.started += 1
        self.open.wait(60)
        return {"metric": q.metric, "series": []}


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[httpx.AsyncClient, _Gate]]:
    gate = _Gate()
    monkeypatch.setattr(routes, "run_query", gate.run_query)
    options = SimpleNamespace(interval_s=1.0, path=Path("unused.db"))
    history = SimpleNamespace(available=True, error="", options=options)
    monitor = SimpleNamespace(history=history, alerts=None)
    app = Starlette(routes=monitor_routes(monitor))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as c:
        try:
            yield c, gate
        finally:
            gate.open.set()


async def _until(predicate: Any) -> None:
    for _ in range(1000):
        if predicate():
            return
        await asyncio.sleep(0.01)


async def test_history_queries_leave_the_default_executor_free(
    client: tuple[httpx.AsyncClient, _Gate],
) -> None:
    c, gate = client
    queries = [asyncio.create_task(c.get("/api/history?metric=throughput")) for _ in range(QUERIES)]
    await _until(lambda: gate.started >= routes.MONITOR_READ_WORKERS)
    # inference's work for the default executor still runs while the queries hang
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "ran"), 20) == "ran"
    assert gate.started == routes.MONITOR_READ_WORKERS  # the rest wait their turn
    gate.open.set()
    answers = await asyncio.gather(*queries)
    assert [a.status_code for a in answers] == [200] * QUERIES


async def test_reads_beyond_the_bound_are_503_at_once(
    client: tuple[httpx.AsyncClient, _Gate], monkeypatch: pytest.MonkeyPatch
) -> None:
    c, gate = client
    monkeypatch.setattr(routes, "MAX_MONITOR_READS", 4)
    held = [asyncio.create_task(c.get("/api/history?metric=throughput")) for _ in range(4)]
    await _until(lambda: gate.started >= routes.MONITOR_READ_WORKERS)
    over = await c.get("/api/history?metric=throughput")
    assert over.status_code == 503
    assert over.headers["retry-after"] == "1"
    assert "too many monitoring reads at once (4)" in over.json()["error"]
    gate.open.set()
    assert [r.status_code for r in await asyncio.gather(*held)] == [200] * 4
