"""vLLM's score and rerank APIs (``/score``, ``/rerank`` and their ``/v1``, ``/v2``
aliases) for a model served with ``runner: pooling``. An embedding model scores as vLLM's
bi-encoder path does: each text is embedded once and a pair's score is the cosine of its two
vectors. A one-class sequence classifier is a cross-encoder, as in vLLM: each pair is one
input (the tokenizer's pair template) and its score the sigmoid of the classifier's
logit."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.frontends.openai.embeddings import (
    check_pools,
    check_queue,
    kept_tokens,
    pooling_fields,
    pooling_usage,
)
from kiln.frontends.openai.protocol import OpenAIError, check_fields, check_prompt_chars
from kiln.frontends.openai.request_ids import request_id as answer_id
from kiln.llm.params import InvalidField, integer

if TYPE_CHECKING:  # importing the backend imports torch
    import torch

    from kiln.llm.engine_client import EngineClient

_COMMON = (
    "model",
    "truncate_prompt_tokens",
    "priority",
    "request_id",
    "use_activation",
    "activation",
    "softmax",
    "user",
)
#: texts one request may hold, checked before any of them is read (each model's queue,
#: ``max_num_seqs + max_waiting``, bounds them again once the model is known)
MAX_TEXTS = 4096
SCORE_FIELDS = frozenset((*_COMMON, "text_1", "text_2", "data_1", "data_2"))
RERANK_FIELDS = frozenset((*_COMMON, "query", "documents", "top_n"))


@dataclass(slots=True)
class ScoreRequest:
    model: str
    #: the left texts (one: paired with every right text) and the right texts
    left: list[str]
    right: list[str]
    #: the request's field names for the two sides, for errors
    names: tuple[str, str]
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    request_id: str | None = None
    #: rerank: how many of the best to answer (0: all)
    top_n: int = 0


def _bounded(items: list[Any], field: str) -> None:
    if len(items) > MAX_TEXTS:
        raise OpenAIError(f"'{field}' holds {len(items)} texts, more than {MAX_TEXTS}", param=field)


def _texts(value: Any, field: str, one: bool = False) -> list[str]:
    """A non-empty string, or (unless ``one``) a non-empty list of them."""
    if isinstance(value, str) and value:
        return [value]
    if not one and isinstance(value, list) and value:
        _bounded(value, field)
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise OpenAIError(f"{field}[{i}] must be a non-empty string", param=field)
        return value
    kind = "a non-empty string" if one else "a non-empty string or a non-empty list of them"
    raise OpenAIError(f"'{field}' must be {kind}", param=field)


def _documents(value: Any) -> list[str]:
    """Rerank ``documents``: strings, or Jina's and Cohere's ``{"text": ...}`` objects."""
    if not isinstance(value, list) or not value:
        raise OpenAIError("'documents' must be a non-empty list of strings", param="documents")
    _bounded(value, "documents")
    out = []
    for i, item in enumerate(value):
        text = item.get("text") if isinstance(item, dict) else item
        if not isinstance(text, str) or not text:
            raise OpenAIError(
                f"documents[{i}] must be a non-empty string (or an object with a non-empty 'text')",
                param="documents",
            )
        out.append(text)
    return out


def _side(body: dict[str, Any], name: str, alias: str) -> tuple[Any, str]:
    """vLLM's ``text_1`` / ``text_2``, or their newer names ``data_1`` / ``data_2``."""
    if name in body and alias in body:
        raise OpenAIError(f"send '{name}' or '{alias}', not both", param=alias)
    return (body[alias], alias) if alias in body else (body.get(name), name)


def score_request(body: dict[str, Any]) -> ScoreRequest:
    check_fields(body, SCORE_FIELDS, "score")
    common = pooling_fields(body)
    raw_left, left_name = _side(body, "text_1", "data_1")
    raw_right, right_name = _side(body, "text_2", "data_2")
    left, right = _texts(raw_left, left_name), _texts(raw_right, right_name)
    if len(left) != 1 and len(left) != len(right):
        raise OpenAIError(
            f"Input lengths must be either 1:1, 1:N or N:N, got {len(left)} '{left_name}' "
            f"and {len(right)} '{right_name}'",
            param=right_name,
        )
    return ScoreRequest(left=left, right=right, names=(left_name, right_name), **common)


def rerank_request(body: dict[str, Any]) -> ScoreRequest:
    check_fields(body, RERANK_FIELDS, "rerank")
    common = pooling_fields(body)
    try:
        top_n = integer(body, "top_n") or 0
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if top_n < 0:
        raise OpenAIError(f"top_n must be >= 0 (0: every document), got {top_n}", param="top_n")
    query = _texts(body.get("query"), "query", one=True)
    documents = _documents(body.get("documents"))
    return ScoreRequest(
        left=query, right=documents, names=("query", "documents"), top_n=top_n, **common
    )


