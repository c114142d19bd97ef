"""``kiln bench --openai URL``: a serving benchmark for any OpenAI-compatible server.

The shape of ``vllm bench serve``: a fixed set of prompts, sent all at once
(``request_rate=inf``) or at Poisson (gamma, with ``burstiness``) arrivals, optionally
capped at ``max_concurrency`` in flight; every request streams, so the client times the
first token and every gap between chunks. Token counts come from the server's ``usage``
(``stream_options.include_usage``), not from re-tokenizing.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import math
import os
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import orjson

from kiln.bench.llm_dataset import BenchPrompt, Endpoint, load_jsonl, random_prompts
from kiln.bench.llm_stats import LLMBenchResult, RequestResult
from kiln.bench.options import BenchError

try:
    import httpx
except ImportError:  # pragma: no cover - httpx comes with kiln-serve[bench]
    httpx = None  # type: ignore[assignment]


class LLMProgress(Protocol):
    """Told the number of requests, then about each as it completes (the progress bar)."""

    def start(self, total: int) -> None: ...

    def done(self, result: RequestResult) -> None: ...


@dataclass(slots=True)
class OpenAIBenchOptions:
    """What ``kiln.bench.openai.run`` needs; the CLI flags have the same names."""

    url: str  # base URL: http://host:port, host:port, or .../v1
    model: str = ""  # empty: the first model GET /v1/models lists
    endpoint: Endpoint = Endpoint.COMPLETIONS
    dataset: str = "random"  # random | FILE.jsonl
    num_prompts: int = 100
    input_len: int = 128
    output_len: int = 64
    range_ratio: float = 0.0
    vocab_size: int = 256
    request_rate: float = math.inf  # requests/s; inf sends everything at once
    burstiness: float = 1.0  # gamma shape of the gaps; 1 is a Poisson process
    max_concurrency: int | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    api_key: str = field(default_factory=lambda: os.environ.get("OPENAI_API_KEY", ""))
    #: merged into every request's body (vLLM's ``--extra-body``): structured outputs, ...
    extra_body: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0  # per request
    warmup: bool = True  # one untimed request first, as vLLM does
    #: POST /start_profile before the timed requests, /stop_profile after (vLLM's --profile)
    profile: bool = False

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise BenchError(f"--request-rate must be > 0 (or inf), got {self.request_rate}")
        if self.burstiness <= 0:
            raise BenchError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise BenchError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        self.url = base_url(self.url)
        reserved = sorted(
            {"model", "stream", "stream_options", "prompt", "messages"} & set(self.extra_body)
        )
        if reserved:
            raise BenchError(f"--extra-body: {', '.join(reserved)} set by the benchmark itself")

    def prompts(self) -> list[BenchPrompt]:
        if self.dataset == "random":
            return random_prompts(self.endpoint, self.num_prompts, self.input_len,
                                  self.output_len, self.range_ratio, self.vocab_size,
                                  self.seed)  # fmt: skip
        return load_jsonl(Path(self.dataset), self.endpoint, self.num_prompts, self.output_len)

    def settings(self) -> dict[str, Any]:
        """The knobs of the run, for the report (the API key left out)."""
        rate = self.request_rate
        return {
            "dataset": self.dataset,
            "num_prompts": self.num_prompts,
            "input_len": self.input_len if self.dataset == "random" else None,
            "output_len": self.output_len,
            "range_ratio": self.range_ratio if self.dataset == "random" else None,
            "request_rate": "inf" if math.isinf(rate) else rate,
            "burstiness": self.burstiness,
            "max_concurrency": self.max_concurrency,
            "ignore_eos": self.ignore_eos,
            "temperature": self.temperature,
            "seed": self.seed,
            "extra_body": self.extra_body or None,
        }


def base_url(url: str) -> str:
    """``http://host:port`` from what a user types: no scheme, a trailing ``/v1`` or ``/``."""
    url = url.strip().rstrip("/")
    if not url:
        raise BenchError("--openai: give the server's base URL, e.g. http://localhost:8000")
    if "://" not in url:
        url = "http://" + url
    return url.removesuffix("/v1")


def request_body(options: OpenAIBenchOptions, model: str, p: BenchPrompt) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": p.max_tokens,
        "temperature": options.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if options.ignore_eos:
        body["ignore_eos"] = True  # vLLM's extension (kiln, SGLang too): exact output lengths
    body.update(options.extra_body)
    if options.endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": p.prompt}]
    else:
        body["prompt"] = p.prompt
    return body


def _error_text(status: int, raw: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, AttributeError):
        err = orjson.loads(raw).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        if message:
            return f"HTTP {status}: {message}"
    return f"HTTP {status}: {raw[:200].decode(errors='replace')}"


