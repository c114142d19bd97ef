"""Cohere's ``POST /v2/embed``, as vLLM serves it: ``texts`` embedded by a pooling model,
answered ``embeddings_by_type``.

``input_type`` puts the model's prefix for that task before each text (its
``task_instructions``, or its sentence-transformers ``prompts``); ``truncate`` ``START`` /
``END`` cut a text's start / end to ``max_tokens`` (default: the model's length), ``NONE``
refuses a longer one; ``output_dimension`` is the embeddings' ``dimensions``;
``embedding_types`` any of ``float``, ``binary`` (8 dimensions a byte, signed), ``ubinary``
(unsigned), ``base64`` (little-endian float32). kiln serves text: ``images`` and
``inputs`` are refused.
"""

from __future__ import annotations

import base64
import logging
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.frontends.openai.embeddings import MAX_INPUTS, EmbeddingRequest
from kiln.frontends.openai.protocol import OpenAIError
from kiln.llm.params import InvalidField, integer

if TYPE_CHECKING:
    from kiln.llm.engine_client import EngineClient

log = logging.getLogger(__name__)

FIELDS = frozenset({"model", "input_type", "texts", "images", "inputs", "output_dimension",
                    "embedding_types", "truncate", "max_tokens", "priority"})  # fmt: skip
TYPES = ("float", "binary", "ubinary", "base64")
TRUNCATE = ("NONE", "START", "END")
_WARNED: set[str] = set()


@dataclass(slots=True)
class CohereEmbed:
    model: str | None
    texts: list[str]
    input_type: str | None
    output_dimension: int | None
    types: list[str]
    truncate: str
    max_tokens: int | None
    priority: int


def read(body: dict[str, Any]) -> CohereEmbed:
    """The request, checked before anything is tokenized."""
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise OpenAIError("'model' must be a string", param="model")
    for kind in ("images", "inputs"):
        if body.get(kind) is not None:
            raise OpenAIError(f"kiln serves text: send 'texts', not '{kind}'", param=kind)
    texts = body.get("texts")
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise OpenAIError(
            "Exactly one of texts, images, or inputs must be provided, and it must be "
            "non-empty: kiln takes 'texts', a list of strings",
            param="texts",
        )
    if len(texts) > MAX_INPUTS:
        raise OpenAIError(
            f"'texts' holds {len(texts)} texts, more than {MAX_INPUTS}", param="texts"
        )
    input_type = body.get("input_type")
    if input_type is not None and not isinstance(input_type, str):
        raise OpenAIError("'input_type' must be a string", param="input_type")
    types = body.get("embedding_types") or ["float"]
    if not isinstance(types, list) or not all(t in TYPES for t in types):
        raise OpenAIError(
            f"'embedding_types' must be a list of {', '.join(TYPES)}", param="embedding_types"
        )
    truncate = body.get("truncate", "END")
    if truncate not in TRUNCATE:
        raise OpenAIError(f"'truncate' must be one of {', '.join(TRUNCATE)}", param="truncate")
    try:
        dimension = integer(body, "output_dimension")
        max_tokens = integer(body, "max_tokens")
        priority = integer(body, "priority") or 0
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if dimension is not None and dimension < 1:
        raise OpenAIError("output_dimension must be at least 1", param="output_dimension")
    if max_tokens is not None and max_tokens < 1:
        raise OpenAIError("max_tokens must be at least 1", param="max_tokens")
    return CohereEmbed(model, texts, input_type, dimension, list(dict.fromkeys(types)),
                       truncate, max_tokens, priority)  # fmt: skip


def embedding_request(llm: EngineClient, req: CohereEmbed, model: str) -> EmbeddingRequest:
    """The embeddings request it is: the texts with the task's prefix, truncated as asked."""
    texts = req.texts
    if req.input_type is not None:
        known = llm.task_instructions
        if known:
            if req.input_type not in known:
                raise OpenAIError(
                    f"Unsupported input_type {req.input_type!r}. Supported values: "
                    f"{', '.join(sorted(known))}",
                    param="input_type",
                )
            texts = [known[req.input_type] + t for t in texts]
        elif model not in _WARNED and len(_WARNED) < 256:
            # Cohere's client always sends one: without prefixes it asks for nothing
            _WARNED.add(model)
            log.info("model '%s' defines no input_type prefixes: input_type ignored", model)
    truncate: int | None = None
    side = "left"
    if req.truncate == "START":
        truncate = req.max_tokens or -1
    elif req.truncate == "END":
        truncate, side = req.max_tokens or -1, "right"
    return EmbeddingRequest(
        model=model, inputs=list(texts), dimensions=req.output_dimension,
        truncate_prompt_tokens=truncate, truncation_side=side, priority=req.priority,
    )  # fmt: skip


def check_lengths(req: CohereEmbed, prompts: list[list[int]]) -> None:
    """``truncate: NONE`` with ``max_tokens``: a longer text is refused, not cut."""
    if req.truncate != "NONE" or req.max_tokens is None:
        return
    for i, ids in enumerate(prompts):
        if len(ids) > req.max_tokens:
            raise OpenAIError(
                f"texts[{i}] has {len(ids)} tokens, more than max_tokens ({req.max_tokens}), "
                "and truncate is NONE",
                param="max_tokens",
            )


def by_type(vectors: np.ndarray, types: list[str]) -> dict[str, Any]:
    """The ``embeddings`` object: each type asked for, from the float vectors [n, d]."""
    out: dict[str, Any] = {}
    floats = vectors.astype(np.float32)
    for kind in types:
        if kind == "float":
            out["float"] = floats.tolist()
        elif kind == "base64":
            little = floats.astype("<f4")
            out["base64"] = [base64.b64encode(row.tobytes()).decode() for row in little]
        else:
            if floats.shape[1] % 8:
                raise OpenAIError(
                    f"Embedding dimension must be a multiple of 8 for binary embedding "
                    f"types, but got {floats.shape[1]}.",
                    param="embedding_types",
                )
            packed = np.packbits(floats >= 0, axis=-1)  # MSB first, 8 dimensions a byte
            signed = kind == "binary"
            out[kind] = (packed.astype(np.int16) - 128 if signed else packed).tolist()
    return out


def answer(
    llm: EngineClient, req: CohereEmbed, embed: EmbeddingRequest, vectors: list[Any],
    prompt_tokens: int,
) -> bytes:  # fmt: skip
    """The answer as JSON bytes (the vectors cut to ``dimensions`` and normalized as the
    embeddings API's). On a worker thread: in proportion to the vectors."""
    import orjson
    import torch

    from kiln.llm.pooling import finish

    normalize = llm.engine.config.pooler_config.normalize is not False
    stacked = finish(torch.stack(vectors), embed.dimensions, normalize).numpy()
    return orjson.dumps(body(req, stacked, prompt_tokens))


def body(req: CohereEmbed, vectors: np.ndarray, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"embd-{uuid.uuid4().hex}",
        "embeddings": by_type(vectors, req.types),
        "texts": req.texts,
        "meta": {"api_version": {"version": "2"},
                 "billed_units": {"input_tokens": prompt_tokens, "image_tokens": 0}},
        "response_type": "embeddings_by_type",
    }  # fmt: skip
