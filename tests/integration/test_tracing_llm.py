"""Tracing the LLM engine's routes (OpenAI API, generate_stream) on a real ``kiln serve``
with a tiny random Llama, driven by the real ``openai`` client: Triton-format stamps with
the first token's, and OpenTelemetry spans with vLLM's ``gen_ai.*`` attributes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_api import CONFIG  # noqa: E402
from tests.integration.test_tracing import _by_request, _flags, _traces  # noqa: E402
from tests.integration.test_tracing_otel import TRACE_ID, Receiver  # noqa: E402
from tests.llm_models import tiny_llm_repository  # noqa: E402


@pytest.fixture
def otlp() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)


def test_llm_requests_are_traced_with_their_first_token(
    make_server: type[KilnProcess], tmp_path: Path
) -> None:
    out = tmp_path / "t.json"
    repo = tiny_llm_repository(tmp_path / "llm", CONFIG)
    server = make_server(
        repo, args=_flags(f"triton,file={out}", "level=TIMESTAMPS", "rate=1")
    ).start(timeout=120)
    client = _client(server)
    done = client.completions.create(model="tiny", prompt="the quick brown", max_tokens=4, n=2)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert len(list(stream)) > 1
    r = requests.post(
        f"http://{server.http_url}/v2/models/tiny/generate_stream",
        json={"id": "gen-1", "text_input": "once upon", "max_tokens": 3}, timeout=60,
    )  # fmt: skip
    assert r.status_code == 200
    assert server.stop() == 0
    traces = _traces(out)
    completion = _by_request(traces, done.id)
    names = [n for n, _ in completion["stamps"]]
    assert names == ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
                     "COMPUTE_START", "FIRST_TOKEN", "COMPUTE_END", "INFER_RESPONSE_COMPLETE",
                     "REQUEST_END"]  # fmt: skip
    times = [ns for _, ns in completion["stamps"]]
    assert times == sorted(times)
    assert completion["model_name"] == "tiny"
    chats = [t for t in traces.values() if t.get("request_id", "").startswith("chatcmpl-")]
    assert len(chats) == 1 and "FIRST_TOKEN" in [n for n, _ in chats[0]["stamps"]]
    assert "FIRST_TOKEN" in [n for n, _ in _by_request(traces, "gen-1")["stamps"]]


def test_llm_spans_carry_vllm_s_gen_ai_attributes(
    make_server: type[KilnProcess], tmp_path: Path, otlp: Receiver
) -> None:
    repo = tiny_llm_repository(tmp_path / "llm", CONFIG)
    flags = _flags("mode=opentelemetry", "level=TIMESTAMPS", "rate=0",
                   f"opentelemetry,url=127.0.0.1:{otlp.port}",
                   "opentelemetry,bsp_schedule_delay=100")  # fmt: skip
    server = make_server(repo, args=flags).start(timeout=120)
    client = _client(server)
    client.completions.create(model="tiny", prompt="no context", max_tokens=2)  # not traced
    done = client.completions.create(
        model="tiny", prompt="the quick brown", max_tokens=4, n=2, temperature=0.5,
        extra_headers={"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01"},
    )  # fmt: skip
    spans = otlp.wait_for(2)
    [root] = [s for s in spans if s["name"] == "InferRequest"]
    assert root["trace_id"] == TRACE_ID and root["parent"] == "00f067aa0ba902b7"
    [model] = [s for s in spans if s["parent"] == root["span_id"]]
    attrs = model["attributes"]
    assert model["name"] == "tiny" and attrs["gen_ai.request.id"] == done.id
    assert done.usage is not None
    assert attrs["gen_ai.usage.prompt_tokens"] == done.usage.prompt_tokens
    assert attrs["gen_ai.usage.completion_tokens"] == done.usage.completion_tokens
    assert attrs["gen_ai.request.n"] == 2 and attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.request.temperature"] == 0.5
    queue = attrs["gen_ai.latency.time_in_queue"]
    assert 0 <= queue <= attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]
    assert "FIRST_TOKEN" in model["events"]
    assert server.stop() == 0
    assert len([s for s in otlp.spans if s["name"] == "tiny"]) == 1  # rate 0: one
