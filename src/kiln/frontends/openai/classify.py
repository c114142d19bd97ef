"""vLLM's classification API (``/classify``) for a sequence classifier
(``*ForSequenceClassification``: a decoder with a ``score`` head on its last token): each
input's class probabilities (the softmax of its logits; a one-class model's sigmoid) and
the label of the likeliest class; and ``/pooling``'s ``token_classify`` for a token
classifier (``*ForTokenClassification``): every token's label probabilities."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kiln.frontends.openai.embeddings import (
    EmbeddingRequest,
    check_queue,
    inputs_field,
    list_body,
    pooling_fields,
)
from kiln.frontends.openai.protocol import OpenAIError, check_fields, check_prompt_chars

if TYPE_CHECKING:  # importing the backend imports torch
    import torch

    from kiln.llm.engine_client import EngineClient

CLASSIFY_FIELDS = frozenset(
    (
        "model",
        "input",
        "truncate_prompt_tokens",
        "priority",
        "request_id",
        "user",
        "add_special_tokens",
        "use_activation",
        "activation",  # vLLM's older name of use_activation
    )
)


def _activation(body: dict[str, Any]) -> bool:
    """``use_activation`` (or its older name ``activation``): false answers the raw logits."""
    values = [body.get("use_activation"), body.get("activation")]  # booleans (pooling_fields)
    use, old = values
    if use is not None and old is not None and use != old:
        raise OpenAIError(
            "'use_activation' and 'activation' disagree: send one", param="activation"
        )
    return False not in values


def classify_request(body: dict[str, Any]) -> tuple[EmbeddingRequest, bool]:
    """The request (its inputs, read as an embeddings request's) and whether the answer's
    ``probs`` are probabilities (true) or the raw logits."""
    check_fields(body, CLASSIFY_FIELDS, "classify")
    common = pooling_fields(body)
    inputs = inputs_field(body)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError("'user' must be a string", param="user")
    special = body.get("add_special_tokens", True)
    if not isinstance(special, bool):
        raise OpenAIError(
            f"'add_special_tokens' must be a boolean, got {special!r}", param="add_special_tokens"
        )
    req = EmbeddingRequest(inputs=inputs, add_special_tokens=special, **common)
    return req, _activation(body)


def check_model(llm: EngineClient, req: EmbeddingRequest) -> None:
    """The model is a sequence classifier, and the inputs are few and short enough to be
    worth reading."""
    if not llm.engine.args.num_labels:
        raise OpenAIError(
            f"The model '{req.model}' does not support Classification API: it is not a "
            "sequence classifier (a *ForSequenceClassification checkpoint)",
            param="model",
        )
    check_queue(llm, req.priority, len(req.inputs), "'input' holds {} inputs", "input")
    for item in req.inputs:
        if isinstance(item, str):
            check_prompt_chars(len(item), llm.engine.config.max_model_len, "input")


def probabilities(llm: EngineClient, logits: list[torch.Tensor], activation: bool) -> torch.Tensor:
    """Each input's class probabilities (softmax; a one-class model's sigmoid), or with
    ``activation`` false its raw logits."""
    import torch

    stacked = torch.stack(logits)
    if not activation:
        return stacked
    return stacked.sigmoid() if llm.engine.args.num_labels == 1 else stacked.softmax(-1)


def response_body(
    llm: EngineClient, req: EmbeddingRequest, logits: list[torch.Tensor], prompt_tokens: int,
    activation: bool,
) -> dict[str, Any]:  # fmt: skip
    labels = llm.engine.args.labels
    data = [
        {
            "index": index,
            "label": labels[int(row.argmax())],
            "probs": row.tolist(),
            "num_classes": len(labels),
        }
        for index, row in enumerate(probabilities(llm, logits, activation))
    ]
    return list_body(req, "classify", data, prompt_tokens)


def check_token_classifier(llm: EngineClient, req: EmbeddingRequest) -> None:
    """vLLM's ``token_classify``: the model labels every token, and the inputs are few and
    short enough to be worth reading."""
    if not llm.engine.args.is_token_classifier:
        raise OpenAIError(
            f"The model '{req.model}' does not support task 'token_classify': it is not a "
            "token classifier (a *ForTokenClassification checkpoint)",
            param="task",
        )
    if llm.engine.config.runner != "pooling":
        raise OpenAIError(f"The model '{req.model}' is served for generation", param="model")
    check_queue(llm, req.priority, len(req.inputs), "'input' holds {} inputs", "input")
    for item in req.inputs:
        if isinstance(item, str):
            check_prompt_chars(len(item), llm.engine.config.max_model_len, "input")


def token_pooling_body(
    llm: EngineClient, req: EmbeddingRequest, logits: list[torch.Tensor], prompt_tokens: int
) -> bytes:
    """vLLM's ``/pooling`` of a token classifier: each input's rows, one a token, of label
    probabilities (softmax; a one-label model's sigmoid; ``use_activation: false``: the
    logits), as JSON bytes. On a worker thread: in proportion to the tokens."""
    import orjson

    one = len(llm.engine.args.token_labels) == 1
    data = []
    for index, rows in enumerate(logits):
        if req.normalize is not False:
            rows = rows.sigmoid() if one else rows.softmax(-1)
        data.append({"index": index, "object": "pooling", "data": rows.numpy()})
    body = list_body(req, "pool", data, prompt_tokens)
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def pooling_body(
    llm: EngineClient, req: EmbeddingRequest, logits: list[torch.Tensor], prompt_tokens: int
) -> dict[str, Any]:
    """vLLM's ``/pooling`` of a classifier (``task: classify``): each input's
    probabilities as its ``data`` (``use_activation: false``: its logits)."""
    rows = probabilities(llm, logits, req.normalize is not False)
    data = [{"index": i, "object": "pooling", "data": row.tolist()} for i, row in enumerate(rows)]
    return list_body(req, "pool", data, prompt_tokens)
