"""``/v1/embeddings`` of a ``kiln serve`` process, driven by the real ``openai`` client:
vectors against ``transformers``' ``AutoModel`` (LAST and MEAN pooling, normalized), batches
of inputs of different lengths, token-id inputs, base64, the errors, and a generation
request that runs at the same time."""

from __future__ import annotations

import base64
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

#: float32 on both sides: states agree to rounding (fused projections, other summation order)
ATOL = 1e-5
BASE = """
backend: "llm"
parameters { key: "max_num_seqs" value { string_value: "4" } }
parameters { key: "max_waiting" value { string_value: "4" } }
parameters { key: "max_num_batched_tokens" value { string_value: "64" } }
parameters { key: "max_model_len" value { string_value: "128" } }
"""
MODELS = {
    # vLLM's default pooler for a decoder: the last token, normalized
    "last": 'parameters { key: "runner" value { string_value: "pooling" } }',
    # vLLM's older spelling (--task embed) and --pooler-config JSON
    "mean": 'parameters { key: "task" value { string_value: "embed" } }\n'
    'parameters { key: "pooler_config" value { string_value: '
    '"{\\"pooling_type\\": \\"MEAN\\"}" } }',
    "gen": "",
}
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello",
    "kiln serves models with continuous batching and a paged kv cache, " * 2,
]


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("weights"))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, weights: Path) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("repo")
    for name, extra in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(
            f'name: "{name}"\n{BASE}\n{extra}\n'
            f'parameters {{ key: "model_path" value {{ string_value: "{weights}" }} }}\n'
        )
    # a matryoshka model: its config.json lists the sizes its vectors may be cut to
    build_tiny_llm(repo / "mat" / "1", matryoshka_dimensions=[16, 32])
    (repo / "mat" / "config.pbtxt").write_text(f'name: "mat"\n{BASE}\n{MODELS["last"]}\n')
    # a sentence-transformers model with prefixes by task (Cohere's input_type)
    build_tiny_llm(repo / "prompted" / "1")
    (repo / "prompted" / "1" / "config_sentence_transformers.json").write_text(
        json.dumps({"prompts": {"search_query": "query: ", "search_document": "passage: "}})
    )
    (repo / "prompted" / "config.pbtxt").write_text(f'name: "prompted"\n{BASE}\n{MODELS["last"]}\n')
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference(weights: Path) -> Any:
    import transformers

    from kiln.llm.tokenizer import Tokenizer

    model = transformers.AutoModel.from_pretrained(str(weights), torch_dtype=torch.float32)
    tokenizer = Tokenizer(weights)

    def embed(item: str | list[int], pooling: str) -> np.ndarray:
        ids = tokenizer.encode(item) if isinstance(item, str) else item
        with torch.no_grad():
            hidden = model.eval()(torch.tensor([ids])).last_hidden_state[0]
        pooled = hidden[-1] if pooling == "last" else hidden.mean(0)
        return F.normalize(pooled, dim=-1).numpy()

    return embed


def _post(
    server: KilnProcess, body: dict[str, Any], path: str = "/v1/embeddings"
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"http://{server.http_url}{path}",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


@pytest.mark.parametrize("model", ["last", "mean"])
def test_batch_of_texts_matches_transformers(
    client: openai.OpenAI, server: KilnProcess, reference: Any, model: str
) -> None:
    # the client asks for base64 by default and decodes it: float32, native order
    got = client.embeddings.create(model=model, input=TEXTS)
    assert [d.index for d in got.data] == [0, 1, 2]
    for text, item in zip(TEXTS, got.data, strict=True):
        np.testing.assert_allclose(item.embedding, reference(text, model), atol=ATOL, rtol=0)
    assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    assert got.model == model and got.object == "list"
    # vLLM's SageMaker route: an 'input' body is an embeddings request
    status, via = _post(server, {"model": model, "input": TEXTS[:1], "encoding_format": "float"},
                        "/invocations")  # fmt: skip
    assert status == 200 and via["object"] == "list"
    np.testing.assert_allclose(via["data"][0]["embedding"], got.data[0].embedding, atol=1e-6)


def test_float_encoding_and_token_id_inputs(
    client: openai.OpenAI, server: KilnProcess, reference: Any
) -> None:
    ids = [[5, 17, 42, 99, 3], list(range(30, 70))]
    as_floats = client.embeddings.create(model="last", input=ids, encoding_format="float")
    for prompt, item in zip(ids, as_floats.data, strict=True):
        np.testing.assert_allclose(item.embedding, reference(prompt, "last"), atol=ATOL, rtol=0)
    assert as_floats.usage.prompt_tokens == 45
    # one list of ids is one input; base64 holds the very floats the float format writes
    body = {"model": "last", "input": ids[0]}
    status, raw = _post(server, {**body, "encoding_format": "base64"})
    assert status == 200 and len(raw["data"]) == 1
    _, floats = _post(server, {**body, "encoding_format": "float"})
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype=np.float32)
    np.testing.assert_array_equal(decoded, np.float32(floats["data"][0]["embedding"]))
    assert raw["id"].startswith("embd-") and raw["usage"]["prompt_tokens"] == 5


