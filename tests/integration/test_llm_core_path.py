"""LLM requests go through kiln's core like every other request (``Server.llm_engine``):
the OpenAI and generate routes count in the model's Triton statistics and ``nv_inference_*``
metrics, are traced, get infer's errors for an unknown or unloaded model, and an unload
under streaming load drains them. A real ``kiln serve``, the real ``openai`` client."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_api import CONFIG  # noqa: E402
from tests.integration.test_tracing import _by_request, _flags, _traces  # noqa: E402
from tests.llm_models import tiny_llm_repository  # noqa: E402


def _client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)


def _stats(server: KilnProcess) -> dict[str, Any]:
    r = requests.get(f"http://{server.http_url}/v2/models/tiny/stats", timeout=10)
    assert r.status_code == 200, r.text
    [stats] = r.json()["model_stats"]
    return stats


def _metric(server: KilnProcess, name: str) -> float:
    text = urllib.request.urlopen(server.metrics_url).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and 'model="tiny"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for model tiny not exposed")


def _infer_error(server: KilnProcess, model: str) -> tuple[int, str]:
    """What KServe infer answers for ``model``: the reference every route must match."""
    body = {"inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [1], "data": ["x"]}]}
    r = requests.post(f"http://{server.http_url}/v2/models/{model}/infer", json=body, timeout=10)
    return r.status_code, r.json()["error"]


def test_openai_and_generate_requests_count_in_stats_metrics_and_traces(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    out = tmp_path / "trace.json"
    repo = tiny_llm_repository(tmp_path / "llm", CONFIG)
    flags = _flags(f"triton,file={out}", "level=TIMESTAMPS", "rate=1")
    server = make_server(repo, args=flags).start(timeout=120)
    client = _client(server)
    before = _stats(server)
    assert before["execution_count"] == 0
    done = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=3)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    for route in ("generate", "generate_stream"):
        r = requests.post(
            f"http://{server.http_url}/v2/models/tiny/{route}",
            json={"text_input": "once upon", "max_tokens": 3}, timeout=60,
        )  # fmt: skip
        assert r.status_code == 200, r.text
    stats = _stats(server)
    inference = stats["inference_stats"]
    # four requests, each one execution of the engine, as Triton counts its vLLM backend's
    assert inference["success"]["count"] == 4
    assert inference["fail"]["count"] == 0
    assert stats["inference_count"] == 4
    assert stats["execution_count"] == 4
    assert inference["queue"]["count"] == 4
    assert inference["compute_infer"]["count"] == 4
    assert inference["compute_infer"]["ns"] > 0
    assert inference["success"]["ns"] >= inference["compute_infer"]["ns"]
    assert stats["last_inference"] > 0
    assert _metric(server, "nv_inference_request_success") == 4
    assert _metric(server, "nv_inference_count") == 4
    assert _metric(server, "nv_inference_exec_count") == 4
    assert _metric(server, "nv_inference_compute_infer_duration_us") > 0
    assert server.stop() == 0
    traces = _traces(out)
    stamps = [n for n, _ in _by_request(traces, done.id)["stamps"]]
    assert stamps[:3] == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START"]
    assert stamps[-1] == "REQUEST_END" and "FIRST_TOKEN" in stamps
    assert len([t for t in traces.values() if t.get("model_name") == "tiny"]) == 4


EXPLICIT_CONFIG = CONFIG.replace('"8"', '"4"', 1)  # max_num_seqs 4: the streams run together
STREAMS = 4
MAX_TOKENS = 160


def _chat(client: Any, prompt: str, **extra: Any) -> Any:
    return client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
        **extra,
    )


def _streams_during(
    client: openai.OpenAI, prompts: list[str], action: Callable[[], None]
) -> list[dict[str, Any]]:
    """Stream a chat completion of each prompt at once; once every stream has its first
    token (each request runs in the engine), ``action``; each stream's outcome."""
    started = threading.Barrier(len(prompts) + 1)
    results: list[dict[str, Any]] = [{} for _ in prompts]

    def stream(i: int) -> None:
        text, reason, usage = [], None, None
        try:
            events = _chat(client, prompts[i], stream=True, stream_options={"include_usage": True})
            for n, chunk in enumerate(events):
                if chunk.choices:
                    text.append(chunk.choices[0].delta.content or "")
                    reason = chunk.choices[0].finish_reason or reason
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                if n == 1:  # the first token is out
                    started.wait(timeout=60)
        except Exception as exc:  # reported by the caller, with the others' outcomes
            results[i]["error"] = repr(exc)
        results[i].update(text="".join(text), reason=reason, tokens=usage)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    started.wait(timeout=60)
    action()
    for t in threads:
        t.join(timeout=120)
    return results


