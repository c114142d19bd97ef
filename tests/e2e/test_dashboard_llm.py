"""The LLM engine on the dashboard (headless Chromium), in ``/api/live``, in the history and
in ``kiln monitor``, against a real ``kiln serve`` over a tiny random Llama that real
``openai`` client completions keep busy."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser

from tests.conftest import KilnProcess
from tests.e2e.conftest import TIMEOUT_MS, Watched
from tests.integration.monitor_helpers import get_json, wait_for

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.llm_models import tiny_llm_repository  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CONFIG = """
name: "tiny"
backend: "llm"
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "max_num_seqs" value { string_value: "8" } }
parameters { key: "num_gpu_blocks" value { string_value: "64" } }
parameters { key: "dtype" value { string_value: "float32" } }
"""
LLM_KEYS = {
    "model", "running", "waiting", "kv_cache_usage", "preemptions", "preemptions_per_s",
    "prompt_tokens", "generation_tokens", "prompt_tokens_per_s", "generation_tokens_per_s",
    "prefix_cache_hit_rate", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
    "e2e_p50_ms",
}  # fmt: skip
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("llm-dashboard")
    repo = tiny_llm_repository(root, CONFIG)
    args = ["--history-interval-secs", "0.2", "--history-path", str(root / "h.db")]
    proc = KilnProcess(repo, args=[*args, "--no-allow-grpc"]).start(timeout=120)
    yield proc
    proc.stop()


def complete(server: KilnProcess) -> int:
    """One real completion of exactly MAX_TOKENS tokens; returns the tokens generated."""
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(
        model="tiny",
        prompt="the quick brown fox jumps over the lazy dog",
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage is not None
    return int(out.usage.completion_tokens)


class Traffic:
    """Two clients completing back to back while a viewer watches, so every live window
    (and most instants) has tokens in flight."""

    def __init__(self, server: KilnProcess) -> None:
        self.stop = threading.Event()
        self.tokens = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(server,)) for _ in range(2)]

    def _run(self, server: KilnProcess) -> None:
        try:
            while not self.stop.is_set():
                n = complete(server)
                with self.lock:
                    self.tokens += n
        except BaseException as exc:  # surfaced by __exit__, not lost in the thread
            self.errors.append(exc)

    def __enter__(self) -> Traffic:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        assert self.errors == []


def _number(text: str) -> float:
    assert re.fullmatch(r"\d+(\.\d+)?", text), f"not a figure: {text!r}"
    return float(text)


def test_dashboard_shows_the_llm_section_with_live_figures(
    browser: Browser, server: KilnProcess
) -> None:
    assert sum(complete(server) for _ in range(3)) == 3 * MAX_TOKENS
    w = Watched(browser)
    w.page.goto(f"http://{server.http_url}/dashboard/")
    row = w.page.locator('#llm tr[data-model="tiny"]')
    row.wait_for(timeout=TIMEOUT_MS)
    assert w.page.locator("#llm-panel").is_visible()
    assert w.page.locator('#models tr[data-model="tiny"]').count() == 1  # also a model

    with Traffic(server) as traffic:
        w.page.wait_for_function(
            """() => { const t = document.querySelector(
                 '#llm tr[data-model="tiny"] td.generation-tps');
               return t && Number(t.textContent) > 0; }""",
            timeout=TIMEOUT_MS,
        )
        w.page.wait_for_function(
            """() => document.querySelector('#llm tr[data-model="tiny"] td.ttft-p50')
                 .textContent !== '\u2013'""",  # the page's 'no figure'
            timeout=TIMEOUT_MS,
        )
        for chart_id in ("llm-tokens", "llm-kv-cache", "llm-ttft", "llm-itl"):
            w.wait_chart_positive(chart_id)
        cells = {
            name: row.locator(f"td.{name}").inner_text()
            for name in ("running", "waiting", "kv-cache", "prompt-tps", "ttft-p50", "ttft-p99")
        }
    assert traffic.tokens > 0
    assert 0 <= _number(cells["kv-cache"]) <= 100
    assert _number(cells["prompt-tps"]) >= 0
    assert _number(cells["ttft-p99"]) >= _number(cells["ttft-p50"]) > 0
    assert _number(cells["running"]) >= 0 and _number(cells["waiting"]) >= 0
    assert w.chart("llm-tokens")["tiny"] > 0
    assert 0 < w.chart("llm-kv-cache")["tiny"] <= 100  # in flight at some reading
    ttft = w.chart("llm-ttft")
    assert ttft["tiny p99"] >= ttft["tiny p50"] > 0
    itl = w.chart("llm-itl")  # from vllm:inter_token_latency_seconds
    assert itl["tiny p99"] >= itl["tiny p50"] > 0

    ARTIFACTS.mkdir(exist_ok=True)
    w.page.screenshot(path=str(ARTIFACTS / "dashboard-llm.png"), full_page=True)
    # The range picker refills the LLM charts from history too.
    w.page.click('#range button[data-range="1h"]')
    w.wait_chart_positive("llm-tokens")
    assert w.errors == []
    assert w.hosts == {"127.0.0.1"}
    w.page.close()


def _monitor(*args: str) -> str:
    env = dict(os.environ, COLUMNS="240", NO_COLOR="1")  # wide: rich never folds a figure
    result = subprocess.run(
        [sys.executable, "-m", "kiln", "monitor", *args],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def _llm_row(output: str) -> list[str]:
    llm_part = output[output.index("LLM engine") :]
    line = next(ln for ln in llm_part.splitlines() if re.match(r"│ tiny\s", ln))
    return [cell.strip() for cell in line.strip("│ ").split("│")]


def _tokens_per_s(server: KilnProcess) -> Callable[[], float | None]:
    def read() -> float | None:
        rate = get_json(server, "/api/live")[1]["llm"][0]["generation_tokens_per_s"]
        return rate if rate else None  # null (no baseline yet) or 0: keep waiting

    return read


def _generated(server: KilnProcess) -> int:
    """The engine's counter from /metrics: always fresh (/api/live shares its readings)."""
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    line = r'^vllm:generation_tokens_total\{model_name="tiny",engine="0"\} (\S+)$'
    found = re.search(line, text, re.M)
    assert found, "vllm:generation_tokens_total not exposed"
    return int(float(found.group(1)))