def _chunk_text(event: dict[str, Any], endpoint: Endpoint) -> tuple[str, str | None]:
    choices = event.get("choices") or []
    if not choices:
        return "", None
    choice = choices[0]
    if endpoint is Endpoint.CHAT:
        text = (choice.get("delta") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason")


async def send(client: httpx.AsyncClient, options: OpenAIBenchOptions, model: str,
               p: BenchPrompt, index: int) -> RequestResult:  # fmt: skip
    """Stream one request; a failure is recorded in the result, never raised."""
    result = RequestResult(index, time.perf_counter(), prompt_tokens=p.prompt_len)
    last = result.start
    try:
        body = orjson.dumps(request_body(options, model, p))
        async with client.stream("POST", options.endpoint.path, content=body) as resp:
            if resp.status_code != 200:
                result.error = _error_text(resp.status_code, await resp.aread())
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = orjson.loads(data)
                if "error" in event:
                    result.error = _error_text(200, data.encode())
                    return result
                now = time.perf_counter()
                text, reason = _chunk_text(event, options.endpoint)
                # The first chunk with text (or the end) is the first token: a chat stream's
                # opening role-only chunk may leave before the prompt is even computed.
                if text or reason:
                    if result.ttft == 0.0:
                        result.ttft = now - result.start
                    else:
                        result.itl.append(now - last)
                    last = now
                    result.chunks += 1 if text else 0
                result.finish_reason = reason or result.finish_reason
                usage = event.get("usage")
                if usage:
                    result.usage = True
                    result.prompt_tokens = int(usage.get("prompt_tokens", 0))
                    result.output_tokens = int(usage.get("completion_tokens", 0))
        result.latency = time.perf_counter() - result.start
        if not result.usage:
            result.output_tokens = result.chunks  # a server without usage: chunks ~ tokens
        if result.ttft == 0.0:
            result.error = "the stream ended without a token"
    except (httpx.HTTPError, orjson.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return result


async def resolve_model(client: httpx.AsyncClient, url: str, model: str) -> str:
    """The model to benchmark; a clear error when the server is not there or lacks it."""
    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach the OpenAI-compatible server at {url}: {exc}") from None
    if resp.status_code == 401:
        raise BenchError(f"{url}: {_error_text(401, resp.content)} (give --api-key)")
    if resp.status_code != 200:
        if model:
            return model  # no model listing there: the first request will tell
        raise BenchError(f"{url}/v1/models: HTTP {resp.status_code}; give --model")
    served = [str(m.get("id")) for m in resp.json().get("data", [])]
    if not model:
        if not served:
            raise BenchError(f"{url} serves no model")
        return served[0]
    if model not in served:
        raise BenchError(
            f"model '{model}' is not served at {url} (it serves: {', '.join(served) or 'none'})"
        )
    return model


async def _profiler(client: httpx.AsyncClient, url: str, what: str) -> None:
    """vLLM's ``--profile``: the server records the timed requests' steps."""
    try:
        resp = await client.post(f"/{what}_profile", timeout=600.0)
    except httpx.HTTPError as exc:
        raise BenchError(f"--profile: POST {url}/{what}_profile failed: {exc}") from None
    if resp.status_code != 200:
        hint = " (start the server with --profiler-config)" if resp.status_code == 404 else ""
        raise BenchError(
            f"--profile: POST {url}/{what}_profile: {_error_text(resp.status_code, resp.content)}"
            + hint
        )


def arrival_gaps(count: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds between sends: all zero at ``inf``; gamma-distributed (mean 1/rate) otherwise."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(count)]


async def run_async(options: OpenAIBenchOptions,
                    progress: LLMProgress | None = None) -> LLMBenchResult:  # fmt: skip
    if httpx is None:
        raise BenchError("--openai needs httpx: install kiln-serve[bench]")
    prompts = options.prompts()
    headers = {"Content-Type": "application/json"}
    if options.api_key:
        headers["Authorization"] = f"Bearer {options.api_key}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(options.timeout_s, connect=10.0)
    async with httpx.AsyncClient(
        base_url=options.url, headers=headers, limits=limits, timeout=timeout
    ) as client:
        model = await resolve_model(client, options.url, options.model)
        warm = None
        if options.warmup:
            first = prompts[0]
            warm = await send(client, options, model, BenchPrompt(first.prompt, 1), -1)
            if warm.error:
                raise BenchError(f"the warm-up request to {options.url} failed: {warm.error}")
        gate = asyncio.Semaphore(options.max_concurrency or len(prompts))
        if options.profile:
            await _profiler(client, options.url, "start")

        async def one(index: int, p: BenchPrompt) -> RequestResult:
            async with gate:
                result = await send(client, options, model, p, index)
            if progress is not None:
                progress.done(result)
            return result

        if progress is not None:
            progress.start(len(prompts))
        started = datetime.datetime.now().isoformat("T", "seconds")
        t0 = time.perf_counter()
        due = t0
        tasks: list[Awaitable[RequestResult]] = []
        gaps = arrival_gaps(len(prompts), options.request_rate, options.burstiness, options.seed)
        for index, (p, gap) in enumerate(zip(prompts, gaps, strict=True)):
            due += gap  # absolute schedule: a late wake-up does not shift later arrivals
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(index, p)))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
        if options.profile:
            await _profiler(client, options.url, "stop")
        return LLMBenchResult(
            url=options.url,
            model=model,
            endpoint=options.endpoint.value,
            started=started,
            duration_s=duration,
            settings=options.settings(),
            results=results,
            warmup=warm,
        )


def run(options: OpenAIBenchOptions | None = None, /, *, progress: LLMProgress | None = None,
        **kwargs: Any) -> LLMBenchResult:  # fmt: skip
    """From Python: ``run(url="localhost:8000", model="tiny", num_prompts=8)``."""
    opts = options if options is not None else OpenAIBenchOptions(**kwargs)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_async(opts, progress))
    return uvloop.run(run_async(opts, progress))
