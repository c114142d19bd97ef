"""Triton's ``generate`` / ``generate_stream`` on an llm model, over plain HTTP (requests) with
Server-Sent Events parsed by hand, the way Triton's vLLM backend users call it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")

import orjson
import requests

from tests.conftest import KilnProcess
from tests.integration.test_openai_api import CONFIG, _metric
from tests.llm_models import tiny_llm_repository

PROMPT = "the quick brown fox"
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


class Http:
    """``requests`` with the server's base URL."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.session = requests.Session()

    def post(self, path: str, **kw: Any) -> requests.Response:
        return self.session.post(self.base + path, timeout=60, **kw)


@pytest.fixture
def http(server: KilnProcess) -> Iterator[Http]:
    client = Http(f"http://{server.http_url}")
    yield client
    client.session.close()


def _events(response: requests.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith(b"data: "):
            events.append(orjson.loads(line[len(b"data: ") :]))
    return events


def _completion(http: Http, **fields: Any) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, **GREEDY, **fields}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_generate_returns_prompt_and_completion(http: Http) -> None:
    want = _completion(http)["choices"][0]["text"]
    reply = http.post("/v2/models/tiny/generate", json={"text_input": PROMPT, "parameters": GREEDY})
    assert reply.status_code == 200, reply.text
    # Triton's vLLM backend: the prompt comes first unless exclude_input_in_output
    assert reply.json() == {
        "model_name": "tiny",
        "model_version": "1",
        "text_output": PROMPT + want,
    }
    versioned = http.post(
        "/v2/models/tiny/versions/1/generate",
        json={"text_input": PROMPT, "parameters": {**GREEDY, "exclude_input_in_output": True}},
    )
    assert versioned.json()["text_output"] == want


def test_top_level_fields_and_sampling_parameters(http: Http) -> None:
    want = _completion(http, max_tokens=5)["choices"][0]["text"]
    flat = {"text_input": PROMPT, **GREEDY, "max_tokens": 5, "exclude_input_in_output": True}
    assert http.post("/v2/models/tiny/generate", json=flat).json()["text_output"] == want
    packed = {
        "text_input": PROMPT,
        "exclude_input_in_output": True,
        "sampling_parameters": orjson.dumps({**GREEDY, "max_tokens": 5}).decode(),
    }
    assert http.post("/v2/models/tiny/generate", json=packed).json()["text_output"] == want


def test_generate_reports_counts_and_finish_reason(http: Http) -> None:
    usage = _completion(http)["usage"]
    flags = {
        "return_finish_reason": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    body = http.post(
        "/v2/models/tiny/generate", json={"text_input": PROMPT, "parameters": {**GREEDY, **flags}}
    ).json()
    assert body["finish_reason"] == "length"
    assert body["num_input_tokens"] == usage["prompt_tokens"]
    assert body["num_output_tokens"] == 8


def test_generate_stream_sends_the_text_in_chunks(http: Http) -> None:
    want = _completion(http)["choices"][0]["text"]
    params = {**GREEDY, "return_num_output_tokens": True, "return_finish_reason": True}
    with http.post(
        "/v2/models/tiny/generate_stream",
        json={"text_input": PROMPT, "parameters": params},
        stream=True,
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert len(events) > 1
    assert all(e["model_name"] == "tiny" and e["model_version"] == "1" for e in events)
    assert "".join(e["text_output"] for e in events) == want  # never the prompt
    assert sum(e["num_output_tokens"] for e in events) == 8
    assert [e.get("finish_reason") for e in events][-1] == "length"
    assert all("finish_reason" not in e for e in events[:-1])
    # "stream": false: one event with the whole output, as the vLLM backend answers
    with http.post(
        "/v2/models/tiny/generate_stream",
        json={"text_input": PROMPT, "parameters": {**GREEDY, "stream": False}},
        stream=True,
    ) as response:
        single = _events(response)
    assert [e["text_output"] for e in single] == [PROMPT + want]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"parameters": GREEDY}, ["text_input"]),
        ({"text_input": PROMPT, "parameters": {"temprature": 0}}, ["temprature"]),
        ({"text_input": PROMPT, "parameters": {"temperature": -1}}, ["temperature"]),
        ({"text_input": PROMPT, "presence_penalty": 2.5}, ["presence_penalty"]),
        ({"text_input": PROMPT, "parameters": {"min_p": 2}}, ["min_p"]),
        ({"text_input": PROMPT, "stop": 5}, ["stop"]),
        ({"text_input": PROMPT, "parameters": {"stream": "yes"}}, ["stream", "boolean"]),
        ({"text_input": PROMPT, "parameters": {"max_tokens": 1000}}, ["max_tokens"]),
        ({"text_input": PROMPT, "parameters": {"stream": True}}, ["generate_stream"]),
        ({"text_input": PROMPT, "sampling_parameters": "{oops"}, ["sampling_parameters"]),
        ({"text_input": "x " * 400}, ["maximum context length"]),
    ],
)
def test_bad_generate_requests_are_400(http: Http, body: dict[str, Any], words: list[str]) -> None:
    reply = http.post("/v2/models/tiny/generate", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert all(w in error for w in words), error
    # the same checks guard generate_stream, before any event
    streamed = http.post("/v2/models/tiny/generate_stream", json=body)
    if "generate_stream" not in words:
        assert streamed.status_code == 400 and streamed.json()["error"] == error
    # and the server keeps serving
    ok = http.post("/v2/models/tiny/generate", json={"text_input": "ok", "max_tokens": 1})
    assert ok.status_code == 200


def test_unknown_model_is_404(http: Http) -> None:
    for route in ("generate", "generate_stream"):
        reply = http.post(f"/v2/models/nope/{route}", json={"text_input": PROMPT})
        assert reply.status_code == 404
        assert "nope" in reply.json()["error"]
    missing = http.post("/v2/models/tiny/versions/7/generate", json={"text_input": PROMPT})
    assert missing.status_code == 404 and "version 7" in missing.json()["error"]


def test_disconnect_mid_stream_frees_the_sequence(server: KilnProcess, http: Http) -> None:
    body = {"text_input": "a long story", "parameters": {**GREEDY, "max_tokens": 240}}
    before = _metric(server, "vllm:generation_tokens_total")
    with http.post("/v2/models/tiny/generate_stream", json=body, stream=True) as response:
        received = 0
        for line in response.iter_lines():
            received += line.startswith(b"data: ")
            if received >= 3:
                break
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and _metric(server, "vllm:num_requests_running") > 0:
        time.sleep(0.1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:num_requests_waiting") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0
    # the request was aborted, not run to its 240 tokens
    assert _metric(server, "vllm:generation_tokens_total") - before < 240


def test_generate_takes_logit_bias_as_the_openai_api_does(http: Http) -> None:
    bias = {"logit_bias": {"42": 100}, "max_tokens": 4}
    want = _completion(http, **bias)["choices"][0]["text"]
    body = {"text_input": PROMPT, "parameters": {**GREEDY, **bias, "exclude_input_in_output": True}}
    assert http.post("/v2/models/tiny/generate", json=body).json()["text_output"] == want
    plain = _completion(http, max_tokens=4)["choices"][0]["text"]
    assert want != plain  # the bias changed the text
    bad = {"text_input": PROMPT, "parameters": {"logit_bias": {"42": 500}}}
    reply = http.post("/v2/models/tiny/generate", json=bad)
    assert (
        reply.status_code == 400
        and "logit_bias[42] must be in [-100, 100]" in reply.json()["error"]
    )