def check_model(llm: EngineClient, req: ScoreRequest, api: str) -> None:
    """Before any tokenizing: the model pools, the texts are few enough to queue and each
    short enough to fit the context."""
    config = llm.engine.config
    check_pools(llm, req.model, api, "scores of its embeddings", cross_encoder=True)
    left, right = req.names
    if llm.engine.args.num_labels:  # a cross-encoder: one input a pair
        what, count = f"'{right}' holds {{}} texts to pair", len(req.right)
    else:
        what, count = f"'{left}' and '{right}' hold {{}} texts", len(req.left) + len(req.right)
    check_queue(llm, req.priority, count, what, right)
    for texts, name in zip((req.left, req.right), req.names, strict=True):
        for text in texts:
            check_prompt_chars(len(text), config.max_model_len, name)


def token_ids(llm: EngineClient, req: ScoreRequest) -> tuple[list[list[int]], list[list[int]]]:
    """Each text's token ids (BOS as for an embedding), truncated as asked. On a worker
    thread: tokenizing takes time in proportion to the text."""
    limit = llm.engine.config.max_model_len
    keep = kept_tokens(req.truncate_prompt_tokens, limit)
    sides = []
    for texts, name in zip((req.left, req.right), req.names, strict=True):
        side = []
        for text in texts:
            ids = llm.tokenizer.encode(text, add_special_tokens=True)
            if keep is not None:
                ids = ids[-keep:]
            if len(ids) > limit:
                raise OpenAIError(
                    f"This model's maximum context length is {limit} tokens. However, a "
                    f"text of '{name}' has {len(ids)} tokens. Please reduce its length.",
                    param=name,
                    code="context_length_exceeded",
                )
            side.append(ids)
        sides.append(side)
    return sides[0], sides[1]


def pair_ids(llm: EngineClient, req: ScoreRequest) -> list[list[int]]:
    """A cross-encoder's inputs: each pair's token ids by the tokenizer's pair template,
    the first ``truncate_prompt_tokens`` kept (the tokenizer's own truncation side). On a
    worker thread."""
    limit = llm.engine.config.max_model_len
    keep = kept_tokens(req.truncate_prompt_tokens, limit)
    pairs = []
    for i, right in enumerate(req.right):
        left = req.left[0 if len(req.left) == 1 else i]
        ids = llm.tokenizer.encode_pair(left, right, llm.engine.args.token_types)
        if keep is not None:
            ids = ids[:keep]
        if len(ids) > limit:
            raise OpenAIError(
                f"This model's maximum context length is {limit} tokens. However, pair {i} "
                f"has {len(ids)} tokens. Please reduce its length.",
                param=req.names[1],
                code="context_length_exceeded",
            )
        pairs.append(ids)
    return pairs


def cross_scores(logits: list[torch.Tensor]) -> list[float]:
    """A one-class classifier's score of each pair: its logit's sigmoid (vLLM's)."""
    return [float(row[0].sigmoid()) for row in logits]


def cosines(vectors: list[torch.Tensor], num_left: int) -> list[float]:
    """The score of each right text: the cosine of its vector with its left text's (the
    only one, or the one at its index)."""
    import torch
    import torch.nn.functional as F

    stacked = F.normalize(torch.stack(vectors).float(), dim=-1)
    left, right = stacked[:num_left], stacked[num_left:]
    if num_left == 1:
        left = left.expand_as(right)
    return [float(s) for s in (left * right).sum(-1)]


def pair_tokens(left: list[list[int]], right: list[list[int]]) -> int:
    """vLLM's count: each pair's two texts (a lone left text counted with every pair)."""
    return sum(len(left[0 if len(left) == 1 else i]) + len(r) for i, r in enumerate(right))


def score_body(req: ScoreRequest, scores: list[float], tokens: int) -> dict[str, Any]:
    """``tokens``: the prompt tokens the scores read."""
    return {
        "id": f"score-{answer_id(req.request_id)}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": pooling_usage(tokens),
    }


def rerank_body(req: ScoreRequest, scores: list[float], tokens: int) -> dict[str, Any]:
    """Jina's and Cohere's shape, as vLLM answers it: the documents best first, ``top_n``
    of them (0: all)."""
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    return {
        "id": f"rerank-{answer_id(req.request_id)}",
        "model": req.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [
            {"index": i, "document": {"text": req.right[i]}, "relevance_score": scores[i]}
            for i in order
        ],
    }
