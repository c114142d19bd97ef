"""vLLM's ``add_special_tokens`` on a model whose tokenizer adds BOS (as Llama's does):
completions, ``/tokenize`` of a prompt and text embeddings get it unless the request says
``false``; chat, ``/tokenize`` of messages and chat embeddings only when it says ``true``
(their template writes its own). Before, kiln refused ``true`` as unsupported, ignored
``false`` (completions kept their BOS) and left BOS out of ``/tokenize`` and embeddings,
which then differed from vLLM's for every Llama model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

BASE = """
backend: "llm"
parameters { key: "max_num_seqs" value { string_value: "4" } }
parameters { key: "num_gpu_blocks" value { string_value: "64" } }
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "dtype" value { string_value: "float32" } }
"""
POOLING = 'parameters { key: "runner" value { string_value: "pooling" } }'
TEXT = "the quick brown fox"
MESSAGES = [{"role": "user", "content": "hello world"}]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def _with_bos(folder: Path) -> int:
    """Give the test tokenizer Llama's post-processor (``<s> $A``); BOS's id."""
    path = folder / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = spec["model"]["vocab"]["<s>"]
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }  # fmt: skip
    path.write_text(json.dumps(spec))
    return int(bos)


@pytest.fixture(scope="module")
def bos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KilnProcess, int]]:
    weights = build_tiny_llm(tmp_path_factory.mktemp("weights"))
    bos_id = _with_bos(weights)
    repo = tmp_path_factory.mktemp("repo")
    for name, extra in (("gen", ""), ("emb", POOLING)):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\n{BASE}\n{extra}\n'
            f'parameters {{ key: "model_path" value {{ string_value: "{weights}" }} }}\n'
        )
    proc = KilnProcess(repo).start(timeout=120)
    yield proc, bos_id
    proc.stop()


@pytest.fixture
def server(bos: tuple[KilnProcess, int]) -> KilnProcess:
    return bos[0]


@pytest.fixture
def bos_id(bos: tuple[KilnProcess, int]) -> int:
    return bos[1]


def _tokens(http: httpx.Client, **body: Any) -> list[int]:
    reply = http.post("/tokenize", json={"model": "gen", **body})
    assert reply.status_code == 200, reply.text
    tokens: list[int] = reply.json()["tokens"]
    assert reply.json()["count"] == len(tokens)
    return tokens


def test_tokenize(http: httpx.Client, bos_id: int) -> None:
    plain = _tokens(http, prompt=TEXT, add_special_tokens=False)
    assert plain and plain[0] != bos_id
    assert _tokens(http, prompt=TEXT) == [bos_id, *plain]  # vLLM's default for a prompt
    chat = _tokens(http, messages=MESSAGES)  # the template's text, nothing added
    assert chat[0] != bos_id
    assert _tokens(http, messages=MESSAGES, add_special_tokens=True) == [bos_id, *chat]
    reply = http.post("/tokenize", json={"model": "gen", "prompt": TEXT, "add_special_tokens": 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "add_special_tokens"


def test_completions_add_bos_unless_told_not_to(
    client: openai.OpenAI, http: httpx.Client, bos_id: int
) -> None:
    plain = _tokens(http, prompt=TEXT, add_special_tokens=False)
    default = client.completions.create(model="gen", prompt=TEXT, **GREEDY)
    explicit = client.completions.create(
        model="gen", prompt=TEXT, **{**GREEDY, "extra_body": {"ignore_eos": True,
                                                                "add_special_tokens": True}},
    )  # fmt: skip
    without = client.completions.create(
        model="gen", prompt=TEXT, **{**GREEDY, "extra_body": {"ignore_eos": True,
                                                                "add_special_tokens": False}},
    )  # fmt: skip
    # the model saw the BOS: the same text as the token ids with it, and without it
    with_ids = client.completions.create(model="gen", prompt=[bos_id, *plain], **GREEDY)
    plain_ids = client.completions.create(model="gen", prompt=plain, **GREEDY)
    assert default.usage and default.usage.prompt_tokens == len(plain) + 1
    assert explicit.choices[0].text == default.choices[0].text == with_ids.choices[0].text
    assert without.usage and without.usage.prompt_tokens == len(plain)
    assert without.choices[0].text == plain_ids.choices[0].text


def test_chat_adds_bos_only_when_asked(
    client: openai.OpenAI, http: httpx.Client, bos_id: int
) -> None:
    rendered = _tokens(http, messages=MESSAGES)
    default = client.chat.completions.create(model="gen", messages=MESSAGES, **GREEDY)  # type: ignore[arg-type]
    added = client.chat.completions.create(
        model="gen", messages=MESSAGES,  # type: ignore[arg-type]
        **{**GREEDY, "extra_body": {"ignore_eos": True, "add_special_tokens": True}},
    )  # fmt: skip
    by_ids = client.completions.create(model="gen", prompt=[bos_id, *rendered], **GREEDY)
    assert default.usage and default.usage.prompt_tokens == len(rendered)
    assert added.usage and added.usage.prompt_tokens == len(rendered) + 1
    assert added.choices[0].message.content == by_ids.choices[0].text


def test_text_embeddings_add_bos_as_vllm_does(client: openai.OpenAI, http: httpx.Client) -> None:
    plain = _tokens(http, prompt=TEXT, add_special_tokens=False)
    with_bos = _tokens(http, prompt=TEXT)

    def vector(**kw: Any) -> np.ndarray:
        data = client.embeddings.create(model="emb", **kw).data
        return np.array(data[0].embedding)

    default = vector(input=TEXT)
    assert np.allclose(default, vector(input=with_bos), atol=1e-6)
    without = vector(input=TEXT, extra_body={"add_special_tokens": False})
    assert np.allclose(without, vector(input=plain), atol=1e-6)
    assert not np.allclose(default, without, atol=1e-3)