def test_vllm_fields(server: KilnProcess) -> None:
    body = {"model": "mean", "input": "hello world", "encoding_format": "float"}
    _, plain = _post(server, body)
    vector = np.array(plain["data"][0]["embedding"])
    _, raw = _post(server, {**body, "normalize": False})
    unnormalized = np.array(raw["data"][0]["embedding"])
    assert abs(np.linalg.norm(unnormalized) - 1) > 1e-3
    np.testing.assert_allclose(unnormalized / np.linalg.norm(unnormalized), vector, atol=1e-6)
    _, half = _post(server, {**body, "encoding_format": "base64", "embed_dtype": "float16",
                             "endianness": "big", "request_id": "abc"})  # fmt: skip
    decoded = np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), dtype=">f2")
    np.testing.assert_array_equal(decoded, vector.astype(np.float16))
    assert half["id"] == "embd-abc"
    # truncate_prompt_tokens keeps the input's last tokens, as vLLM does
    _, long = _post(server, {"model": "last", "input": list(range(10, 50)),
                             "truncate_prompt_tokens": 8})  # fmt: skip
    _, tail = _post(server, {"model": "last", "input": list(range(42, 50))})
    assert long["usage"]["prompt_tokens"] == 8
    assert long["data"][0]["embedding"] == tail["data"][0]["embedding"]
    # vLLM's chat form: the messages as the chat template writes them, without a
    # generation prompt unless asked
    chat = {"model": "last", "messages": [{"role": "user", "content": "hi"}]}
    _, by_messages = _post(server, chat)
    _, by_text = _post(server, {"model": "last", "input": "<|user|>hi</s>"})
    assert by_messages["data"] == by_text["data"]
    _, prompted = _post(server, {**chat, "add_generation_prompt": True})
    _, prompted_text = _post(server, {"model": "last", "input": "<|user|>hi</s><|assistant|>"})
    assert prompted["data"] == prompted_text["data"] != by_text["data"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["a", 3]}, "input"),
        ({"input": ["a"] * 9}, "input"),  # more than max_waiting + max_num_seqs
        ({"input": list(range(1, 130))}, "input"),  # past max_model_len (128)
        ({"input": "the " * 200}, "input"),
        ({"input": [1000]}, "input"),  # outside the vocabulary
        ({"input": "hi", "dimensions": 16}, "dimensions"),  # not a matryoshka model
        ({"input": "hi", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "hi", "embed_dtype": "fp8_e4m3"}, "embed_dtype"),
        ({"input": "hi", "normalize": "yes"}, "normalize"),
        ({"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "hi", "priority": 1}, "priority"),
        ({"messages": "hi"}, "messages"),
        ({"input": "hi", "messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ({"input": "hi", "model": "gen"}, "model"),  # served for generation
    ],
)
def test_bad_input_is_a_400_naming_the_field(
    server: KilnProcess, body: dict[str, Any], param: str
) -> None:
    status, answer = _post(server, {"model": "last", **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"


def test_matryoshka_dimensions(client: openai.OpenAI) -> None:
    whole = client.embeddings.create(model="mat", input="hello", extra_body={"normalize": False})
    cut = client.embeddings.create(model="mat", input="hello", dimensions=16)
    raw = np.array(whole.data[0].embedding)
    assert len(raw) == 64 and len(cut.data[0].embedding) == 16
    # vLLM's order: cut, then normalize
    np.testing.assert_allclose(cut.data[0].embedding, raw[:16] / np.linalg.norm(raw[:16]),
                               atol=1e-6)  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=r"only supports \[16, 32\]") as err:
        client.embeddings.create(model="mat", input="hello", dimensions=8)
    assert err.value.body["param"] == "dimensions"  # type: ignore[index]


def test_openai_client_errors_and_pooling_model_generates_nothing(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError, match="does not support matryoshka"):
        client.embeddings.create(model="last", input="hi", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="nope", input="hi")
    # vLLM's pooling runner answers no completions
    with pytest.raises(openai.BadRequestError, match="does not support Completions API"):
        client.completions.create(model="last", prompt="hi", max_tokens=2)


def test_generation_completes_while_embeddings_run(
    client: openai.OpenAI, weights: Path, reference: Any
) -> None:
    """Embedding batches run off the event loop (on their engine's thread): a generation
    request sent while they run completes, token for token as ``transformers``
    generates. (Pooling batches sharing one engine with generation steps:
    tests/unit/llm/test_llm_pooling.py.)"""
    from kiln.llm.tokenizer import Tokenizer

    texts = [TEXTS[2]] * 8
    results: list[Any] = []

    def embed() -> None:
        for _ in range(3):
            results.append(client.embeddings.create(model="last", input=texts))

    worker = threading.Thread(target=embed)
    worker.start()
    prompt = [5, 17, 42, 99, 3]
    got = client.completions.create(
        model="gen", prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    worker.join(timeout=120)
    assert got.choices[0].text == Tokenizer(weights).decode(reference_generate(weights, prompt, 8))
    assert got.usage is not None and got.usage.completion_tokens == 8
    assert len(results) == 3
    expected = reference(TEXTS[2], "last")
    for answer in results:
        for item in answer.data:
            np.testing.assert_allclose(item.embedding, expected, atol=ATOL, rtol=0)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_score_is_the_cosine_of_transformers_vectors(
    server: KilnProcess, reference: Any, path: str
) -> None:
    """vLLM's score API on an embedding model (its bi-encoder path): 1:N, N:N, and the
    newer ``data_1`` / ``data_2`` names."""
    status, one_to_n = _post(server, {"model": "mean", "text_1": TEXTS[0], "text_2": TEXTS}, path)
    assert status == 200, one_to_n
    assert one_to_n["object"] == "list" and one_to_n["id"].startswith("score-")
    assert [d["index"] for d in one_to_n["data"]] == [0, 1, 2]
    assert {d["object"] for d in one_to_n["data"]} == {"score"}
    query = reference(TEXTS[0], "mean")
    for text, item in zip(TEXTS, one_to_n["data"], strict=True):
        assert abs(item["score"] - _cosine(query, reference(text, "mean"))) < 1e-5
    assert abs(one_to_n["data"][0]["score"] - 1) < 1e-5  # a text against itself
    pairs = {"model": "last", "data_1": TEXTS[:2], "data_2": TEXTS[1:], "request_id": "q7"}
    status, n_to_n = _post(server, pairs, path)
    assert status == 200 and n_to_n["id"] == "score-q7"
    status, via = _post(server, pairs, "/invocations")
    assert status == 200 and via["data"] == n_to_n["data"]
    for left, right, item in zip(TEXTS[:2], TEXTS[1:], n_to_n["data"], strict=True):
        want = _cosine(reference(left, "last"), reference(right, "last"))
        assert abs(item["score"] - want) < 1e-5
    # usage: each pair's two texts, the lone left text counted with every pair
    _, tokens = _post(server, {"model": "last", "input": TEXTS, "encoding_format": "float"})
    assert one_to_n["usage"]["prompt_tokens"] == (
        3 * _post(server, {"model": "mean", "input": TEXTS[0]})[1]["usage"]["prompt_tokens"]
        + tokens["usage"]["prompt_tokens"]
    )


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_best_first(server: KilnProcess, reference: Any, path: str) -> None:
    documents = [TEXTS[2], TEXTS[1], TEXTS[0], "a lazy dog"]
    body = {"model": "mean", "query": TEXTS[0], "documents": documents}
    status, answer = _post(server, body, path)
    assert status == 200, answer
    query = reference(TEXTS[0], "mean")
    want = [_cosine(query, reference(d, "mean")) for d in documents]
    order = sorted(range(4), key=lambda i: -want[i])
    assert [r["index"] for r in answer["results"]] == order
    assert answer["results"][0]["index"] == 2  # the query itself is the best match
    for result in answer["results"]:
        assert result["document"] == {"text": documents[result["index"]]}
        assert abs(result["relevance_score"] - want[result["index"]]) < 1e-5
    assert answer["id"].startswith("rerank-") and answer["usage"]["total_tokens"] > 0
    # top_n keeps the best; Cohere's document objects are read as their text
    _, top = _post(server, {**body, "top_n": 2,
                            "documents": [{"text": d} for d in documents]}, path)  # fmt: skip
    assert [r["index"] for r in top["results"]] == order[:2]
    # vLLM's SageMaker route reads a query and documents as a rerank
    status, via = _post(server, body, "/invocations")
    assert status == 200 and [r["index"] for r in via["results"]] == order


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/score", {"text_2": "b"}, "text_1"),
        ("/score", {"text_1": "", "text_2": "b"}, "text_1"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2"),
        ("/score", {"text_1": "a", "text_2": ["b", 3]}, "text_2"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),  # 2:3
        ("/score", {"text_1": "a", "data_1": "a", "text_2": "b"}, "data_1"),
        ("/score", {"text_1": "a", "text_2": ["b"] * 8}, "text_2"),  # 9 texts: more than 8
        ("/score", {"text_1": "the " * 200, "text_2": "b"}, "text_1"),  # past the context
        (
            "/score",
            {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 0},
            "truncate_prompt_tokens",
        ),
        ("/score", {"text_1": "a", "text_2": "b", "priority": 1}, "priority"),
        ("/score", {"text_1": "a", "text_2": "b", "use_activation": "no"}, "use_activation"),
        ("/score", {"text_1": "a", "text_2": "b", "model": "gen"}, "model"),
        ("/rerank", {"documents": ["b"]}, "query"),
        ("/rerank", {"query": ["a"], "documents": ["b"]}, "query"),
        ("/rerank", {"query": "a", "documents": "b"}, "documents"),
        ("/rerank", {"query": "a", "documents": [{"title": "b"}]}, "documents"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "a", "documents": ["b"], "top_n": True}, "top_n"),
        ("/rerank", {"query": "a", "documents": ["b"], "model": "gen"}, "model"),
    ],
)
def test_bad_score_input_is_a_400_naming_the_field(
    server: KilnProcess, path: str, body: dict[str, Any], param: str
) -> None:
    status, answer = _post(server, {"model": "last", **body}, path)
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert answer["error"]["type"] == "invalid_request_error"
    status, _ = _post(server, {"model": "nope", "text_1": "a", "text_2": "b"}, "/score")
    assert status == 404


def test_pooling_answers_the_embedding_in_vllms_shape(server: KilnProcess) -> None:
    body = {"model": "last", "input": TEXTS[:2], "encoding_format": "float"}
    _, embedded = _post(server, body)
    status, pooled = _post(server, {**body, "task": "embed"}, "/pooling")
    assert status == 200, pooled
    assert pooled["id"].startswith("pool-") and pooled["object"] == "list"
    assert [(d["index"], d["object"]) for d in pooled["data"]] == [(0, "pooling"), (1, "pooling")]
    assert [d["data"] for d in pooled["data"]] == [d["embedding"] for d in embedded["data"]]
    assert pooled["usage"] == embedded["usage"]
    status, answer = _post(server, {**body, "task": "reward"}, "/pooling")
    assert status == 400 and answer["error"]["param"] == "task"
    # an embedding model is no classifier
    status, answer = _post(server, {**body, "task": "classify"}, "/pooling")
    assert status == 400 and "not a sequence classifier" in answer["error"]["message"]
    status, answer = _post(server, {**body, "model": "gen"}, "/pooling")
    assert status == 400 and "does not support Pooling API" in answer["error"]["message"]


# --- Cohere's /v2/embed, as vLLM serves it ----------------------------------------------


def test_cohere_embed_with_the_cohere_client(client: openai.OpenAI, server: KilnProcess) -> None:
    """The real ``cohere`` client: ``input_type`` puts the model's prefix before each text,
    the types derive from the float vectors (the same as /v1/embeddings'), ``truncate`` and
    ``output_dimension`` map onto the embeddings API's."""
    cohere = pytest.importorskip("cohere")
    co = cohere.ClientV2(api_key="unused", base_url=f"http://{server.http_url}")
    types = ["float", "binary", "ubinary", "base64"]
    got = co.embed(model="prompted", texts=TEXTS[:2], input_type="search_query",
                   embedding_types=types)  # fmt: skip
    assert got.response_type == "embeddings_by_type" and got.texts == TEXTS[:2]
    same = client.embeddings.create(model="prompted", input=["query: " + t for t in TEXTS[:2]])
    floats = np.array(got.embeddings.float_)
    np.testing.assert_allclose(floats, [d.embedding for d in same.data], atol=1e-6)
    packed = np.packbits(floats >= 0, axis=-1)
    assert got.embeddings.ubinary == packed.tolist()
    assert got.embeddings.binary == (packed.astype(int) - 128).tolist()
    decoded = [np.frombuffer(base64.b64decode(b), "<f4") for b in got.embeddings.base64]
    np.testing.assert_allclose(decoded, floats, atol=0)
    assert got.meta.billed_units.input_tokens == same.usage.prompt_tokens
    # a task the model has no prefix for: 400 naming the ones it has
    with pytest.raises(cohere.errors.BadRequestError) as info:
        co.embed(model="prompted", texts=["x"], input_type="clustering",
                 embedding_types=["float"])  # fmt: skip
    assert "search_document, search_query" in str(info.value.body)
    # a model without prefixes: input_type (the client always sends one) asks for nothing
    plain = co.embed(model="last", texts=TEXTS[:1], input_type="search_document",
                     embedding_types=["float"])  # fmt: skip
    alone = client.embeddings.create(model="last", input=TEXTS[:1]).data[0].embedding
    np.testing.assert_allclose(plain.embeddings.float_[0], alone, atol=1e-6)
    # truncate END keeps the first max_tokens tokens; NONE refuses a longer text
    cut = co.embed(model="last", texts=TEXTS[:1], input_type="search_document",
                   embedding_types=["float"], truncate="END", max_tokens=3)  # fmt: skip
    first = client.embeddings.create(
        model="last", input=TEXTS[:1],
        extra_body={"truncate_prompt_tokens": 3, "truncation_side": "right"},
    )  # fmt: skip
    np.testing.assert_allclose(cut.embeddings.float_[0], first.data[0].embedding, atol=1e-6)
    with pytest.raises(cohere.errors.BadRequestError):
        co.embed(model="last", texts=TEXTS[:1], input_type="search_document",
                 embedding_types=["float"], truncate="NONE", max_tokens=2)  # fmt: skip
    short = co.embed(model="mat", texts=["hi"], input_type="search_document",
                     embedding_types=["float"], output_dimension=16)  # fmt: skip
    assert len(short.embeddings.float_[0]) == 16


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"texts": []}, "texts"),
        ({"images": ["data:image/png;base64,AA=="]}, "images"),
        ({"texts": ["x"], "embedding_types": ["int8"]}, "embedding_types"),
        ({"texts": ["x"], "truncate": "MIDDLE"}, "truncate"),
        ({"texts": ["x"], "max_tokens": 0}, "max_tokens"),
        ({"texts": ["x"] * 4097}, "texts"),
    ],
)
def test_cohere_embed_refuses_bad_bodies(
    server: KilnProcess, body: dict[str, Any], param: str
) -> None:
    request = urllib.request.Request(
        f"http://{server.http_url}/v2/embed", method="POST",
        data=json.dumps({"model": "last", **body}).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=30)
    assert info.value.code == 400
    assert json.loads(info.value.read())["error"]["param"] == param