def _whole(results: list[dict[str, Any]], expected: list[str]) -> None:
    """Every stream ended normally with its whole text."""
    for i, result in enumerate(results):
        assert "error" not in result, result
        assert result["reason"] == "length" and result["tokens"] == MAX_TOKENS, result
        assert result["text"] == expected[i]


def _explicit_server(
    make_server: type[KilnProcess], tmp_path: Path, exit_timeout: int = 120
) -> KilnProcess:
    repo = tiny_llm_repository(tmp_path / "llm", EXPLICIT_CONFIG)
    args = ["--model-control-mode=explicit", "--load-model=tiny",
            f"--exit-timeout-secs={exit_timeout}"]  # fmt: skip
    return make_server(repo, args=args).start(timeout=120)


PROMPTS = [f"tell me story number {i}" for i in range(STREAMS)]


def test_unload_under_streaming_load_loses_no_request(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    server = _explicit_server(make_server, tmp_path)
    # a stream that core did not drain would hang: a timeout makes that a failure here
    client = _client(server).with_options(timeout=60)
    # the texts the streams must deliver whole: greedy, so the same on every run
    expected = [_chat(client, p).choices[0].message.content for p in PROMPTS]

    def unload() -> None:
        url = f"http://{server.http_url}/v2/repository/models/tiny/unload"
        r = requests.post(url, json={}, timeout=120)  # returns once the streams drained
        assert r.status_code == 200, r.text

    _whole(_streams_during(client, PROMPTS, unload), expected)
    # then refused, with infer's error for the model (core's message, OpenAI's shape)
    status, message = _infer_error(server, "tiny")
    assert status == 404
    with pytest.raises(openai.NotFoundError) as info:
        _chat(client, "after the unload")
    body = info.value.body
    assert isinstance(body, dict) and body["message"] == message
    assert body["code"] == "model_not_found" and body["param"] == "model"
    r = requests.post(
        f"http://{server.http_url}/v2/models/tiny/generate", json={"text_input": "x"}, timeout=10
    )
    assert (r.status_code, r.json()["error"]) == (404, message)


def test_reload_and_shutdown_under_streaming_load_finish_every_stream(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    server = _explicit_server(make_server, tmp_path)
    client = _client(server).with_options(timeout=60)
    prompts = PROMPTS[:2]
    expected = [_chat(client, p).choices[0].message.content for p in prompts]

    def reload() -> None:
        url = f"http://{server.http_url}/v2/repository/models/tiny/load"
        assert requests.post(url, json={}, timeout=120).status_code == 200

    _whole(_streams_during(client, prompts, reload), expected)
    assert _chat(client, prompts[0]).choices[0].message.content == expected[0]  # new engine
    stopped: list[int] = []
    _whole(_streams_during(client, prompts, lambda: stopped.append(server.stop())), expected)
    assert stopped == [0]


def test_a_stream_past_the_drain_timeout_ends_with_a_clear_error(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    server = _explicit_server(make_server, tmp_path, exit_timeout=0)
    client = _client(server).with_options(timeout=60)

    def unload() -> None:
        url = f"http://{server.http_url}/v2/repository/models/tiny/unload"
        assert requests.post(url, json={}, timeout=120).status_code == 200

    [result] = _streams_during(client, PROMPTS[:1], unload)
    assert "unloaded before the request finished" in result.get("error", ""), result
    assert result["tokens"] is None  # no usage: the stream did not end normally


def test_unknown_model_gets_infer_s_error(make_server: type[KilnProcess], tmp_path: Path) -> None:
    repo = tiny_llm_repository(tmp_path / "llm", CONFIG)
    server = make_server(repo).start(timeout=120)
    status, message = _infer_error(server, "nope")
    assert status == 404
    client = _client(server)
    for call in (
        lambda: client.completions.create(model="nope", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "hi"}], stream=True
        ),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        body = info.value.body
        assert isinstance(body, dict) and body["message"] == message
        assert body["type"] == "invalid_request_error" and body["code"] == "model_not_found"
