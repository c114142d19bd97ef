"""vLLM's reasoning parsers on ``kiln serve`` (``reasoning_parser: qwen3`` and
``deepseek_r1``), driven by the real ``openai`` client: a chat answer's ``<think>`` part is
its ``reasoning`` (and ``reasoning_content``, the older name), the rest its ``content``,
whole and streamed alike; ``include_reasoning: false`` leaves it out; the Responses API
answers it as a ``reasoning`` item. The random weights write the thinking because a regex
forces them to; the same weights without a parser show the raw text it was split from."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, llm_config  # noqa: E402

#: the prompt holds the end-of-thinking marker, so (vLLM's rule) the model has done its
#: thinking and a constraint holds from the first token: the regexes below force the
#: random weights to write what a thinking model writes
MESSAGES = [{"role": "user", "content": "</think> the quick brown fox"}]
#: what a Qwen3 model writes when it thinks
THINKS = r"<think>[a-z]{2,6} [a-z]{2,6}</think>[a-z]{2,6} [a-z]{2,6}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    from tokenizers import Tokenizer

    repo = tmp_path_factory.mktemp("reasoning") / "repo"
    build_tiny_llm(repo / "plain" / "1")
    # as thinking models' tokenizers: <think> and </think> as tokens of their own
    shutil.copytree(repo / "plain" / "1", repo / "plain-tags" / "1")
    path = repo / "plain-tags" / "1" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens(["<think>", "</think>"])
    tok.save(str(path))
    # Magistral's markers, as tokens of their own
    shutil.copytree(repo / "plain" / "1", repo / "mistral-tags" / "1")
    path = repo / "mistral-tags" / "1" / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    tok.add_tokens(["[THINK]", "[/THINK]"])
    tok.save(str(path))
    common = dict(max_num_seqs="4", num_gpu_blocks="256", dtype="float32")
    for name, parser, base in (("qwen3", "qwen3", "plain"), ("r1", "deepseek_r1", "plain"),
                               ("r1-tags", "deepseek_r1", "plain-tags"),
                               ("magistral", "mistral", "mistral-tags")):  # fmt: skip
        shutil.copytree(repo / base / "1", repo / name / "1")
        (repo / name / "config.pbtxt").write_text(
            llm_config(name, reasoning_parser=parser, **common)
        )
    for name in ("plain", "plain-tags", "mistral-tags"):
        (repo / name / "config.pbtxt").write_text(llm_config(name, **common))
    proc = KilnProcess(repo).start(timeout=180)
    yield proc
    proc.stop()


def _chat(client: openai.OpenAI, model: str, regex: str, **kw: Any) -> Any:
    extra = {"structured_outputs": {"regex": regex}, **kw.pop("extra_body", {})}
    settings: dict[str, Any] = {"max_tokens": 60, "temperature": 1.0, "seed": 7, **kw}
    return client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        extra_body=extra,
        **settings,  # type: ignore[arg-type]
    )


def _streamed(client: openai.OpenAI, model: str, regex: str, **kw: Any) -> tuple[str, str]:
    reasoning, content = "", ""
    for chunk in _chat(client, model, regex, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            got = getattr(delta, "reasoning", None)
            assert got == getattr(delta, "reasoning_content", None)
            reasoning += got or ""
            content += delta.content or ""
    return reasoning, content


def test_qwen3_splits_the_thinking_from_the_answer(client: openai.OpenAI) -> None:
    raw = _chat(client, "plain", THINKS).choices[0].message.content
    assert raw.startswith("<think>") and "</think>" in raw
    thought, answer = raw[len("<think>") :].split("</think>")
    message = _chat(client, "qwen3", THINKS).choices[0].message
    assert (message.reasoning, message.content) == (thought, answer)  # type: ignore[attr-defined]
    assert message.reasoning_content == thought  # type: ignore[attr-defined]
    assert _streamed(client, "qwen3", THINKS) == (thought, answer)
    # include_reasoning: false: the answer alone
    quiet = _chat(client, "qwen3", THINKS, extra_body={"include_reasoning": False})
    assert quiet.choices[0].message.content == answer
    assert getattr(quiet.choices[0].message, "reasoning", None) is None
    assert _streamed(client, "qwen3", THINKS, extra_body={"include_reasoning": False}) == (
        "",
        answer,
    )


def test_mistral_splits_magistrals_think_markers(client: openai.OpenAI) -> None:
    """vLLM's ``mistral`` parser (Magistral): ``[THINK]`` ... ``[/THINK]``, whole and
    streamed; ``<think>`` is no marker of its."""
    thinks = r"\[THINK\][a-z]{2,6} [a-z]{2,6}\[/THINK\][a-z]{2,6} [a-z]{2,6}"
    # the prompt holds the end marker: the constraint holds from the first token (as above)
    messages = [{"role": "user", "content": "[/THINK] the quick brown fox"}]

    def chat(regex: str, **kw: Any) -> Any:
        return client.chat.completions.create(
            model="magistral", messages=messages, max_tokens=60, temperature=1.0,  # type: ignore[arg-type]
            seed=7, extra_body={"structured_outputs": {"regex": regex}}, **kw,
        )  # fmt: skip

    message = chat(thinks).choices[0].message
    thought, answer = message.reasoning, message.content  # type: ignore[attr-defined]
    assert thought and answer and "[" not in thought + answer
    streamed = ["", ""]
    for chunk in chat(thinks, stream=True):
        for choice in chunk.choices:
            streamed[0] += getattr(choice.delta, "reasoning", None) or ""
            streamed[1] += choice.delta.content or ""
    assert streamed == [thought, answer]
    other = chat(THINKS).choices[0].message
    assert other.content.startswith("<think>") and other.reasoning is None  # type: ignore[attr-defined]


def test_qwen3_without_thinking_is_all_content(client: openai.OpenAI) -> None:
    plain = r"[a-z]{2,6} [a-z]{2,6}"
    raw = _chat(client, "plain", plain).choices[0].message.content
    message = _chat(client, "qwen3", plain).choices[0].message
    assert message.content == raw and message.reasoning is None  # type: ignore[attr-defined]
    assert _streamed(client, "qwen3", plain) == ("", raw)


def test_deepseek_r1_thinks_from_the_start(client: openai.OpenAI) -> None:
    """The template opened the thinking: the answer is reasoning until ``</think>``, all of
    it when the answer is cut before that."""
    opened = r"[a-z]{2,6} [a-z]{2,6}</think>[a-z]{2,6}"
    raw = _chat(client, "plain", opened).choices[0].message.content
    thought, answer = raw.split("</think>")
    message = _chat(client, "r1", opened).choices[0].message
    assert (message.reasoning, message.content) == (thought, answer)  # type: ignore[attr-defined]
    assert _streamed(client, "r1", opened) == (thought, answer)
    cut = _chat(client, "r1", r"[a-z]{30,40}", max_tokens=3)
    assert cut.choices[0].finish_reason == "length"
    assert cut.choices[0].message.content is None and cut.choices[0].message.reasoning  # type: ignore[attr-defined]


def test_the_responses_api_answers_a_reasoning_item(client: openai.OpenAI) -> None:
    raw = _chat(client, "plain", THINKS).choices[0].message.content
    thought, answer = raw[len("<think>") :].split("</think>")
    kw: dict[str, Any] = dict(
        model="qwen3", input=MESSAGES[0]["content"], max_output_tokens=60, temperature=1.0,
        extra_body={"seed": 7, "structured_outputs": {"regex": THINKS}},
    )  # fmt: skip
    reply = client.responses.create(**kw)
    item, message = reply.output
    assert item.type == "reasoning" and item.id.startswith("rs_")
    assert item.content and item.content[0].text == thought
    assert message.type == "message" and reply.output_text == answer
    events = list(client.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == thought
    texts = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(texts) == answer
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == thought


def test_a_schema_holds_after_the_thinking(client: openai.OpenAI, server: KilnProcess) -> None:
    """vLLM's rule with a reasoning parser: the model thinks freely and the constraint
    holds from after ``</think>``. The random weights are pushed to close their thinking
    at once (a bias on the marker, which the schema alone would never allow)."""
    import httpx
    import jsonschema

    end = httpx.post(
        f"http://{server.http_url}/tokenize",
        json={"model": "r1-tags", "prompt": "</think>", "add_special_tokens": False},
    )
    (marker,) = end.json()["tokens"]
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}  # fmt: skip
    fresh = [{"role": "user", "content": "is it raining?"}]  # thinking still to do
    kw: dict[str, Any] = dict(
        messages=fresh, max_tokens=60, temperature=1.0, logit_bias={str(marker): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )  # fmt: skip
    for seed in (0, 1, 2):
        extra = {"structured_outputs": {"disable_any_whitespace": True}}
        message = client.chat.completions.create(model="r1-tags", seed=seed, extra_body=extra,
                                                 **kw).choices[0].message  # fmt: skip
        assert message.reasoning == ""  # type: ignore[attr-defined]
        jsonschema.validate(json.loads(message.content or ""), schema)
        # a model without a reasoning parser is constrained from its first token
        plain = client.chat.completions.create(model="plain-tags", seed=seed, extra_body=extra,
                                               **kw).choices[0].message  # fmt: skip
        jsonschema.validate(json.loads(plain.content or ""), schema)


def _token_ids(reply: Any) -> list[int]:
    """The answer's tokens (``return_tokens_as_token_ids`` names each ``token_id:N``)."""
    entries = reply.choices[0].logprobs.content
    return [int(e.token.removeprefix("token_id:")) for e in entries]


