"""BERT-family encoders behind ``kiln serve``, as a vLLM user serves BGE, E5 or a reranker:
``/v1/embeddings`` through the real ``openai`` client, a BERT cross-encoder on ``/score``
and ``/rerank`` (its pairs' token types read), an XLM-RoBERTa classifier on ``/classify``,
each against ``transformers``; an encoder asked to generate is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_encoder, llm_config, reference_encoder  # noqa: E402

TEXTS = ["the quick brown fox jumps over the lazy dog", "hello world", "kiln"]
QUERY = "what jumps over the dog"
LABELS = ("negative", "neutral", "positive")
ENTITIES = ("O", "B-PER", "I-PER", "B-LOC", "I-LOC")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    # a sentence-transformers embedding model: mean pooling, normalized (E5's layout)
    build_tiny_encoder(root / "e5" / "1", "bert", st_pooling="mean_tokens")
    (root / "e5" / "config.pbtxt").write_text(llm_config("e5", max_num_seqs="4"))
    build_tiny_encoder(root / "rerank" / "1", "bert", labels=("relevance",))
    (root / "rerank" / "config.pbtxt").write_text(llm_config("rerank", max_num_seqs="4"))
    build_tiny_encoder(root / "xlmr" / "1", "xlm-roberta", labels=LABELS)
    (root / "xlmr" / "config.pbtxt").write_text(llm_config("xlmr", max_num_seqs="4"))
    # LaBSE's layout: mean pooling, a Dense projection (64 -> 24, tanh), normalized
    build_tiny_encoder(root / "labse" / "1", "bert", st_pooling="mean_tokens", st_dense=24)
    (root / "labse" / "config.pbtxt").write_text(llm_config("labse", max_num_seqs="4"))
    # a token classifier (named entities): RoBERTa's
    build_tiny_encoder(root / "ner" / "1", "roberta", labels=ENTITIES, per_token=True)
    (root / "ner" / "config.pbtxt").write_text(llm_config("ner", max_num_seqs="4"))
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


def test_embeddings_through_the_openai_client(server: KilnProcess, repo: Path) -> None:
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="none")
    reply = client.embeddings.create(model="e5", input=TEXTS)
    got = torch.tensor([d.embedding for d in reply.data])
    hidden = reference_encoder(repo / "e5" / "1", TEXTS)
    want = F.normalize(torch.stack([h.mean(0) for h in hidden]), dim=-1)
    assert got.shape == (3, 64)
    assert torch.allclose(got, want, atol=1e-4)
    assert reply.usage.prompt_tokens == sum(h.shape[0] for h in hidden)  # [CLS] .. [SEP]


def test_token_embed_on_pooling(http: Any, repo: Path) -> None:
    """vLLM's ``/pooling`` with ``task: token_embed``: every token's vector, each
    normalized (the model normalizes), through the engine process."""
    hidden = reference_encoder(repo / "e5" / "1", TEXTS)
    reply = http.post("/pooling", json={"model": "e5", "input": TEXTS, "task": "token_embed"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    for item, want in zip(body["data"], hidden, strict=True):
        got = torch.tensor(item["data"])
        assert got.shape == want.shape  # [tokens, hidden]
        assert torch.allclose(got, F.normalize(want, dim=-1), atol=1e-4)
    assert body["usage"]["prompt_tokens"] == sum(h.shape[0] for h in hidden)
    # the raw states when asked, and the refusals
    raw = http.post("/pooling", json={"model": "e5", "input": TEXTS[1], "task": "token_embed",
                                      "normalize": False})  # fmt: skip
    assert torch.allclose(torch.tensor(raw.json()["data"][0]["data"]), hidden[1], atol=1e-4)
    b64 = http.post("/pooling", json={"model": "e5", "input": "hi", "task": "token_embed",
                                      "encoding_format": "base64"})  # fmt: skip
    assert b64.status_code == 400 and b64.json()["error"]["param"] == "encoding_format"
    odd = http.post("/pooling", json={"model": "e5", "input": "hi", "task": "reward"})
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "task"
    classifier = http.post("/pooling", json={"model": "xlmr", "input": "hi",
                                             "task": "token_embed"})  # fmt: skip
    assert classifier.status_code == 400 and classifier.json()["error"]["param"] == "model"


def test_cross_encoder_scores_and_reranks(http: Any, repo: Path) -> None:
    folder = repo / "rerank" / "1"
    want = torch.stack(reference_encoder(folder, [(QUERY, t) for t in TEXTS]))[:, 0].sigmoid()
    reply = http.post("/score", json={"model": "rerank", "text_1": QUERY, "text_2": TEXTS})
    assert reply.status_code == 200, reply.text
    scores = [d["score"] for d in reply.json()["data"]]
    assert scores == pytest.approx(want.tolist(), abs=1e-5)
    ranked = http.post("/rerank", json={"model": "rerank", "query": QUERY, "documents": TEXTS,
                                        "top_n": 2})  # fmt: skip
    assert ranked.status_code == 200, ranked.text
    results = ranked.json()["results"]
    best = want.argsort(descending=True)[:2].tolist()
    assert [r["index"] for r in results] == best
    assert [r["relevance_score"] for r in results] == pytest.approx(want[best].tolist(), abs=1e-5)


def test_xlm_roberta_classifier(http: Any, repo: Path) -> None:
    want = torch.stack(reference_encoder(repo / "xlmr" / "1", TEXTS))
    reply = http.post("/classify", json={"model": "xlmr", "input": TEXTS})
    assert reply.status_code == 200, reply.text
    data = reply.json()["data"]
    probs = torch.tensor([d["probs"] for d in data])
    assert torch.allclose(probs, want.softmax(-1), atol=1e-5)
    assert [d["label"] for d in data] == [LABELS[int(i)] for i in want.argmax(-1)]


def test_an_encoder_asked_to_generate_is_refused(http: Any) -> None:
    reply = http.post("/v1/completions", json={"model": "e5", "prompt": "hi", "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    assert "e5" in reply.json()["error"]["message"]
    hi = [{"role": "user", "content": "hi"}]
    chat = http.post("/v1/chat/completions", json={"model": "xlmr", "messages": hi})
    assert chat.status_code == 400, chat.text
    # Triton's generate extension: the engine refuses it before it queues
    triton = http.post("/v2/models/e5/generate", json={"text_input": "hi", "max_tokens": 2})
    assert triton.status_code == 400, triton.text
    assert "BertModel is an encoder: it embeds" in triton.text
    # a text longer than the encoder's 128 positions
    long = http.post("/v1/embeddings", json={"model": "e5", "input": "fox " * 400})
    assert long.status_code == 400, long.text
    assert "maximum context length is 128 tokens" in long.json()["error"]["message"]


def test_kiln_serve_model_with_vllms_pooling_flags(tmp_path: Path) -> None:
    """``kiln serve --model`` as ``vllm serve`` is run for embeddings: a decoder told to
    pool (``--runner pooling``, ``--pooler-config``) and an encoder that pools by itself."""
    from tests.llm_models import build_tiny_llm

    decoder = build_tiny_llm(tmp_path / "llama")
    encoder = build_tiny_encoder(tmp_path / "bert")
    args = ["--model", str(decoder), "--model", str(encoder), "--served-model-name", "llama",
            "--served-model-name", "bert", "--runner", "pooling",
            "--pooler-config", '{"pooling_type": "MEAN"}']  # fmt: skip
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=180)
    try:
        client = openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="none")
        got = torch.tensor(
            client.embeddings.create(model="bert", input=TEXTS[:2]).data[0].embedding
        )
        want = F.normalize(reference_encoder(encoder, TEXTS[:1])[0].mean(0), dim=-1)
        assert torch.allclose(got, want, atol=1e-4)  # MEAN, as the flag says
        vectors = client.embeddings.create(model="llama", input=["hello world"]).data
        assert len(vectors[0].embedding) == 64
        with httpx.Client(base_url=f"http://{proc.http_url}", timeout=60) as http:
            reply = http.post("/v1/completions", json={"model": "llama", "prompt": "hi"})
            assert reply.status_code == 400 and "runner 'pooling'" in reply.text
    finally:
        proc.stop()


def test_token_classify_on_pooling(http: Any, repo: Path) -> None:
    """vLLM's ``/pooling`` of a ``*ForTokenClassification`` model: every token's label
    probabilities (its default task), equal to ``transformers``' softmax; raw logits with
    ``use_activation: false``; ``/invocations`` answers the same."""
    want = reference_encoder(repo / "ner" / "1", TEXTS)
    for body in ({"task": "token_classify"}, {}):
        reply = http.post("/pooling", json={"model": "ner", "input": TEXTS, **body})
        assert reply.status_code == 200, reply.text
        data = reply.json()["data"]
        for item, logits in zip(data, want, strict=True):
            got = torch.tensor(item["data"])
            assert got.shape == (logits.shape[0], len(ENTITIES))
            assert torch.allclose(got, logits.softmax(-1), atol=1e-5)
        assert reply.json()["usage"]["prompt_tokens"] == sum(w.shape[0] for w in want)
    raw = http.post("/pooling", json={"model": "ner", "input": TEXTS[1], "use_activation": False})
    assert torch.allclose(torch.tensor(raw.json()["data"][0]["data"]), want[1], atol=1e-4)
    via = http.post("/invocations", json={"model": "ner", "input": TEXTS[:1]})
    assert via.status_code == 200, via.text
    assert torch.allclose(torch.tensor(via.json()["data"][0]["data"]), want[0].softmax(-1),
                          atol=1e-5)  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/embeddings", {"model": "ner", "input": "x"}, "model"),
        ("/pooling", {"model": "ner", "input": "x", "task": "embed"}, "model"),
        ("/pooling", {"model": "ner", "input": "x", "task": "token_embed"}, "model"),
        ("/classify", {"model": "ner", "input": "x"}, "model"),
        ("/score", {"model": "ner", "text_1": "a", "text_2": "b"}, "model"),
        ("/pooling", {"model": "e5", "input": "x", "task": "token_classify"}, "task"),
        ("/pooling", {"model": "xlmr", "input": "x", "task": "token_classify"}, "task"),
        ("/pooling", {"model": "ner", "input": "x", "task": "token_classify",
                      "encoding_format": "base64"}, "encoding_format"),
        ("/v1/completions", {"model": "ner", "prompt": "x"}, "model"),
    ],
)  # fmt: skip
def test_what_a_token_classifier_does_not_answer(
    http: Any, path: str, body: dict[str, Any], param: str
) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_a_dense_module_projects_served_embeddings(http: Any, repo: Path) -> None:
    """A sentence-transformers Dense module on the served path (the engine's own process):
    vectors of its width, normalize(tanh(W mean + b)); dimensions past it are a 400."""
    from safetensors.torch import load_file

    dense = load_file(str(repo / "labse" / "1" / "2_Dense" / "model.safetensors"))
    pooled = torch.stack([h.mean(0) for h in reference_encoder(repo / "labse" / "1", TEXTS)])
    want = F.normalize(torch.tanh(pooled @ dense["linear.weight"].T + dense["linear.bias"]), dim=-1)
    reply = http.post("/v1/embeddings", json={"model": "labse", "input": TEXTS})
    assert reply.status_code == 200, reply.text
    got = torch.tensor([d["embedding"] for d in reply.json()["data"]])
    assert got.shape == (3, 24) and torch.allclose(got, want, atol=1e-5)
    wide = http.post("/v1/embeddings", json={"model": "labse", "input": "x", "dimensions": 32})
    assert wide.status_code == 400
