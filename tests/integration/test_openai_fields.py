"""vLLM's other endpoints (``/tokenize``, ``/detokenize``, ``/health``, ``/version``) and
request fields on a ``kiln serve`` process, driven by the real ``openai`` client (raw
``httpx`` where the SDK has no method): lists of prompts, ``min_tokens``, ``bad_words``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``truncate_prompt_tokens``, the chat
template's options and chat ``echo``; fields kiln does not implement answer 400, unknown
ones are logged once."""

from __future__ import annotations

import itertools
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

import kiln  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import CHAT_TEMPLATE, llm_config, tiny_llm_repository  # noqa: E402

CONFIG = llm_config(block_size="4", max_num_seqs="8", num_gpu_blocks="128", dtype="float32")
#: the test model's template, plus a variable that only chat_template_kwargs can set
TEMPLATE = CHAT_TEMPLATE + "{% if enable_thinking %}<think>{% endif %}"
GREEDY: dict[str, Any] = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    config_path = repo / "tiny" / "1" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


def _tokens(http: httpx.Client, **body: Any) -> list[int]:
    reply = http.post("/tokenize", json={"model": "tiny", **body})
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    return tokens


def _error(reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error: dict[str, Any] = reply.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


# --- endpoints -------------------------------------------------------------------------


def test_tokenize_and_detokenize(http: httpx.Client) -> None:
    reply = http.post("/tokenize", json={"model": "tiny", "prompt": "hello world"}).json()
    assert reply["count"] == len(reply["tokens"]) > 0
    assert reply["max_model_len"] == 256 and reply["token_strs"] is None
    # model may be left out while one model serves; token_strs are the vocabulary's pieces
    alone = http.post("/tokenize", json={"prompt": "hello world", "return_token_strs": True})
    assert alone.json()["tokens"] == reply["tokens"]
    assert "".join(alone.json()["token_strs"]).replace("\u0120", " ") == "hello world"
    back = http.post("/detokenize", json={"model": "tiny", "tokens": reply["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": "hello world"}
    # chat messages are rendered as the chat endpoint renders them; special tokens decode
    chat = _tokens(http, messages=[{"role": "user", "content": "hi"}])
    assert chat == _tokens(http, prompt="<|user|>hi</s><|assistant|>")
    text = http.post("/detokenize", json={"tokens": chat}).json()["prompt"]
    assert text == "<|user|>hi</s><|assistant|>"


def test_tokenize_and_detokenize_bad_input(http: httpx.Client) -> None:
    assert _error(http.post("/tokenize", json={"model": "tiny"}))["param"] == "prompt"
    assert _error(http.post("/tokenize", json={"prompt": 3}))["param"] == "prompt"
    bad = http.post("/detokenize", json={"tokens": [1, 300]})
    assert _error(bad)["param"] == "tokens"
    assert _error(http.post("/detokenize", json={"tokens": "1 2"}))["param"] == "tokens"
    missing = http.post("/tokenize", json={"model": "nope", "prompt": "x"})
    assert missing.status_code == 404


def test_health_version_and_models(http: httpx.Client, client: openai.OpenAI) -> None:
    health = http.get("/health")
    assert health.status_code == 200 and health.content == b""
    assert http.get("/version").json() == {"version": kiln.__version__}
    (model,) = client.models.list().data
    assert model.id == "tiny" and model.object == "model" and model.owned_by == "kiln"
    extra = model.model_extra or {}
    assert extra["max_model_len"] == 256
    assert extra["root"] == "tiny" and extra["parent"] is None
    assert extra["permission"][0]["object"] == "model_permission"


def test_load_counts_the_requests_in_flight(http: httpx.Client) -> None:
    """vLLM's ``GET /load``: the HTTP requests in flight, not the engine's: 0 when idle, 1
    while one request of eight prompts runs (two of them at once in this model's KV
    cache), streamed or not, 0 again after."""
    import threading

    assert http.get("/load").json() == {"server_load": 0}
    # eight prompts of 200 tokens: two fit this model's KV cache at once
    body = {"model": "tiny", "prompt": ["a long story"] * 8, "max_tokens": 200,
            "ignore_eos": True}  # fmt: skip
    for stream in (False, True):

        def send(stream: bool = stream) -> None:
            with http.stream("POST", "/v1/completions", json={**body, "stream": stream}) as r:
                for _ in r.iter_bytes():
                    pass

        worker = threading.Thread(target=send)
        worker.start()
        seen = []
        while worker.is_alive():
            seen.append(http.get("/load").json()["server_load"])
            time.sleep(0.01)
        worker.join()
        assert set(seen) <= {0, 1} and 1 in seen, seen
        assert http.get("/load").json() == {"server_load": 0}


# --- a list of prompts -------------------------------------------------------------------


def test_a_list_of_prompts_equals_separate_requests(client: openai.OpenAI) -> None:
    prompts: list[Any] = ["the quick brown fox", [5, 6, 7, 8, 9], "hello"]
    kw: dict[str, Any] = dict(
        model="tiny", max_tokens=6, temperature=0.9, seed=5, n=2, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    batch = client.completions.create(prompt=prompts, **kw)
    assert [c.index for c in batch.choices] == list(range(6))
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    for i, reply in enumerate(alone):
        for j in range(2):
            mine, theirs = batch.choices[i * 2 + j], reply.choices[j]
            assert mine.text == theirs.text
            assert mine.logprobs and theirs.logprobs
            assert mine.logprobs.tokens == theirs.logprobs.tokens  # token for token
    assert batch.usage and batch.usage.prompt_tokens == sum(
        r.usage.prompt_tokens for r in alone if r.usage
    )
    assert batch.usage.completion_tokens == 6 * 6
    # streamed, the chunks carry the same indices and add up to the same texts
    texts = [""] * 6
    reasons: list[str | None] = [None] * 6
    stream = client.completions.create(
        prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw
    )
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in batch.choices]
    assert reasons == ["length"] * 6
    assert usage and usage.completion_tokens == 36


def test_continuous_usage_stats_put_usage_on_every_chunk(client: openai.OpenAI) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: each chunk carries its choice's
    prompt and the tokens so far; the final usage chunk the whole request's."""
    prompts = ["one prompt", "a longer second prompt"]
    counts = [
        client.completions.create(model="tiny", prompt=p, max_tokens=1).usage for p in prompts
    ]
    stream = client.completions.create(
        model="tiny", prompt=prompts, n=2, max_tokens=5, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    seen: dict[int, list[int]] = {}
    final = None
    for chunk in stream:
        assert chunk.usage is not None, "a chunk without usage"
        if not chunk.choices:
            final = chunk.usage
            continue
        (choice,) = chunk.choices
        prompt = counts[choice.index // 2]
        assert prompt is not None and chunk.usage.prompt_tokens == prompt.prompt_tokens
        assert chunk.usage.total_tokens == prompt.prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(choice.index, []).append(chunk.usage.completion_tokens)
    assert sorted(seen) == [0, 1, 2, 3]
    for so_far in seen.values():
        assert so_far == sorted(so_far) and so_far[-1] == 5
    assert final is not None and final.completion_tokens == 4 * 5
    assert final.prompt_tokens == sum(c.prompt_tokens for c in counts if c)  # once a prompt


def test_stream_interval_sends_tokens_in_runs(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's ``stream_interval``: after the first token at once, a chunk carries at least
    that many new tokens (more when the reader fell behind the steps), the last one what is
    left; the text is the same as unstreamed."""
    whole = client.completions.create(model="tiny", prompt="one two", max_tokens=23, **GREEDY)
    stream = client.completions.create(
        model="tiny", prompt="one two", max_tokens=23, stream=True, temperature=0,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "stream_interval": 5},
    )  # fmt: skip
    counts, text = [], ""
    for chunk in stream:
        if chunk.choices:
            assert chunk.usage is not None
            counts.append(chunk.usage.completion_tokens)
            text += chunk.choices[0].text
    assert text == whole.choices[0].text
    assert counts[0] == 1 and counts[-1] == 23
    # every gap but the last (what was left at the finish)
    assert all(b - a >= 5 for a, b in itertools.pairwise(counts[:-1])), counts
    for bad in (0, -1, "5", True, 1.5):
        error = _error(http.post("/v1/completions", json={
            "model": "tiny", "prompt": "x", "stream": True, "stream_interval": bad}))  # fmt: skip
        assert error["param"] == "stream_interval", error


def test_stream_options_without_stream_are_400(http: httpx.Client) -> None:
    """vLLM's and OpenAI's rule; before, a request that did not stream ignored them."""
    for route, body in (
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        reply = http.post(
            route, json={"model": "tiny", **body, "stream_options": {"include_usage": True}}
        )
        err = _error(reply)
        assert err["param"] == "stream_options" and "stream=True" in err["message"]
        reply = http.post(route, json={"model": "tiny", **body, "stop": 5})
        assert _error(reply)["param"] == "stop"  # was a 500


def test_leaving_a_streamed_list_early_frees_every_prompt(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    stream = client.completions.create(
        model="tiny", prompt=["a long story", "another one", [5, 6, 7]], max_tokens=200,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _ in enumerate(stream):
        if i == 4:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and server.metric("vllm:num_requests_running", "tiny"):
        time.sleep(0.1)
    assert server.metric("vllm:num_requests_running", "tiny") == 0
    assert server.metric("vllm:kv_cache_usage_perc", "tiny") == 0.0


def test_a_bad_prompt_in_a_list_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=["ok", ""], max_tokens=2)
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == "prompt" and "prompt[1]" in body["message"]


# --- sampling and output fields ----------------------------------------------------------


def test_min_tokens_holds_off_eos(client: openai.OpenAI, http: httpx.Client) -> None:
    (eos,) = _tokens(http, prompt="</s>")
    kw: dict[str, Any] = dict(
        model="tiny", prompt="hello", max_tokens=10, temperature=0, logit_bias={str(eos): 100}
    )
    eager = client.completions.create(**kw)
    assert eager.usage and eager.usage.completion_tokens == 1
    assert eager.choices[0].finish_reason == "stop"
    held = client.completions.create(extra_body={"min_tokens": 4}, **kw)
    # four tokens that are not EOS, then the EOS the bias forces
    assert held.usage and held.usage.completion_tokens == 5
    assert held.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(extra_body={"min_tokens": 11}, **kw)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "min_tokens"


def test_bad_words_never_appear(client: openai.OpenAI, http: httpx.Client) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="hello", max_tokens=16, logprobs=0)
    free = client.completions.create(**kw, **GREEDY).choices[0]
    assert free.logprobs and free.logprobs.tokens

    def one_token(t: str) -> bool:  # banned wherever it is written, with a space or not
        word = t.strip()
        return (
            word.isprintable()
            and "\ufffd" not in word
            and len(_tokens(http, prompt=word)) == 1
            and len(_tokens(http, prompt=t)) == 1
        )

    word = next(t.strip() for t in free.logprobs.tokens if t.strip() and one_token(t))
    extra = {"ignore_eos": True, "bad_words": [word]}
    banned = client.completions.create(**kw, temperature=0, extra_body=extra).choices[0]
    assert banned.logprobs and banned.logprobs.tokens
    assert all(t.strip() != word for t in banned.logprobs.tokens)
    assert banned.text != free.text


def test_include_stop_str_in_output(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="the quick brown fox", max_tokens=16)
    text = client.completions.create(**kw, **GREEDY).choices[0].text
    stop = text[4:7]
    at = text.find(stop)
    cut = client.completions.create(stop=stop, **kw, **GREEDY).choices[0]
    assert cut.text == text[:at] and cut.finish_reason == "stop"
    assert getattr(cut, "stop_reason", None) == stop  # vLLM's: the stop string that ended it
    unstopped = client.completions.create(**kw, **GREEDY).choices[0]
    assert unstopped.model_extra is not None and unstopped.model_extra["stop_reason"] is None
    extra = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(stop=stop, **kw, temperature=0, extra_body=extra)
    assert kept.choices[0].text == text[: at + len(stop)]
    streamed = client.completions.create(stop=stop, stream=True, **kw, temperature=0,
                                         extra_body=extra)  # fmt: skip
    chunks = [c.choices[0] for c in streamed if c.choices]
    assert "".join(c.text for c in chunks) == text[: at + len(stop)]
    # on the last chunk only, with its finish_reason
    assert [getattr(c, "stop_reason", "absent") for c in chunks][-1] == stop
    assert all("stop_reason" not in (c.model_extra or {}) for c in chunks[:-1])
    chat_kw: dict[str, Any] = dict(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=16,
        temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    said = client.chat.completions.create(**chat_kw).choices[0].message.content or ""
    chat_stop = said[3:6]
    chat = client.chat.completions.create(stop=chat_stop, **chat_kw).choices[0]
    assert chat.finish_reason == "stop" and getattr(chat, "stop_reason", None) == chat_stop


def test_a_stop_tokens_text_is_kept_only_when_asked(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt="hello", max_tokens=16, logprobs=0)
    free = client.completions.create(**kw, **GREEDY).choices[0]
    assert free.logprobs and free.logprobs.tokens
    tokens = free.logprobs.tokens
    token = next(
        t
        for t in tokens[1:]
        if t.isprintable() and "\ufffd" not in t and len(_tokens(http, prompt=t)) == 1
    )
    (stop_id,) = _tokens(http, prompt=token)
    extra: dict[str, Any] = {"ignore_eos": True, "stop_token_ids": [stop_id]}
    cut = client.completions.create(**kw, temperature=0, extra_body=extra).choices[0]
    assert cut.finish_reason == "stop" and cut.logprobs
    assert getattr(cut, "stop_reason", None) == stop_id  # vLLM's: the stop token's id
    assert cut.logprobs.tokens == tokens[: tokens.index(token) + 1]  # it did stop there
    assert free.text.startswith(cut.text) and not cut.text.endswith(token)
    extra["include_stop_str_in_output"] = True
    kept = client.completions.create(**kw, temperature=0, extra_body=extra).choices[0]
    assert kept.text == cut.text + token


def test_skip_special_tokens(client: openai.OpenAI, http: httpx.Client) -> None:
    (user,) = _tokens(http, prompt="<|user|>")
    kw: dict[str, Any] = dict(
        model="tiny", prompt="hi", max_tokens=3, temperature=0, logit_bias={str(user): 100}
    )
    assert client.completions.create(**kw).choices[0].text == ""
    shown = client.completions.create(extra_body={"skip_special_tokens": False}, **kw)
    assert shown.choices[0].text == "<|user|>" * 3
    # accepted as vLLM accepts it (no effect with a tokenizer.json tokenizer), checked
    same = client.completions.create(extra_body={"spaces_between_special_tokens": False}, **kw)
    assert same.choices[0].text == ""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(extra_body={"spaces_between_special_tokens": "no"}, **kw)
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "spaces_between_special_tokens"


def test_truncate_prompt_tokens_keeps_the_end(client: openai.OpenAI, http: httpx.Client) -> None:
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = _tokens(http, prompt=prompt)
    kw: dict[str, Any] = dict(model="tiny", max_tokens=6, **GREEDY)
    kw["extra_body"] = {**kw["extra_body"], "truncate_prompt_tokens": 3}
    cut = client.completions.create(prompt=prompt, **kw)
    assert cut.usage and cut.usage.prompt_tokens == 3
    tail = client.completions.create(prompt=ids[-3:], max_tokens=6, model="tiny", **GREEDY)
    assert cut.choices[0].text == tail.choices[0].text
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            prompt=prompt, model="tiny", extra_body={"truncate_prompt_tokens": 0}
        )
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "truncate_prompt_tokens"


# --- the chat template's options and chat echo -------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "the quick"},
]
OPEN = "<|user|>hi</s><|assistant|>the quick"


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, http: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    plain = _tokens(http, messages=messages)
    thinking = _tokens(http, messages=messages, chat_template_kwargs={"enable_thinking": True})
    assert thinking == _tokens(http, prompt="<|user|>hi</s><|assistant|><think>") != plain
    reply = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=2,  # type: ignore[arg-type]
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )  # fmt: skip
    assert reply.usage and reply.usage.prompt_tokens == len(thinking)
    bad = {"model": "tiny", "messages": messages, "chat_template_kwargs": ["x"]}
    assert _error(http.post("/v1/chat/completions", json=bad))["param"] == "chat_template_kwargs"


def test_a_requests_chat_template_needs_the_servers_trust(http: httpx.Client) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "chat_template": "{{ messages[0]['content'] }}"}  # fmt: skip
    for path in ("/v1/chat/completions", "/tokenize"):
        error = _error(http.post(path, json=body))
        assert error["param"] == "chat_template"
        assert "--trust-request-chat-template" in error["message"]


def test_reasoning_effort_reaches_the_template(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's: ``reasoning_effort`` is a template variable, and turns a template's
    ``enable_thinking`` on (off for ``none``) unless chat_template_kwargs set it."""
    messages = [{"role": "user", "content": "hi"}]
    plain = _tokens(http, messages=messages)
    thinking = _tokens(http, prompt="<|user|>hi</s><|assistant|><think>")
    assert _tokens(http, messages=messages, reasoning_effort="high") == thinking
    assert _tokens(http, messages=messages, reasoning_effort="none") == plain
    off = {"enable_thinking": False}
    kept = _tokens(http, messages=messages, reasoning_effort="high", chat_template_kwargs=off)
    assert kept == plain
    reply = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=2,
        reasoning_effort="low",  # type: ignore[arg-type]
    )
    assert reply.usage and reply.usage.prompt_tokens == len(thinking)
    bad = {"model": "tiny", "messages": messages, "reasoning_effort": "extreme"}
    assert _error(http.post("/v1/chat/completions", json=bad))["param"] == "reasoning_effort"


def test_add_generation_prompt_and_continue_final_message(http: httpx.Client) -> None:
    no_prompt = _tokens(http, messages=CONVERSATION[:1], add_generation_prompt=False)
    assert no_prompt == _tokens(http, prompt="<|user|>hi</s>")
    both = dict(add_generation_prompt=False, continue_final_message=True)
    assert _tokens(http, messages=CONVERSATION, **both) == _tokens(http, prompt=OPEN)
    # asking to continue alone turns the generation prompt off; both true is refused
    assert _tokens(http, messages=CONVERSATION, continue_final_message=True) == _tokens(
        http, prompt=OPEN
    )
    body = {"model": "tiny", "messages": CONVERSATION, "continue_final_message": True,
            "add_generation_prompt": True}  # fmt: skip
    assert _error(http.post("/v1/chat/completions", json=body))["param"] == (
        "continue_final_message"
    )


def test_chat_echo_continues_the_final_message(client: openai.OpenAI) -> None:
    reference = client.completions.create(model="tiny", prompt=OPEN, max_tokens=6, **GREEDY)
    extra = {"ignore_eos": True, "continue_final_message": True, "add_generation_prompt": False}
    kw: dict[str, Any] = dict(model="tiny", messages=CONVERSATION, max_tokens=6, temperature=0)
    plain = client.chat.completions.create(extra_body=extra, **kw)
    assert plain.choices[0].message.content == reference.choices[0].text
    assert plain.choices[0].message.role == "assistant"
    echoed = client.chat.completions.create(extra_body={**extra, "echo": True}, **kw)
    assert echoed.choices[0].message.content == "the quick" + reference.choices[0].text
    chunks = list(client.chat.completions.create(stream=True, extra_body={**extra, "echo": True},
                                                 **kw))  # fmt: skip
    contents = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert contents[1] == "the quick"
    assert "".join(contents) == echoed.choices[0].message.content
    # echo with a generation prompt: the answer is a new assistant turn, after a user's
    fresh = client.chat.completions.create(
        model="tiny", messages=CONVERSATION[:1], max_tokens=3, temperature=0,
        extra_body={"echo": True},
    )  # fmt: skip
    alone = client.chat.completions.create(
        model="tiny", messages=CONVERSATION[:1], max_tokens=3, temperature=0
    )
    assert fresh.choices[0].message.content == alone.choices[0].message.content


def test_usage_counts_the_prompt_tokens_the_prefix_cache_held(client: openai.OpenAI) -> None:
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: none the first time a prompt
    is seen, its full blocks the next time (whole and streamed)."""
    prompt = "kiln serves models with a paged kv cache " * 3 + str(time.time_ns())
    kw: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    first = client.completions.create(**kw).usage
    again = client.completions.create(**kw).usage
    assert first and again and first.prompt_tokens_details and again.prompt_tokens_details
    assert first.prompt_tokens_details.cached_tokens == 0
    cached = again.prompt_tokens_details.cached_tokens
    assert cached and 0 < cached < again.prompt_tokens and cached % 4 == 0  # block_size 4
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    usage = [c.usage for c in stream if c.usage][-1]
    assert usage.prompt_tokens_details and usage.prompt_tokens_details.cached_tokens == cached


def test_sagemaker_routes_and_model_retrieve(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's ``/ping`` and ``/invocations`` (the body picks the API), and OpenAI's
    ``GET /v1/models/{model}``."""
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0}  # fmt: skip
    via = http.post("/invocations", json=chat).json()
    direct = http.post("/v1/chat/completions", json=chat).json()
    assert via["object"] == "chat.completion"
    assert via["choices"][0]["message"] == direct["choices"][0]["message"]
    completion = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}
    via = http.post("/invocations", json=completion).json()
    assert via["object"] == "text_completion"
    assert via["choices"][0]["text"] == client.completions.create(**completion).choices[0].text
    reply = http.post("/invocations", json={"model": "tiny", "prompt": 5})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    assert _error(http.post("/invocations", json={"model": "tiny"}))["message"]
    card = client.models.retrieve("tiny")
    assert card.id == "tiny" and card.owned_by == "kiln"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_allowed_token_ids_and_tokens_as_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    """vLLM's ``allowed_token_ids`` (only those are sampled) and
    ``return_tokens_as_token_ids`` (logprobs name tokens ``token_id:<id>``), completions and
    chat, whole and streamed."""
    allowed = _tokens(http, prompt="the lazy dog", add_special_tokens=False)
    extra = {"allowed_token_ids": allowed, "return_tokens_as_token_ids": True, "ignore_eos": True}
    kw: dict[str, Any] = {"model": "tiny", "max_tokens": 8, "temperature": 1.0, "seed": 3}

    def ids(names: list[str]) -> list[int]:
        assert all(n.startswith("token_id:") for n in names), names
        return [int(n.split(":", 1)[1]) for n in names]

    whole = client.completions.create(prompt="hello", logprobs=2, extra_body=extra, **kw)
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.top_logprobs
    got = ids(lp.tokens)
    assert len(got) == 8 and set(got) <= set(allowed)
    assert all(name in top for name, top in zip(lp.tokens, lp.top_logprobs, strict=True) if top)
    # the text is the tokens' text, and text_offset counts its characters
    assert (
        whole.choices[0].text
        == http.post("/detokenize", json={"model": "tiny", "tokens": got}).json()["prompt"]
    )
    streamed: list[str] = []
    for chunk in client.completions.create(
        prompt="hello", logprobs=2, stream=True, extra_body=extra, **kw
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.tokens or []
    assert streamed == lp.tokens  # same seed, same tokens
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=2,
        extra_body=extra, **kw,
    )  # fmt: skip
    content = chat.choices[0].logprobs and chat.choices[0].logprobs.content
    assert content and set(ids([c.token for c in content])) <= set(allowed)
    for c in content:
        ids([t.token for t in c.top_logprobs])
        assert c.bytes  # the token's own bytes
    # without the field: texts, as before
    plain = client.completions.create(prompt="hello", logprobs=1, **kw)
    assert plain.choices[0].logprobs and plain.choices[0].logprobs.tokens
    assert not any(t.startswith("token_id:") for t in plain.choices[0].logprobs.tokens)


# --- fields kiln does not implement, and unknown ones --------------------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    ("endpoint", "fields", "param"),
    [
        # tools alone ask for tool_choice auto, which needs --enable-auto-tool-choice
        ("chat", {"tools": [TOOL]}, "tool_choice"),
        ("chat", {"tool_choice": "auto"}, "tool_choice"),
        ("chat", {"functions": [TOOL["function"]]}, "functions"),
        ("completions", {"structural_tag": "{}"}, "structural_tag"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"best_of": 1, "n": 2}, "best_of"),
        ("completions", {"suffix": "the end"}, "suffix"),
        ("completions", {"logits_processors": ["x"]}, "logits_processors"),
        ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
        ("chat", {"allowed_token_ids": [10**9]}, "allowed_token_ids"),  # past the vocabulary
        ("completions", {"return_tokens_as_token_ids": "yes"}, "return_tokens_as_token_ids"),
        ("completions", {"echo": "yes"}, "echo"),
    ],
)
def test_unsupported_fields_are_400_naming_them(
    http: httpx.Client, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    if endpoint == "chat":
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
        reply = http.post("/v1/chat/completions", json={"max_tokens": 2, **body})
    else:
        reply = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi",
                                                   "max_tokens": 2, **fields})  # fmt: skip
    assert _error(reply)["param"] == param


