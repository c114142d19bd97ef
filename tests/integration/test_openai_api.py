"""The OpenAI-compatible API of a ``kiln serve`` process, driven by the real ``openai``
client, over a tiny random Llama built at test time."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import tiny_llm_repository  # noqa: E402

CONFIG = """
name: "tiny"
backend: "llm"
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "max_num_seqs" value { string_value: "8" } }
parameters { key: "max_num_batched_tokens" value { string_value: "256" } }
parameters { key: "num_gpu_blocks" value { string_value: "64" } }
parameters { key: "dtype" value { string_value: "float32" } }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _metric(server: KilnProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith(name + "{") and 'model_name="tiny"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def test_models_lists_the_llm(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert ids == ["tiny"]


def test_completion_greedy_is_deterministic(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=8, temperature=0)
    first = client.completions.create(**kw)  # type: ignore[call-overload]
    second = client.completions.create(**kw)  # type: ignore[call-overload]
    assert first.object == "text_completion"
    assert first.choices[0].text == second.choices[0].text
    assert first.choices[0].finish_reason in ("length", "stop")
    usage = first.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert 1 <= usage.completion_tokens <= 8
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        prompt="hello world",
        max_tokens=10,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw)  # type: ignore[call-overload]
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)  # type: ignore[call-overload]
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length"


def test_chat_completion_and_stream(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    kw = dict(model="tiny", messages=messages, max_tokens=6, temperature=0, seed=3)
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert whole.object == "chat.completion"
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_seeded_sampling_repeats(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="kiln serves", max_tokens=8, temperature=0.8, top_p=0.9, seed=11)
    a = client.completions.create(**kw)  # type: ignore[call-overload]
    b = client.completions.create(**kw)  # type: ignore[call-overload]
    assert a.choices[0].text == b.choices[0].text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": "x " * 400, "max_tokens": 4}, "prompt"),
        ({"prompt": "hello", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hello", "max_tokens": 300}, "max_tokens"),
        ({"prompt": "hello", "temperature": -0.5}, "temperature"),
        ({"prompt": "hello", "top_p": 0}, "top_p"),
        ({"prompt": "hello", "top_p": 1.5}, "top_p"),
    ],
)
def test_bad_completion_requests_are_400(
    client: openai.OpenAI, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", **kwargs)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["param"] == param
    assert body["message"]
    # the server keeps serving
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices


def test_priority_under_fcfs_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"priority": 1}
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "priority"
    assert "priority 1 was given but priority scheduling is not enabled" in body["message"]
    assert "scheduling_policy" in body["message"]
    # priority 0 is the default and always accepted
    reply = client.completions.create(
        model="tiny", prompt="hi", max_tokens=1, extra_body={"priority": 0}
    )
    assert reply.choices


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["code"] == "model_not_found"
    assert "'nope'" in body["message"]


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 42}], ["hello"]],
)
def test_malformed_messages_are_400(client: openai.OpenAI, messages: list[object]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)  # type: ignore[arg-type]
    body = info.value.body
    assert isinstance(body, dict) and str(body["param"]).startswith("messages")


def test_disconnect_mid_stream_frees_the_sequence(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt="a long story",
        max_tokens=200,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].text)
        if received >= 3:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if _metric(server, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:num_requests_waiting") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0
    # far fewer than the 200 tokens asked for were generated by the aborted request
    assert _metric(server, "vllm:generation_tokens_total") < 1000
