"""Shared by the dashboard's browser tests: headless Debian ``chromium`` driven by
Playwright (no browser download), and a page that records its errors and the hosts it
asked, so every test can assert no console error and nothing loaded from outside kiln."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Request, sync_playwright

CHROMIUM = Path("/usr/bin/chromium")
TIMEOUT_MS = 30_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM.exists(), "Debian chromium is missing: run `make system-deps`"
    with sync_playwright() as pw:
        b = pw.chromium.launch(
            executable_path=str(CHROMIUM),
            args=[
                "--headless", "--no-sandbox", "--disable-gpu",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run",
            ],
        )  # fmt: skip
        yield b
        b.close()


class Watched:
    """A page plus what it logged and asked for, to assert no errors and no outside hosts."""

    def __init__(self, browser: Browser) -> None:
        self.page: Page = browser.new_page(viewport={"width": 1400, "height": 1100})
        self.errors: list[str] = []
        self.hosts: set[str] = set()
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        self.page.on("request", self._request)

    def _console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def _request(self, req: Request) -> None:
        parts = urlsplit(req.url)
        if parts.scheme != "data":
            self.hosts.add(parts.hostname or req.url)

    def chart(self, chart_id: str) -> dict[str, float]:
        """Series name -> the largest value uPlot holds for it, for one chart."""
        result: dict[str, float] = self.page.evaluate(
            """(id) => { const c = window.kilnDashboard.charts.get(id);
                 if (!c || !c.plot) return {};
                 return Object.fromEntries(c.plot.series.slice(1).map((s, i) =>
                   [s.label, Math.max(...c.plot.data[i + 1].filter((v) => v != null))])); }""",
            chart_id,
        )
        return result

    def wait_chart_positive(self, chart_id: str) -> None:
        self.page.wait_for_function(
            """(id) => { const c = window.kilnDashboard.charts.get(id);
                 return c && c.plot && c.plot.data.slice(1).flat().some((v) => v > 0); }""",
            arg=chart_id,
            timeout=TIMEOUT_MS,
        )
