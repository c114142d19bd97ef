"""vLLM's derender (its scale-out API) reads the text as the model's own chat and
completions routes read their answers: decoded after the prompt's last tokens (a
SentencePiece token keeps its leading space), and on a chat derender through the
request's tool-call parser and the model's reasoning parser, whole and streamed one chunk
per call. Tiny models (random weights) on a real server, through ``httpx``; the tool call
is forced by a regex, so chat and derender read the same token ids."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_tools import HERMES_CALL, TEMPLATE, TOOLS  # noqa: E402
from tests.llm_models import (  # noqa: E402
    build_metaspace_tokenizer,
    llm_config,
    tool_calling_repository,
)

MESSAGES = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """``tools`` (hermes, auto tool choice), ``thinker`` (the same, with the qwen3
    reasoning parser) and ``meta`` (no parser, a SentencePiece-style tokenizer)."""
    root = tmp_path_factory.mktemp("derender")
    repo = tool_calling_repository(root, TEMPLATE)
    shutil.copytree(repo / "tools" / "1", repo / "thinker" / "1")
    (repo / "thinker" / "config.pbtxt").write_text(
        llm_config("thinker", enable_auto_tool_choice="true", tool_call_parser="hermes",
                   reasoning_parser="qwen3", max_num_seqs="8", num_gpu_blocks="512",
                   chat_template=str(root / "template.jinja"))
    )  # fmt: skip
    shutil.copytree(repo / "plain" / "1", repo / "meta" / "1")
    build_metaspace_tokenizer(repo / "meta" / "1")
    (repo / "meta" / "config.pbtxt").write_text(
        llm_config("meta", max_num_seqs="8", num_gpu_blocks="512")
    )
    shutil.rmtree(repo / "xml-tools")
    proc = KilnProcess(repo, args=["--enable-scale-out"]).start(timeout=240)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(server: KilnProcess) -> Iterator[Any]:
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=120) as client:
        yield client


def _post(http: Any, path: str, body: dict[str, Any], status: int = 200) -> Any:
    reply = http.post(path, json=body)
    assert reply.status_code == status, reply.text
    return reply.json()


def _chunks(http: Any, request: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", "/inference/v1/generate", json=request) as reply:
        assert reply.status_code == 200
        return [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]


def _stream_derender(
    http: Any, path: str, chunks: list[dict[str, Any]], **extra: Any
) -> list[dict[str, Any]]:
    """Each chunk derendered in turn, with the state the previous call answered."""
    state, out = None, []
    for chunk in chunks:
        body = {"stream": True, "generate_chunk": chunk, "stream_state": state, **extra}
        answer = _post(http, path, body)
        state = answer["stream_state"]
        out.append(answer["chunk"])
    return out


def _tokens(http: Any, model: str, text: str) -> list[int]:
    body = {"model": model, "prompt": text, "add_special_tokens": False}
    ids: list[int] = _post(http, "/tokenize", body)["tokens"]
    return ids


def test_derender_decodes_after_the_prompt_as_completions_does(http: Any) -> None:
    """A SentencePiece token after the prompt keeps its leading space (vLLM's detokenizer
    starts from the prompt's last tokens): in completions' text and in the derendered
    text, whether the prompt ids come in the derender request, in generate's answer
    (``return_token_ids``) or, streamed, on the first chunk."""
    prompt = _tokens(http, "meta", "the quick")
    (brown,) = _tokens(http, "meta", "brown")  # "▁brown": the space is the token's
    sampling = {"temperature": 0, "max_tokens": 2, "logit_bias": {str(brown): 100}}
    completion = _post(http, "/v1/completions", {"model": "meta", "prompt": prompt, **sampling})
    text = completion["choices"][0]["text"]
    whole = _post(http, "/detokenize", {"model": "meta", "tokens": [*prompt, brown, brown]})
    alone = _post(http, "/detokenize", {"model": "meta", "tokens": prompt})
    assert text == whole["prompt"][len(alone["prompt"]) :] == " brown brown"
    request = {"model": "meta", "token_ids": prompt, "sampling_params": sampling}
    generated = _post(http, "/inference/v1/generate", request)
    assert generated["choices"][0]["token_ids"] == [brown, brown]
    path = "/v1/completions/derender"
    given = _post(
        http,
        path,
        {"model": "meta", "generate_responses": [generated], "prompt_token_ids": [prompt]},
    )
    assert given["choices"][0]["text"] == text
    carried = _post(http, "/inference/v1/generate", {**request, "return_token_ids": True})
    assert carried["prompt_token_ids"] == prompt
    derendered = _post(http, path, {"model": "meta", "generate_responses": [carried]})
    assert derendered["choices"][0]["text"] == text
    # vLLM's fallback without any prompt ids: the output decoded alone
    unseeded = _post(http, path, {"model": "meta", "generate_responses": [generated]})
    assert unseeded["choices"][0]["text"] == "brown brown"
    chunks = _chunks(http, {**request, "stream": True})
    streamed = _stream_derender(http, path, chunks, model="meta", prompt_token_ids=prompt)
    assert "".join(c["text"] for chunk in streamed for c in chunk["choices"]) == text
    streamed = _stream_derender(http, "/v1/chat/completions/derender", chunks,
                                model="meta", prompt_token_ids=prompt)  # fmt: skip
    content = "".join(c["delta"]["content"] or "" for ch in streamed for c in ch["choices"])
    assert content == text


def _tool_calls(deltas: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call index, from a stream's ``tool_calls`` deltas: the id
    and name come once, in a call's first delta."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if "id" in d:
            assert d["index"] not in calls, "a call began twice"
            calls[d["index"]] = [d["id"], d["function"]["name"], ""]
        calls[d["index"]][2] += d["function"].get("arguments") or ""
    return [(i, n, a) for i, n, a in (calls[k] for k in sorted(calls))]


def test_chat_derender_reads_tool_calls_as_chat_does(http: Any) -> None:
    """The hermes call chat reads in its answer, derender reads in the same tokens:
    whole (``tool_calls``, content, finish_reason ``tool_calls``) and streamed (each
    call's id once, the same arguments, finish_reason on the last chunk only)."""
    body = {"model": "tools", "messages": MESSAGES, "tools": TOOLS, "temperature": 0,
            "max_completion_tokens": 200,
            "structured_outputs": {"regex": HERMES_CALL}}  # fmt: skip
    chat = _post(http, "/v1/chat/completions", body)["choices"][0]
    assert chat["finish_reason"] == "tool_calls"
    rendered = _post(http, "/v1/chat/completions/render", body)
    generated = _post(http, "/inference/v1/generate", rendered)
    ids = rendered["token_ids"]
    path = "/v1/chat/completions/derender"
    whole = {"model": "tools", "generate_response": generated, "chat_request": body,
             "prompt_token_ids": ids}  # fmt: skip
    choice = _post(http, path, whole)["choices"][0]
    message, expected = choice["message"], chat["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == expected["content"] == "Sure."
    strip = [{**c, "id": None} for c in expected["tool_calls"]]
    assert [{**c, "id": None} for c in message["tool_calls"]] == strip
    assert message["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    # vLLM's rule: with a parser configured, no chat_request is a 400 (markup would leak)
    error = _post(http, path, {"model": "tools", "generate_response": generated}, 400)["error"]
    assert error["param"] == "chat_request"
    # streamed
    chunks = _chunks(http, _post(http, "/v1/chat/completions/render", {**body, "stream": True}))
    assert len(chunks) > 3
    out = _stream_derender(http, path, chunks, model="tools", chat_request=body,
                           prompt_token_ids=ids)  # fmt: skip
    choices = [c for chunk in out for c in chunk["choices"]]
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    calls = _tool_calls(deltas)
    assert [(n, a) for _, n, a in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in expected["tool_calls"]
    ]
    assert "".join(c["delta"]["content"] or "" for c in choices) == "Sure."
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert [c["delta"]["role"] for c in choices] == ["assistant"] + [None] * (len(choices) - 1)
    # chat's own stream: the same calls, its finish_reason on the last chunk only
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: {")]  # fmt: skip
    own = [c for e in events for c in e["choices"]]
    assert [c["finish_reason"] for c in own] == [None] * (len(own) - 1) + ["tool_calls"]
    own_calls = _tool_calls([d for c in own for d in c["delta"].get("tool_calls") or []])
    assert [(n, a) for _, n, a in own_calls] == [(n, a) for _, n, a in calls]
    no_ids = {"model": "tools", "stream": True, "generate_chunk": chunks[0], "chat_request": body}
    assert _post(http, path, no_ids, 400)["error"]["param"] == "prompt_token_ids"


def test_chat_derender_splits_the_reasoning_before_the_calls(http: Any) -> None:
    """The reasoning parser's part, then the tool call: whole and streamed in chunks of
    two tokens (the replay carries the thinking over every chunk boundary)."""
    answer = '<think>a lazy dog</think><tool_call>{"name": "ping", "arguments": {}}</tool_call>'
    output = _tokens(http, "thinker", answer)
    prompt = _tokens(http, "thinker", "the quick brown fox")
    body = {"model": "thinker", "messages": MESSAGES, "tools": TOOLS}
    generated = {"request_id": "r", "choices": [{"index": 0, "token_ids": output}]}
    path = "/v1/chat/completions/derender"
    whole = {"model": "thinker", "generate_response": generated, "chat_request": body,
             "prompt_token_ids": prompt}  # fmt: skip
    choice = _post(http, path, whole)["choices"][0]
    message = choice["message"]
    assert message["reasoning"] == message["reasoning_content"] == "a lazy dog"
    assert message["content"] is None and choice["finish_reason"] == "tool_calls"
    [call] = message["tool_calls"]
    assert call["function"] == {"name": "ping", "arguments": "{}"}
    hidden = {**whole, "chat_request": {**body, "include_reasoning": False}}
    assert "reasoning" not in _post(http, path, hidden)["choices"][0]["message"]
    pieces = [output[i : i + 2] for i in range(0, len(output), 2)]
    chunks = [{"request_id": "r", "choices": [{"index": 0, "token_ids": p,
               "finish_reason": None if i < len(pieces) - 1 else "stop"}]}
              for i, p in enumerate(pieces)]  # fmt: skip
    out = _stream_derender(http, path, chunks, model="thinker", chat_request=body,
                           prompt_token_ids=prompt)  # fmt: skip
    choices = [c for chunk in out for c in chunk["choices"]]
    assert "".join(c["delta"].get("reasoning") or "" for c in choices) == "a lazy dog"
    assert all(c["delta"]["content"] is None for c in choices)
    deltas = [d for c in choices for d in c["delta"].get("tool_calls") or []]
    [(call_id, name, arguments)] = _tool_calls(deltas)
    assert (name, arguments) == ("ping", "{}") and call_id.startswith("chatcmpl-tool-")
    assert choices[-1]["finish_reason"] == "tool_calls"
