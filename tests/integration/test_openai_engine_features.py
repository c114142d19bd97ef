"""``n`` choices, request priorities, prefix-cache counters and latency histograms of a
``kiln serve`` process (``scheduling_policy: priority``), driven by the real ``openai``
client."""

from __future__ import annotations

import re
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
parameters { key: "num_gpu_blocks" value { string_value: "96" } }
parameters { key: "scheduling_policy" value { string_value: "priority" } }
parameters { key: "enable_prefix_caching" value { string_value: "true" } }
"""
LONG = "kiln serves models with continuous batching and a paged kv cache. " * 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _scrape(server: KilnProcess) -> dict[str, float]:
    """``name{labels}`` -> value, for the tiny model's vllm:* samples."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith("vllm:") and 'model_name="tiny"' in line:
            key, value = line.rsplit(" ", 1)
            key = re.sub(r'(model_name="tiny"|engine="0"),?', "", key).replace(",}", "}")
            out[key.replace("{}", "")] = float(value)
    return out


def test_n_greedy_completions(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=6, temperature=0)
    one = client.completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    three = client.completions.create(n=3, extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.text for c in three.choices} == {one.choices[0].text}
    assert all(c.finish_reason == "length" for c in three.choices)
    assert three.usage is not None and three.usage.completion_tokens == 18
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]
    assert three.usage.total_tokens == three.usage.prompt_tokens + 18


def test_n_stop_string_ends_each_choice(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="hello world", max_tokens=12, temperature=0)
    whole = client.completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), f"no usable stop string in {text!r}"
    got = client.completions.create(n=2, stop=[stop], extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    want = text[: text.find(stop)]
    assert [(c.index, c.text, c.finish_reason) for c in got.choices] == [
        (0, want, "stop"),
        (1, want, "stop"),
    ]


def test_n_seeded_chat_stream_matches_the_whole_reply(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        temperature=1.0,
        seed=5,
        n=2,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    assert [c.index for c in whole.choices] == [0, 1]
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)  # type: ignore[call-overload]
    )
    texts = ["", ""]
    roles, reasons = set(), {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0, 1} and reasons == {0: "length", 1: "length"}
    assert texts == [c.message.content for c in whole.choices]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert usage.completion_tokens == 16 == whole.usage.completion_tokens  # type: ignore[union-attr]


