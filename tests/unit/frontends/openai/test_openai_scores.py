"""vLLM's score and rerank requests, read and answered without a model: the pairing
rules (1:1, 1:N, N:N), each malformed field named, the cosines, rerank's order and
``top_n``, and vLLM's token count."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.frontends.openai.protocol import OpenAIError
from kiln.frontends.openai.scores import (
    MAX_TEXTS,
    cosines,
    pair_tokens,
    rerank_body,
    rerank_request,
    score_body,
    score_request,
)


def test_score_pairs_one_to_n_and_n_to_n() -> None:
    one = score_request({"model": "m", "text_1": "q", "text_2": ["a", "b"]})
    assert (one.left, one.right, one.names) == (["q"], ["a", "b"], ("text_1", "text_2"))
    pairs = score_request({"model": "m", "data_1": ["q", "r"], "data_2": ["a", "b"]})
    assert pairs.names == ("data_1", "data_2") and pairs.left == ["q", "r"]
    assert score_request({"model": "m", "text_1": "q", "text_2": "a"}).right == ["a"]


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"text_2": "a"}, "text_1", "non-empty string"),
        ({"text_1": "q", "text_2": ""}, "text_2", "non-empty string"),
        ({"text_1": ["q", None], "text_2": "a"}, "text_1", r"text_1\[1\]"),
        ({"text_1": ["q", "r"], "text_2": ["a"]}, "text_2", "1:1, 1:N or N:N"),
        ({"text_1": "q", "data_1": "q", "text_2": "a"}, "data_1", "not both"),
        ({"text_1": "q", "text_2": "a", "priority": "1"}, "priority", "integer"),
        (
            {"text_1": "q", "text_2": "a", "truncate_prompt_tokens": -2},
            "truncate_prompt_tokens",
            ">= 1",
        ),
        ({"text_1": "q", "text_2": "a", "softmax": 1}, "softmax", "boolean"),
        ({"text_1": "q", "text_2": "a", "request_id": ""}, "request_id", "non-empty"),
        ({"model": 3, "text_1": "q", "text_2": "a"}, "model", "required"),
    ],
)
def test_bad_score_fields_are_named(body: dict[str, Any], param: str, match: str) -> None:
    with pytest.raises(OpenAIError, match=match) as err:
        score_request({"model": "m", **body})
    assert err.value.param == param and err.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"documents": ["a"]}, "query"),
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", {"text": ""}]}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -3}, "top_n"),
        ({"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
    ],
)
def test_bad_rerank_fields_are_named(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        rerank_request({"model": "m", **body})
    assert err.value.param == param


def test_cosines_pair_a_lone_left_text_with_every_right_one() -> None:
    q, a, b = torch.tensor([1.0, 0.0]), torch.tensor([3.0, 0.0]), torch.tensor([1.0, 1.0])
    assert cosines([q, a, b], 1) == pytest.approx([1.0, 2**-0.5])
    assert cosines([q, b, a, a], 2) == pytest.approx([1.0, 2**-0.5])


def test_answers_in_vllms_shapes() -> None:
    req = rerank_request({"model": "m", "query": "q", "documents": ["a", {"text": "b"}, "c"],
                          "top_n": 2, "request_id": "x"})  # fmt: skip
    left, right = [[1, 2]], [[3], [4, 5], [6, 7, 8]]
    body = rerank_body(req, [0.1, 0.9, 0.5], pair_tokens(left, right))
    assert body["id"] == "rerank-x" and body["model"] == "m"
    assert body["results"] == [
        {"index": 1, "document": {"text": "b"}, "relevance_score": 0.9},
        {"index": 2, "document": {"text": "c"}, "relevance_score": 0.5},
    ]
    # every pair's two texts, the query counted with each: (2 + 1) + (2 + 2) + (2 + 3)
    assert body["usage"]["total_tokens"] == 12
    every = rerank_body(rerank_request({"model": "m", "query": "q", "documents": ["a", "b"]}),
                        [0.2, 0.3], pair_tokens([[1]], [[2], [3]]))  # fmt: skip
    assert [r["index"] for r in every["results"]] == [1, 0]
    pairs = score_request({"model": "m", "text_1": ["p", "q"], "text_2": ["a", "b"]})
    scored = score_body(pairs, [0.5, -0.25], pair_tokens([[1], [2, 3]], [[4], [5]]))
    assert scored["object"] == "list" and scored["id"].startswith("score-")
    assert scored["data"] == [
        {"index": 0, "object": "score", "score": 0.5},
        {"index": 1, "object": "score", "score": -0.25},
    ]
    assert scored["usage"]["prompt_tokens"] == scored["usage"]["total_tokens"] == 5


def test_a_long_list_is_refused_before_its_items_are_read() -> None:
    """A list past MAX_TEXTS is a 400 from its length alone (the bad last item is never
    reached), as are rerank's documents."""
    many = ["a"] * MAX_TEXTS + [None]
    with pytest.raises(OpenAIError, match=f"holds {MAX_TEXTS + 1} texts, more than") as err:
        score_request({"model": "m", "text_1": "q", "text_2": many})
    assert err.value.param == "text_2"
    with pytest.raises(OpenAIError, match="more than") as err:
        rerank_request({"model": "m", "query": "q", "documents": many})
    assert err.value.param == "documents"


def test_an_input_list_past_its_bound_is_refused_before_its_items_are_read() -> None:
    """Embeddings', /pooling's and /classify's ``input`` lists: past MAX_INPUTS a 400 from
    the length alone (the bad last item is never reached); one list of token ids is one
    input, however long."""
    from kiln.frontends.openai.classify import classify_request
    from kiln.frontends.openai.embeddings import MAX_INPUTS, embedding_request

    many: list[object] = ["a"] * MAX_INPUTS + [None]
    for parse in (embedding_request, classify_request):
        with pytest.raises(OpenAIError, match=f"holds {MAX_INPUTS + 1} inputs, more than") as err:
            parse({"model": "m", "input": many})
        assert err.value.param == "input"
    ids = embedding_request({"model": "m", "input": [7] * (MAX_INPUTS + 1)})
    assert ids.inputs == [[7] * (MAX_INPUTS + 1)]


def test_token_embed_answers_are_bounded_once_the_inputs_are_tokenized() -> None:
    """``token_embed`` answers tokens x hidden values: past MAX_TOKEN_VALUES a 400 naming
    ``input``, before anything is pooled."""
    from types import SimpleNamespace

    from kiln.frontends.openai.embeddings import MAX_TOKEN_VALUES, check_token_values

    args = SimpleNamespace(embedding_size=1024, token_labels=("O",) * 8)
    llm: Any = SimpleNamespace(engine=SimpleNamespace(args=args))
    fits = MAX_TOKEN_VALUES // 1024
    check_token_values(llm, [[1] * (fits // 2), [2] * (fits // 2)], "token_embed")
    with pytest.raises(OpenAIError, match=r"would answer .* values") as err:
        check_token_values(llm, [[1] * (fits // 2), [2] * (fits // 2 + 1)], "token_embed")
    assert err.value.param == "input"
    # token_classify: tokens x labels (8 here), so 128 times the tokens fit
    check_token_values(llm, [[1] * (fits * 128)], "token_classify")
    with pytest.raises(OpenAIError, match="token_classify"):
        check_token_values(llm, [[1] * (fits * 128 + 1)], "token_classify")