def test_unsupported_fields_through_the_sdk(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            tools=[TOOL], max_tokens=2,  # type: ignore[list-item]
        )  # fmt: skip
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hi", best_of=2, max_tokens=2)
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "best_of"


def test_values_that_ask_for_nothing_are_accepted(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        tools=[], tool_choice="none", response_format={"type": "text"}, user="someone",
    )  # fmt: skip
    assert reply.choices
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=2, n=2, best_of=2)
    assert len(done.choices) == 2


def test_unknown_fields_are_ignored_with_one_warning(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    for _ in range(3):
        reply = client.completions.create(
            model="tiny", prompt="hi", max_tokens=2, extra_body={"frobnicate_level": 3}
        )
        assert reply.choices
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"frobnicate_level": 3},
    )  # fmt: skip
    lines = [line for line in server.log().splitlines() if "frobnicate_level" in line]
    assert len(lines) == 1 and "ignored" in lines[0]


# --- vLLM's batch chat completions -------------------------------------------------------


def test_batch_chat_answers_each_conversation_as_chat_does(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    conversations = [
        [{"role": "user", "content": "the quick brown fox"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"},
         {"role": "user", "content": "three"}],
    ]  # fmt: skip
    body = {"model": "tiny", "messages": conversations, "max_tokens": 6, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}  # fmt: skip
    got = http.post("/v1/chat/completions/batch", json=body)
    assert got.status_code == 200, got.text
    batch = got.json()
    assert batch["object"] == "chat.completion" and batch["id"].startswith("chatcmpl-")
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    prompt_tokens = 0
    for conversation, choice in zip(conversations, batch["choices"], strict=True):
        alone = client.chat.completions.create(
            model="tiny", messages=conversation, max_tokens=6, temperature=0,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=2,
        )  # fmt: skip
        assert choice["message"]["content"] == alone.choices[0].message.content
        assert choice["finish_reason"] == alone.choices[0].finish_reason
        assert alone.choices[0].logprobs is not None and alone.choices[0].logprobs.content
        assert [e["token"] for e in choice["logprobs"]["content"]] == [
            e.token for e in alone.choices[0].logprobs.content
        ]
        assert alone.usage is not None
        prompt_tokens += alone.usage.prompt_tokens
    assert batch["usage"]["prompt_tokens"] == prompt_tokens
    assert batch["usage"]["completion_tokens"] == 3 * 6


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"stream": True}, "stream"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"n": 2}, "n"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "not a conversation"}]}, "messages"),
        ({"messages": [[{"role": "user", "content": "hi"}], [{"role": "robot"}]]},
         "messages[1][0].role"),
        ({"messages": [[{"role": "user", "content": "hi"}]] * 1025}, "messages"),
    ],
)  # fmt: skip
def test_batch_chat_refuses_what_vllm_refuses(
    http: httpx.Client, change: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "messages": [[{"role": "user", "content": "hi"}]],
            "max_tokens": 2, **change}  # fmt: skip
    got = http.post("/v1/chat/completions/batch", json=body)
    assert got.status_code == 400, got.text
    assert got.json()["error"]["param"] == param


