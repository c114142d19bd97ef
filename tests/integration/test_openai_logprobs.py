"""Logprobs and penalties through the real ``openai`` client (its typed objects must parse),
checked against a ``transformers`` forward pass over the same tiny random Llama."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_api import CONFIG  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

PROMPT = [5, 17, 42, 99, 3]
SPECIAL = {"<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llm") / "repo" / "tiny" / "1")


@pytest.fixture(scope="module")
def client(folder: Path) -> Iterator[openai.OpenAI]:
    repo = folder.parent.parent
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="unused", max_retries=0)
    proc.stop()


def _reference_logprobs(folder: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]


def test_completion_logprobs_match_transformers(client: openai.OpenAI, folder: Path) -> None:
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    reply = client.completions.create(extra_body={"ignore_eos": True}, **kw)  # type: ignore[call-overload]
    lp = reply.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    want = reference_generate(folder, PROMPT, 6)
    ref = _reference_logprobs(folder, PROMPT, want)
    chosen = [float(ref[i, t]) for i, t in enumerate(want)]
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs):
        # greedy picks the most likely token, which leads its top-3
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(lp.token_logprobs[i], abs=1e-6)
        # (fewer than 3 when two tokens share a text: a dict keeps one)
        best = ref[i].topk(3).values.tolist()
        assert all(any(abs(v - r) < 1e-4 for r in best) for v in top.values())
    assert lp.text_offset[0] == 0
    steps = [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:], strict=False)]
    assert steps == [len(t) for t in lp.tokens[:-1]]

    # the streamed chunks carry the same entries, with offsets continuing across chunks
    chunks = list(client.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw))  # type: ignore[call-overload]
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens or []] == lp.tokens
    # (approximately: the second request reuses the first one's cached prefix KV, so its
    # logits come from a different, numerically equivalent, computation)
    streamed_lp = [v for s in streamed for v in s.token_logprobs or []]
    assert streamed_lp == pytest.approx(lp.token_logprobs, abs=1e-5)
    assert [o for s in streamed for o in s.text_offset or []] == lp.text_offset


def test_chat_logprobs_and_bytes(client: openai.OpenAI, folder: Path) -> None:
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    reply = client.chat.completions.create(**kw)  # type: ignore[call-overload]
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == reply.usage.completion_tokens == 8  # type: ignore[union-attr]
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes is not None
    # the tokens' exact bytes rebuild the text, even where a token splits a character
    text = b"".join(bytes(e.bytes or []) for e in content if e.token not in SPECIAL)
    assert text.decode("utf-8", errors="replace") == reply.choices[0].message.content

    chunks = list(client.chat.completions.create(stream=True, **kw))  # type: ignore[call-overload]
    streamed = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    # approximately: this request reuses the first one's cached prefix KV
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)


def test_no_logprobs_unless_asked(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert reply.choices[0].logprobs is None


def test_repetition_penalty_matches_transformers(client: openai.OpenAI, folder: Path) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.8,
            eos_token_id=None,
            pad_token_id=0,
        )
    want = [int(t) for t in out[0, len(PROMPT) :]]
    reply = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        logprobs=0,
        extra_body={"repetition_penalty": 1.8, "ignore_eos": True},
    )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    lp = reply.choices[0].logprobs
    assert lp is not None
    assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in want]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"min_p": "lots"}}, "min_p"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_bad_sampling_fields_are_400(
    client: openai.OpenAI, fields: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=2, **fields)  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param
    assert param in body["message"]
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
def test_bad_chat_logprobs_are_400(
    client: openai.OpenAI, fields: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields
        )  # type: ignore[call-overload]
    body = info.value.body
    assert isinstance(body, dict) and body["param"] == param


def test_echoed_prompt_shifts_the_text_offsets(client: openai.OpenAI) -> None:
    prompt = "the quick brown fox"
    reply = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=1
    )
    choice = reply.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    assert lp is not None and lp.text_offset is not None and lp.tokens is not None
    # the prompt's tokens come first (as OpenAI and vLLM answer), from offset 0; the
    # completion's offsets go on from the end of the prompt's text
    usage = reply.usage
    assert usage is not None
    assert len(lp.tokens) == usage.prompt_tokens + usage.completion_tokens
    assert lp.text_offset[0] == 0
    prompt_text = "".join(lp.tokens[: usage.prompt_tokens])
    assert lp.text_offset[usage.prompt_tokens] == len(prompt_text)