def test_priority_is_accepted_under_the_priority_policy(client: openai.OpenAI) -> None:
    for priority in (-3, 0, 7):
        reply = client.completions.create(
            model="tiny", prompt="kiln", max_tokens=2, extra_body={"priority": priority}
        )
        assert reply.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"n": 0}, "n", "n must be at least 1, got 0"),
        ({"n": 9}, "n", "n must be between 1 and max_num_seqs (8), got 9"),
        ({"priority": "high"}, "priority", "'priority' must be an integer"),
    ],
)
def test_bad_n_and_priority_are_400(
    client: openai.OpenAI, extra: dict[str, object], param: str, message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert message in body["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices


def test_metrics_count_prefix_hits_and_latencies(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    before = _scrape(server)
    for suffix in (" one", " two"):
        client.completions.create(
            model="tiny", prompt=LONG + suffix, max_tokens=3, extra_body={"ignore_eos": True}
        )
    after = _scrape(server)
    grew = lambda name: after[name] - before.get(name, 0.0)  # noqa: E731
    assert grew("vllm:prefix_cache_queries_total") > 0
    hits = grew("vllm:prefix_cache_hits_total")
    assert hits > 0 and hits % 4 == 0  # whole blocks of the shared prefix
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
    ):
        assert grew(name + "_count") == 2
        assert grew(f'{name}_bucket{{le="+Inf"}}') == 2
        assert after[name + "_sum"] > 0
    assert grew("vllm:inter_token_latency_seconds_count") == 4  # 2 gaps per request
    assert 'vllm:time_to_first_token_seconds_bucket{le="0.001"}' in after
    assert 'vllm:e2e_request_latency_seconds_bucket{le="7680.0"}' in after


def _triton_stats(server: KilnProcess) -> dict[str, int]:
    import json

    url = f"http://{server.http_url}/v2/models/tiny/stats"
    doc = json.loads(urllib.request.urlopen(url).read())["model_stats"][0]
    inf = doc["inference_stats"]
    return {"success": inf["success"]["count"], "fail": inf["fail"]["count"],
            "inferences": doc["inference_count"]}  # fmt: skip


def test_openai_requests_count_in_triton_statistics(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    """Requests through /v1 count in the model's statistics endpoint (and so in the
    dashboard's Models table and nv_inference_*), like requests through /v2 do."""
    import requests

    before = _triton_stats(server)
    client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
    )
    assert list(chunks)
    after = _triton_stats(server)
    assert after["success"] - before["success"] == 2
    assert after["inferences"] - before["inferences"] == 2
    # a client that leaves mid-stream is a failure (CANCELED), not a success
    url = f"http://{server.http_url}/v1/completions"
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 200, "ignore_eos": True,
            "stream": True}  # fmt: skip
    with requests.post(url, json=body, stream=True, timeout=30) as resp:
        next(resp.iter_lines())
    for _ in range(200):  # the server notices the disconnect at its next write
        if _triton_stats(server)["fail"] > after["fail"]:
            break
        time.sleep(0.05)
    final = _triton_stats(server)
    assert final["fail"] - after["fail"] == 1
    assert final["success"] == after["success"]


def test_logit_bias_forces_a_token_in_completions_and_chat(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="the quick brown fox", max_tokens=5, temperature=0,
              logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    plain = client.completions.create(**kw)  # type: ignore[call-overload]
    lp = plain.choices[0].logprobs
    assert lp is not None and lp.tokens
    # +100 on one token: every step picks it
    forced = client.completions.create(logit_bias={"42": 100}, **kw)  # type: ignore[call-overload]
    forced_tokens = forced.choices[0].logprobs.tokens  # type: ignore[union-attr]
    assert len(forced_tokens) == 5 and len(set(forced_tokens)) == 1
    assert forced.choices[0].text != plain.choices[0].text
    # the chat endpoint takes it too
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        temperature=0, logit_bias={"42": 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    reply = chat.choices[0].message.content or ""
    assert reply and reply * 5 == forced.choices[0].text * 4  # the same piece, 4 times


def test_logit_bias_outside_the_vocabulary_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, logit_bias={"99999999": 5}
        )
    assert "logit_bias names token id 99999999, outside the vocabulary" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            logit_bias={"5": 1000},
        )  # fmt: skip
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "logit_bias"
    assert "logit_bias[5] must be in [-100, 100], got 1000" in body["message"]


def test_a_cache_salt_shares_the_prefix_cache_only_with_the_same_salt(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    """vLLM's ``cache_salt`` (completions and chat): a prompt cached under one salt is a hit
    for the same salt only; another salt, or none, computes it again."""
    prompt = "salted: " + LONG

    def hits_of(**extra: object) -> float:
        before = _scrape(server).get("vllm:prefix_cache_hits_total", 0.0)
        client.completions.create(  # type: ignore[call-overload]
            model="tiny", prompt=prompt, max_tokens=1, extra_body={"ignore_eos": True, **extra}
        )
        return _scrape(server)["vllm:prefix_cache_hits_total"] - before

    assert hits_of(cache_salt="tenant-a") == 0  # first time under this salt
    assert hits_of(cache_salt="tenant-a") > 0  # the same salt: the prompt is cached
    assert hits_of(cache_salt="tenant-b") == 0  # another salt sees none of it
    assert hits_of() == 0  # nor does a request without one
    assert hits_of() > 0  # ... which caches for the unsalted
    before = _scrape(server)["vllm:prefix_cache_hits_total"]
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny", messages=messages, max_tokens=1, extra_body={"cache_salt": "chat-a"}
        )
    assert _scrape(server)["vllm:prefix_cache_hits_total"] > before
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(  # type: ignore[call-overload]
            model="tiny", prompt="x", max_tokens=1, extra_body={"cache_salt": ""}
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "cache_salt"
    assert "'cache_salt' must be a non-empty string" in body["message"]


def test_echo_with_logprobs_scores_the_prompt_tokens_too(client: openai.OpenAI) -> None:
    """How evaluation harnesses score a text: ``echo`` and ``logprobs`` give each prompt
    token's logprob (the first has none), then the generated ones."""
    prompt = "the quick brown fox jumps"
    plain = client.completions.create(  # type: ignore[call-overload]
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    echoed = client.completions.create(  # type: ignore[call-overload]
        model="tiny", prompt=prompt, max_tokens=2, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice = echoed.choices[0]
    assert choice.text == prompt + plain.choices[0].text
    lp = choice.logprobs
    assert lp is not None and echoed.usage is not None
    n_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset[0] == 0 and "".join(lp.tokens[:n_prompt]).strip() == prompt
    # the generated part is what the request without echo reported
    assert plain.choices[0].logprobs is not None
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.choices[0].logprobs.token_logprobs)


def test_a_streamed_echo_starts_each_choice_with_the_prompt(client: openai.OpenAI) -> None:
    """As vLLM streams ``echo``: each choice's first chunk carries the prompt, and with
    logprobs the prompt tokens' logprobs from text offset 0; put together, the stream
    says what the whole answer says."""
    prompt = "the quick brown fox jumps"
    kw = dict(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, n=2,
              extra_body={"ignore_eos": True})  # fmt: skip
    whole = client.completions.create(logprobs=2, **kw)  # type: ignore[call-overload]
    chunks = list(client.completions.create(stream=True, logprobs=2, **kw))  # type: ignore[call-overload]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].text.startswith(prompt)
        assert sum(c.text.startswith(prompt) for c in mine) == 1  # once per choice
        assert "".join(c.text for c in mine) == whole.choices[index].text
        expected = whole.choices[index].logprobs
        assert expected is not None
        tokens: list[str] = []
        values: list[float | None] = []
        offsets: list[int] = []
        for c in mine:
            assert c.logprobs is not None
            tokens += c.logprobs.tokens or []
            values += c.logprobs.token_logprobs or []
            offsets += c.logprobs.text_offset or []
        assert tokens == expected.tokens and offsets == expected.text_offset
        assert values[0] is None and values[1:] == pytest.approx(expected.token_logprobs[1:])
    # without logprobs, and with a prompt of token ids (echoed as its text)
    plain = list(client.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    first = [c.choices[0] for c in plain if c.choices and c.choices[0].index == 0]
    assert "".join(c.text for c in first) == whole.choices[0].text
    assert all(c.logprobs is None for c in first)
    ids = [5, 17, 42, 7]
    by_ids = dict(kw, prompt=ids, n=1)
    whole_ids = client.completions.create(**by_ids)  # type: ignore[call-overload]
    streamed = list(client.completions.create(stream=True, **by_ids))  # type: ignore[call-overload]
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == whole_ids.choices[0].text
    plain_ids = client.completions.create(**dict(by_ids, echo=False))  # type: ignore[call-overload]
    echoed_prompt = text[: len(text) - len(plain_ids.choices[0].text)]
    assert echoed_prompt and text.endswith(plain_ids.choices[0].text)


def test_vllm_prompt_logprobs_field(client: openai.OpenAI) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token, null for the first, else its logprob,
    rank and text with the top alternatives, by token id; the same numbers echo gives."""
    prompt = "kiln serves models"
    reply = client.completions.create(  # type: ignore[call-overload]
        model="tiny", prompt=prompt, max_tokens=1, temperature=0,
        extra_body={"prompt_logprobs": 2, "ignore_eos": True},
    )  # fmt: skip
    assert reply.usage is not None
    field = (reply.choices[0].model_extra or {})["prompt_logprobs"]
    assert len(field) == reply.usage.prompt_tokens and field[0] is None
    echoed = client.completions.create(  # type: ignore[call-overload]
        model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=2, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    echo_lp = echoed.choices[0].logprobs
    assert echo_lp is not None
    for position, item in enumerate(field[1:], start=1):
        ranks = sorted(entry["rank"] for entry in item.values())
        assert 2 <= len(item) <= 3 and ranks[:2] == [1, 2]  # the top two, and the token
        token = next(  # the prompt's own token: its logprob is the one echo reports
            entry for entry in item.values()
            if entry["logprob"] == pytest.approx(echo_lp.token_logprobs[position])
        )  # fmt: skip
        assert token["rank"] >= 1 and isinstance(token["decoded_token"], str)
    chat = client.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    chat_field = (chat.model_extra or {})["prompt_logprobs"]
    assert chat.usage is not None and len(chat_field) == chat.usage.prompt_tokens
    assert chat_field[0] is None and all(len(item) == 1 for item in chat_field[1:])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"prompt_logprobs": 21}, "prompt logprobs of 21, which is greater than max allowed: 20"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be >= 0, got -1"),
        ({"prompt_logprobs": 1, "stream": True}, "not with stream"),
    ],
)
def test_bad_prompt_logprobs_are_400(
    client: openai.OpenAI, extra: dict[str, object], message: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", max_tokens=1, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "prompt_logprobs"
    assert message in body["message"]


@pytest.mark.parametrize("key", ["max_tokens", "max_completion_tokens"])
def test_a_chats_bad_token_limit_names_the_field_sent(client: openai.OpenAI, key: str) -> None:
    """Chat reads ``max_completion_tokens``, else the older ``max_tokens``: a bad value is
    refused naming the one the client sent."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body={key: 0}
        )
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == key
    assert body["message"] == f"{key} must be at least 1, got 0"