def test_logprob_token_ids_list_the_tokens_asked_for(client: openai.OpenAI) -> None:
    """vLLM's ``logprob_token_ids``: each output token's alternatives are the sampled
    token, then the ones asked for (in that order), with the logprobs the full
    distribution gives them."""
    kw: dict[str, Any] = dict(model="tiny", max_tokens=4, temperature=0)
    wanted = [5, 9, 299]
    full = client.completions.create(prompt="hi", logprobs=20, **kw).choices[0].logprobs
    picked = (
        client.completions.create(
            prompt="hi", logprobs=1, extra_body={"logprob_token_ids": wanted}, **kw
        )
        .choices[0]
        .logprobs
    )
    assert full is not None and picked is not None and picked.top_logprobs
    assert picked.tokens == full.tokens
    for step in picked.top_logprobs:
        assert len(step) in (3, 4)  # the sampled token and the three asked for
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": "hi"}], logprobs=True,
        extra_body={"logprob_token_ids": wanted, "return_tokens_as_token_ids": True}, **kw,
    ).choices[0].logprobs  # fmt: skip
    assert chat is not None and chat.content
    for entry in chat.content:
        sampled = int(entry.token.removeprefix("token_id:"))
        listed = [int(t.token.removeprefix("token_id:")) for t in entry.top_logprobs]
        assert listed == [sampled, *(t for t in wanted if t != sampled)]
        assert entry.top_logprobs[0].logprob == entry.logprob
    for body, says in (
        ({"logprob_token_ids": [1]}, "`logprobs` must be set to true"),
        ({"logprobs": True, "logprob_token_ids": [-1]}, "token ids"),
        ({"logprobs": True, "logprob_token_ids": list(range(129))}, "more than 128"),
        ({"logprobs": True, "logprob_token_ids": [10**9]}, "outside the vocabulary"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                messages=[{"role": "user", "content": "hi"}], extra_body=body, **kw
            )
        assert isinstance(info.value.body, dict) and says in info.value.body["message"]
        assert info.value.body["param"] == "logprob_token_ids"


# --- vLLM's generative scoring -------------------------------------------------------


def test_generative_scoring_reads_the_labels_next_token_probabilities(
    client: openai.OpenAI, http: httpx.Client
) -> None:
    """Each item's score is the first label's probability as the next token after the
    query and the item, softmaxed over the labels (or the model's own): the same numbers
    the completions API's logprobs give for those tokens."""
    labels = [5, 9, 17]
    body = {"model": "tiny", "query": "is it", "items": [" red", " blue"],
            "label_token_ids": labels}  # fmt: skip
    got = http.post("/generative_scoring", json=body)
    assert got.status_code == 200, got.text
    answer = got.json()
    assert answer["object"] == "list" and answer["id"].startswith("generative-scoring-")
    assert [d["index"] for d in answer["data"]] == [0, 1]
    raw = http.post("/generative_scoring", json={**body, "apply_softmax": False}).json()
    for i, item in enumerate(body["items"]):
        ids = _tokens(http, prompt="is it") + _tokens(http, prompt=item, add_special_tokens=False)
        one = client.completions.create(
            model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1,
            extra_body={"logprob_token_ids": labels, "return_tokens_as_token_ids": True},
        ).choices[0].logprobs  # fmt: skip
        assert one is not None and one.top_logprobs
        listed = {int(k.removeprefix("token_id:")): v for k, v in one.top_logprobs[0].items()}
        lps = [listed[t] for t in labels]
        assert raw["data"][i]["score"] == pytest.approx(math.exp(lps[0]), rel=1e-5)
        softmax = math.exp(lps[0]) / sum(math.exp(lp) for lp in lps)
        assert answer["data"][i]["score"] == pytest.approx(softmax, rel=1e-5)
    assert answer["usage"]["completion_tokens"] == 2
    # bad fields, and more items than the model queues at once
    for bad, param in (({"label_token_ids": []}, "label_token_ids"),
                       ({"label_token_ids": [10**6]}, "label_token_ids"),
                       ({"items": []}, "items"), ({"items": ["a", [1]]}, "items"),
                       ({"query": 3}, "query"),
                       ({"items": ["a"] * 2000}, "items")):  # fmt: skip
        refused = http.post("/generative_scoring", json={**body, **bad})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == param