def test_thinking_token_budget_forces_the_end_of_the_reasoning(
    client: openai.OpenAI, server: KilnProcess
) -> None:
    """vLLM's ``thinking_token_budget``: the prompt opens the reasoning (a ``<think>`` with
    no ``</think>`` after it); after three tokens of it the end marker is forced, and the
    parser splits the answer there."""
    import httpx

    end = httpx.post(
        f"http://{server.http_url}/tokenize",
        json={"model": "r1-tags", "prompt": "</think>", "add_special_tokens": False},
        timeout=30,
    ).json()["tokens"]
    assert len(end) == 1
    kw: dict[str, Any] = dict(
        model="r1-tags", messages=[{"role": "user", "content": "<think> go"}], max_tokens=10,
        temperature=0, logprobs=True,
    )  # fmt: skip
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    free = _token_ids(client.chat.completions.create(**kw, extra_body=extra))
    capped_reply = client.chat.completions.create(
        **kw, extra_body={**extra, "thinking_token_budget": 3}
    )
    capped = _token_ids(capped_reply)
    assert capped[:3] == free[:3] and capped[3] == end[0] and len(capped) == 10
    assert end[0] not in free[:4]  # the weights alone would not have closed it there
    message = capped_reply.choices[0].message
    assert getattr(message, "reasoning", None) and message.content  # split at the marker
    # a model without a reasoning parser has no markers to count between: 400, named
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**{**kw, "model": "plain"},
                                       extra_body={"thinking_token_budget": 3})  # fmt: skip
    assert isinstance(info.value.body, dict)
    assert info.value.body["param"] == "thinking_token_budget"
    assert "--reasoning-parser" in info.value.body["message"]