def _live_settled(server: KilnProcess, generated: int) -> dict[str, Any] | None:
    [tiny] = get_json(server, "/api/live")[1]["llm"]
    return tiny if tiny["generation_tokens"] == generated else None


def test_api_live_history_and_kiln_monitor_show_the_llm(server: KilnProcess) -> None:
    before = _generated(server)
    with Traffic(server) as traffic:
        wait_for(_tokens_per_s(server), 30, "generation tokens/s in /api/live")
        _, live = get_json(server, "/api/live")
        frame = _monitor(server.http_url, "--once", "--interval", "0.5")
    [tiny] = live["llm"]
    assert set(tiny) == LLM_KEYS and tiny["model"] == "tiny"
    assert tiny["prompt_tokens"] > 0 and tiny["generation_tokens"] > 0
    assert 0 <= tiny["kv_cache_usage"] <= 1 and tiny["preemptions"] == 0
    # Every token the clients received is counted, and nothing else, once /api/live
    # takes a reading after the traffic (it reuses one for up to half a second).
    expected = before + traffic.tokens
    settled = wait_for(lambda: _live_settled(server, expected), 10, f"{expected} tokens")
    assert (settled["running"], settled["waiting"]) == (0, 0)

    row = _llm_row(frame)  # model, running, waiting, KV %, prompt tok/s, gen tok/s, ...
    assert row[0] == "tiny" and float(row[5]) > 0 and 0 <= float(row[3]) <= 100

    # a table per metric (its title wraps to the table's width), a column per model
    tokens = _monitor("history", server.http_url, "--metric", "llm_generation_tokens_per_s")
    assert "llm_generation_tokens_per_s" in tokens and "model_name=tiny" in tokens
    rates = re.findall(r"│ \d\d:\d\d:\d\d │\s+([\d.e+-]+) │", tokens)
    assert rates and max(float(v) for v in rates) > 0
    ttft = _monitor(
        "history", server.http_url, "--metric", "kiln_llm_time_to_first_token_p99_seconds"
    )
    assert "model_name=tiny" in ttft and re.search(r"│ \d\d:\d\d:\d\d │\s+[\d.]+", ttft)
    _, result = get_json(
        server, "/api/history", metric="llm_generation_tokens_per_s", model="tiny", start="now-5m"
    )
    [series] = result["series"]
    assert series["labels"] == {"model_name": "tiny", "engine": "0"}  # vLLM's labels
    assert max(v for _, v in series["points"]) > 0
