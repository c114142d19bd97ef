"""vLLM's ``/classify`` of a ``kiln serve`` process holding a sequence classifier: each
input's probabilities against ``transformers``' logits, the likeliest label, raw logits
with ``use_activation: false``, ``/invocations`` picking it by the model, and the
refusals (a generator asked to classify, a classifier asked to embed or generate, bad
bodies). A one-class classifier is a cross-encoder on ``/score`` and ``/rerank``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

import torch  # noqa: E402

from kiln.llm.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import (  # noqa: E402
    build_tiny_classifier,
    build_tiny_llm,
    llm_config,
    reference_logits,
)

LABELS = ("negative", "neutral", "positive")
HI: dict[str, Any] = {"model": "cls", "input": "hi"}
TEXTS = ["the quick brown fox", "hello world", "a sequence of tokens is generated"]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    build_tiny_classifier(root / "cls" / "1", LABELS)
    (root / "cls" / "config.pbtxt").write_text(llm_config("cls", max_num_seqs="4"))
    # a one-class classifier: a cross-encoder, scoring pairs of texts
    build_tiny_classifier(root / "ce" / "1", ("relevance",))
    (root / "ce" / "config.pbtxt").write_text(llm_config("ce", max_num_seqs="4"))
    build_tiny_llm(root / "gen" / "1")
    (root / "gen" / "config.pbtxt").write_text(llm_config("gen", max_num_seqs="4"))
    return root


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[KilnProcess]:
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def http(server: KilnProcess) -> Iterator[Any]:
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as client:
        yield client


def test_probabilities_and_labels_match_transformers(http: Any, repo: Path) -> None:
    folder = repo / "cls" / "1"
    tokenizer = Tokenizer(folder)
    prompts = [tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    want = torch.tensor(reference_logits(folder, prompts))
    reply = http.post("/classify", json={"model": "cls", "input": TEXTS, "request_id": "x1"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "cls" and body["id"] == "classify-x1"
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
    probs = torch.tensor([d["probs"] for d in body["data"]])
    assert torch.allclose(probs, want.softmax(-1), atol=1e-5)
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["label"] for d in body["data"]] == [LABELS[int(i)] for i in want.argmax(-1)]
    assert {d["num_classes"] for d in body["data"]} == {3}
    # the raw logits, and one input as a string or as token ids
    raw = http.post("/classify", json={"model": "cls", "input": prompts[0],
                                       "use_activation": False})  # fmt: skip
    assert raw.status_code == 200, raw.text
    assert raw.json()["data"][0]["probs"] == pytest.approx(want[0].tolist(), abs=1e-5)
    # vLLM's /pooling of a classifier: the probabilities as each input's data
    for task in ("classify", None):
        pooled = http.post("/pooling", json={"model": "cls", "input": TEXTS, "task": task})
        assert pooled.status_code == 200, pooled.text
        rows = torch.tensor([d["data"] for d in pooled.json()["data"]])
        assert torch.allclose(rows, want.softmax(-1), atol=1e-5)
        assert pooled.json()["data"][0]["object"] == "pooling"
    # SageMaker's route: an `input` body for a classifier is a classification
    routed = http.post("/invocations", json={"model": "cls", "input": TEXTS[0]})
    assert routed.status_code == 200 and routed.json()["data"][0]["num_classes"] == 3


def _error(reply: Any, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"model": "gen", "input": "hi"}, "model", "does not support Classification API"),
        ({"model": "cls"}, "input", "'input' must be"),
        ({"model": "cls", "input": []}, "input", "'input' must be"),
        ({"model": "cls", "input": ["ok", ""]}, "input", "input[1]"),
        ({**HI, "use_activation": "no"}, "use_activation", "boolean"),
        ({**HI, "use_activation": True, "activation": False}, "activation", "disagree"),
        ({**HI, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
        ({**HI, "priority": "high"}, "priority", "integer"),
        ({**HI, "add_special_tokens": 1}, "add_special_tokens", "boolean"),
        ({"model": "cls", "input": [[5, 100000]]}, "input", "token ids must be in"),
        ({"model": "cls", "input": ["x"] * 2000}, "input", "more than the model queues"),
        ({"model": "cls", "input": ["x"] * 5000}, "input", "5000 inputs, more than 4096"),
        ({**HI, "suffix": "x"}, "suffix", "not supported"),
    ],
)
def test_bad_classify_bodies_are_400_naming_the_field(
    http: Any, body: dict[str, Any], param: str, words: str
) -> None:
    assert words in _error(http.post("/classify", json=body), param)


def test_a_classifier_neither_embeds_nor_generates(http: Any) -> None:
    message = _error(http.post("/v1/embeddings", json={"model": "cls", "input": "hi"}), "model")
    assert "sequence classifier" in message and "/classify" in message
    reply = http.post("/v1/completions", json={"model": "cls", "prompt": "hi"})
    assert "does not support Completions API" in _error(reply, "model")
    # nor through Triton's generate endpoint
    generate = {"text_input": "hi", "parameters": {"max_tokens": 2}}
    triton = http.post("/v2/models/cls/generate", json=generate)
    assert triton.status_code == 400 and "sequence classifier" in triton.text, triton.text
    # and the generator next to it still generates
    done = http.post("/v1/completions", json={"model": "gen", "prompt": "hi", "max_tokens": 2})
    assert done.status_code == 200, done.text


def test_a_one_class_classifier_scores_pairs_as_a_cross_encoder(http: Any, repo: Path) -> None:
    import transformers

    folder = repo / "ce" / "1"
    query, documents = "what is kiln", ["a server for models", "a furnace", "hello"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    pairs = [tokenizer(query, d)["input_ids"] for d in documents]
    want = torch.tensor(reference_logits(folder, pairs))[:, 0].sigmoid().tolist()
    reply = http.post("/score", json={"model": "ce", "text_1": query, "text_2": documents})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)  # each pair once
    ranked = http.post("/rerank", json={"model": "ce", "query": query, "documents": documents,
                                        "top_n": 2})  # fmt: skip
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in results] == best
    assert [r["relevance_score"] for r in results] == pytest.approx([want[i] for i in best])
    # N:N pairs, and a classifier of three classes does not score
    two = http.post("/score", json={"model": "ce", "text_1": [query, "x"], "text_2": ["a", "b"]})
    assert two.status_code == 200 and len(two.json()["data"]) == 2
    message = _error(http.post("/score", json={"model": "cls", "text_1": "a", "text_2": "b"}),
                     "model")  # fmt: skip
    assert "classifier of 3 classes" in message and "one-class" in message
