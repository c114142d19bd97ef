"""vLLM's ``POST /generative_scoring``: how likely a generative model's next token is each of
a few label tokens, after a query joined to each item (a yes/no judge, a classifier by
prompt). One engine step per item (``max_tokens`` 1) whose logprobs are read for the
labels only (``logprob_token_ids``); the score is the first label's probability, softmaxed
over the labels (``apply_softmax``, the default) or the model's own.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.frontends.openai.generation_fields import MAX_LOGPROB_TOKEN_IDS
from kiln.frontends.openai.protocol import OpenAIError, body_request_id, check_prompt_chars, flag
from kiln.llm.params import InvalidField, integer

if TYPE_CHECKING:
    from kiln.llm.engine_client import EngineClient

FIELDS = frozenset({"model", "query", "items", "label_token_ids", "apply_softmax", "item_first",
                    "add_special_tokens", "cache_salt", "priority", "request_id"})  # fmt: skip
#: items one request may score (as the embeddings' inputs)
MAX_ITEMS = 4096


@dataclass(slots=True)
class ScoringRequest:
    model: str
    query: str | list[int]
    items: list[str] | list[list[int]]
    labels: list[int]
    apply_softmax: bool
    item_first: bool
    add_special_tokens: bool
    cache_salt: str | None
    priority: int
    request_id: str | None


def _ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int and t >= 0 for t in value)


def read(body: dict[str, Any]) -> ScoringRequest:
    """The request, checked before anything is tokenized."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    query = body.get("query")
    if not isinstance(query, str) and not (_ids(query) and query):
        raise OpenAIError("'query' must be a string or a list of token ids", param="query")
    items = body.get("items")
    if not isinstance(items, list) or not items:
        raise OpenAIError("items must contain at least one item.", param="items")
    if len(items) > MAX_ITEMS:
        raise OpenAIError(f"'items' holds {len(items)} items, more than {MAX_ITEMS}", param="items")
    texts = all(isinstance(i, str) for i in items)
    if not texts and not all(_ids(i) and i for i in items):
        raise OpenAIError("'items' must be all strings or all lists of token ids", param="items")
    labels = body.get("label_token_ids")
    if not _ids(labels) or not labels:
        raise OpenAIError(
            "label_token_ids must contain at least one token ID.", param="label_token_ids"
        )
    if len(labels) > MAX_LOGPROB_TOKEN_IDS:
        raise OpenAIError(
            f"'label_token_ids' holds {len(labels)} ids, more than {MAX_LOGPROB_TOKEN_IDS}",
            param="label_token_ids",
        )
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise OpenAIError("'cache_salt' must be a non-empty string", param="cache_salt")
    request_id = body_request_id(body)
    try:
        priority = integer(body, "priority") or 0
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    return ScoringRequest(
        model, query, items, labels, flag(body, "apply_softmax", True),
        flag(body, "item_first", False), flag(body, "add_special_tokens", True), salt,
        priority, request_id,
    )  # fmt: skip


def prompts(llm: EngineClient, req: ScoringRequest) -> list[list[int]]:
    """Each item's prompt: the query's tokens and the item's (the item first with
    ``item_first``), cut to leave room for the one token scored. On a worker thread."""
    vocab = llm.vocab_size
    outside = [t for t in req.labels if t >= vocab]
    if outside:
        raise OpenAIError(
            f"label_token_id {outside[0]} is out of vocabulary range [0, {vocab}). Please "
            "provide valid token IDs.",
            param="label_token_ids",
        )
    limit = llm.max_model_len
    encode = llm.tokenizer.encode
    if isinstance(req.query, str):
        check_prompt_chars(len(req.query), limit, "query")
        query = encode(req.query, req.add_special_tokens)
    else:
        query = req.query
    out = []
    for item in req.items:
        if isinstance(item, str):
            check_prompt_chars(len(item), limit, "items")
            ids = encode(item, False)  # no second BOS
        else:
            ids = item
        out.append((ids + query if req.item_first else query + ids)[: limit - 1])
    return out


def score(label_logprobs: list[float], apply_softmax: bool) -> float:
    """The first label's probability: softmaxed over the labels, or the model's own."""
    if not apply_softmax:
        return math.exp(label_logprobs[0])
    top = max(label_logprobs)
    weights = [math.exp(lp - top) for lp in label_logprobs]
    return weights[0] / sum(weights)


def body(
    rid: str, model: str, scores: list[float], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    return {
        "id": rid, "object": "list", "created": int(time.time()), "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": prompt_tokens,
                  "total_tokens": prompt_tokens + completion_tokens,
                  "completion_tokens": completion_tokens},
    }  # fmt: skip
