"""``/v1/embeddings``: OpenAI's request and answer, with vLLM's extra fields, for a model
served with ``runner: pooling`` (its vectors come from ``AsyncEngine.pool``); and vLLM's
``/pooling``, the same request (``task: embed``) answered in its pooling shape."""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from kiln.core.errors import KilnError
from kiln.frontends.openai.chat_input import (
    chat_messages,
    chat_template_options,
    with_server_kwargs,
)
from kiln.frontends.openai.content import content_text, for_template
from kiln.frontends.openai.protocol import (
    OpenAIError,
    body_request_id,
    check_fields,
    check_prompt_chars,
)
from kiln.frontends.openai.request_ids import request_id as answer_id
from kiln.llm.params import InvalidField, integer

if TYPE_CHECKING:  # importing the backend imports torch
    import torch

    from kiln.llm.engine_client import EngineClient

EMBEDDING_FIELDS = frozenset(
    (
        "model",
        "input",
        "encoding_format",
        "dimensions",
        "user",
        "truncate_prompt_tokens",
        "truncation_side",
        "padding",
        "request_id",
        "priority",
        "cache_salt",
        "normalize",
        "use_activation",
        "add_special_tokens",
        "embed_dtype",
        "endianness",
        # vLLM's chat form: ``messages`` rendered by the chat template, one input
        "messages",
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "documents",
    )
)
#: vLLM's /pooling: the embeddings fields and the pooling task (kiln's models embed)
POOLING_FIELDS = EMBEDDING_FIELDS | {"task"}
ENCODING_FORMATS = ("float", "base64")
EMBED_DTYPES = ("float32", "float16", "bfloat16")
ENDIANNESS = ("native", "little", "big")


#: vLLM's ``/pooling`` tasks kiln serves: one vector an input (``embed``), a classifier's
#: probabilities (``classify``), every token's vector (``token_embed``), a token
#: classifier's probabilities for every token (``token_classify``)
POOLING_TASKS = ("embed", "classify", "token_embed", "token_classify")
#: the tasks whose answer holds a row for every token
TOKEN_TASKS = ("token_embed", "token_classify")
#: ``token_embed``: the most values (tokens x hidden) one answer may hold, checked once the
#: inputs are tokenized (64 MB of float32; ~8x that as JSON text)
MAX_TOKEN_VALUES = 1 << 24
#: inputs one request may list, checked before any is read (OpenAI's embeddings bound: 2,048
#: per request; vLLM's queue is the only bound there, kiln's too once the model is known)
MAX_INPUTS = 4096


@dataclass(slots=True)
class EmbeddingRequest:
    model: str
    #: text or token ids, one vector each
    inputs: list[str | list[int]]
    encoding_format: str = "float"
    embed_dtype: str = "float32"
    endianness: str = "native"
    dimensions: int | None = None
    #: None: the model's ``pooler_config`` decides (vLLM's default: true)
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = None
    #: which end ``truncate_prompt_tokens`` keeps: ``left`` cuts the start (vLLM's default)
    truncation_side: str = "left"
    request_id: str | None = None
    priority: int = 0
    #: vLLM's chat form: the messages and the template's options (``inputs`` is empty)
    messages: list[dict[str, Any]] | None = None
    template: dict[str, Any] | None = None
    #: the tokenizer's special tokens (BOS) are added to a text input (vLLM's field)
    add_special_tokens: bool = True
    #: asked through vLLM's ``/pooling`` (its answer's shape and its API's name)
    pooling: bool = False
    #: ``/pooling``'s ``task``: ``embed``, ``classify``, ``token_embed``,
    #: ``token_classify`` (None: the model's own)
    task: str | None = None


def _choice(body: dict[str, Any], key: str, allowed: tuple[str, ...], default: str) -> str:
    value = body.get(key)
    if value is None:
        return default
    if value not in allowed:
        raise OpenAIError(
            f"'{key}' must be one of {', '.join(allowed)} (kiln serves these), got {value!r}",
            param=key,
        )
    return str(value)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    )


def inputs_field(body: dict[str, Any]) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of strings, token ids, or a list of token-id
    lists; each one non-empty. A list is bounded by its length before its items are read
    (each model's queue bounds it again once the model is known)."""
    raw = body.get("input")
    if isinstance(raw, list) and len(raw) > MAX_INPUTS and not _is_ids(raw):
        raise OpenAIError(f"'input' holds {len(raw)} inputs, more than {MAX_INPUTS}", param="input")
    if isinstance(raw, str) or (_is_ids(raw) and raw):
        items: list[Any] = [raw]
    elif isinstance(raw, list) and raw:
        items = raw
    else:
        raise OpenAIError(
            "'input' must be a non-empty string, a list of strings, a list of token ids, or "
            "a list of token-id lists",
            param="input",
        )
    for i, item in enumerate(items):
        if not (isinstance(item, str) or _is_ids(item)) or not item:
            where = "'input'" if len(items) == 1 else f"input[{i}]"
            raise OpenAIError(
                f"{where} must be a non-empty string or a non-empty list of token ids",
                param="input",
            )
    return items


def _flag(body: dict[str, Any], key: str) -> bool | None:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise OpenAIError(f"'{key}' must be a boolean, got {value!r}", param=key)
    return value


def embedding_request(body: dict[str, Any], pooling: bool = False) -> EmbeddingRequest:
    """``pooling``: vLLM's ``/pooling`` request, whose ``task`` must be ``embed`` (the one
    task kiln's pooling models serve) when sent."""
    check_fields(body, POOLING_FIELDS if pooling else EMBEDDING_FIELDS, "embeddings")
    task = body.get("task") if pooling else None
    if task not in (None, *POOLING_TASKS):
        raise OpenAIError(
            f"'task' must be one of {', '.join(POOLING_TASKS)} (the pooling tasks kiln "
            f"serves), got {str(task)[:80]!r}",
            param="task",
        )
    if task in TOKEN_TASKS and body.get("encoding_format", "float") != "float":
        raise OpenAIError(
            f"task '{task}' answers each input's token rows as nested lists: "
            "'encoding_format' must be 'float'",
            param="encoding_format",
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    messages = template = None
    if "messages" in body:
        if "input" in body:
            raise OpenAIError("send 'input' or 'messages', not both", param="messages")
        messages = chat_messages(body)
        # vLLM's chat embedding: no generation prompt unless asked for
        template = chat_template_options(
            {**body, "add_generation_prompt": body.get("add_generation_prompt", False)}
        )
        inputs: list[str | list[int]] = []
    else:
        inputs = inputs_field(body)
    try:
        dimensions = integer(body, "dimensions")
        truncate = integer(body, "truncate_prompt_tokens")
        priority = integer(body, "priority") or 0
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if dimensions is not None and dimensions < 1:
        raise OpenAIError(f"dimensions must be at least 1, got {dimensions}", param="dimensions")
    check_truncate(truncate)
    # vLLM's newer name for normalize: both may come, and must then agree
    normalize, activation = _flag(body, "normalize"), _flag(body, "use_activation")
    if normalize is not None and activation is not None and normalize != activation:
        raise OpenAIError(
            "'normalize' and 'use_activation' disagree: send one", param="use_activation"
        )
    _choice(body, "padding", ("do_not_pad",), "do_not_pad")
    salt = body.get("cache_salt")  # pooling reads no prefix cache: nothing for it to salt
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise OpenAIError("'cache_salt' must be a non-empty string", param="cache_salt")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise OpenAIError("'user' must be a string", param="user")
    request_id = body_request_id(body)
    return EmbeddingRequest(
        model=model,
        inputs=inputs,
        encoding_format=_choice(body, "encoding_format", ENCODING_FORMATS, "float"),
        embed_dtype=_choice(body, "embed_dtype", EMBED_DTYPES, "float32"),
        endianness=_choice(body, "endianness", ENDIANNESS, "native"),
        dimensions=dimensions,
        normalize=normalize if normalize is not None else activation,
        truncate_prompt_tokens=truncate,
        truncation_side=_choice(body, "truncation_side", ("left", "right"), "left"),
        request_id=request_id,
        priority=priority,
        messages=messages,
        template=template,
        # vLLM's: BOS for a text input, none on top of a chat template's own
        add_special_tokens=_flag(body, "add_special_tokens") is not False
        if messages is None
        else bool(_flag(body, "add_special_tokens")),
        pooling=pooling,
        task=task,
    )


def check_token_values(llm: EngineClient, prompts: list[list[int]], task: str) -> None:
    """A token task's answer (every token's vector or label probabilities) stays within
    ``MAX_TOKEN_VALUES``."""
    args = llm.engine.args
    width = len(args.token_labels) if task == "token_classify" else args.embedding_size
    values = sum(len(p) for p in prompts) * width
    if values > MAX_TOKEN_VALUES:
        raise OpenAIError(
            f"task '{task}' would answer {values} values (tokens x row width), more "
            f"than {MAX_TOKEN_VALUES}: send fewer or shorter inputs",
            param="input",
        )


def check_model(llm: EngineClient, req: EmbeddingRequest) -> None:
    """What the model decides, before any tokenizing: it pools, ``dimensions`` fits it,
    and the inputs are few and short enough to be worth reading."""
    config, args = llm.engine.config, llm.engine.args
    check_pools(llm, req.model, "Pooling" if req.pooling else "Embeddings", "embeddings")
    if req.dimensions is not None:
        if not args.is_matryoshka:
            raise OpenAIError(
                f"Model '{req.model}' does not support matryoshka representation, changing "
                "output dimensions will lead to poor results",
                param="dimensions",
            )
        allowed = args.matryoshka_dimensions
        if allowed is not None and req.dimensions not in allowed:
            raise OpenAIError(
                f"Model '{req.model}' only supports {list(allowed)} matryoshka dimensions",
                param="dimensions",
            )
        if req.dimensions > args.embedding_size:
            raise OpenAIError(
                f"dimensions ({req.dimensions}) is more than the model's {args.embedding_size}",
                param="dimensions",
            )
    check_queue(llm, req.priority, len(req.inputs), "'input' holds {} inputs", "input")
    limit = config.max_model_len
    if req.messages is not None:
        chars = sum(len(content_text(m["content"])) for m in req.messages)
        check_prompt_chars(chars, limit, "messages")
    for item in req.inputs:
        if isinstance(item, str):
            check_prompt_chars(len(item), limit, "input")
        elif req.truncate_prompt_tokens is None and len(item) > limit:
            raise _too_long(limit, len(item))


def check_pools(
    llm: EngineClient, model: str, api: str, serves: str, cross_encoder: bool = False
) -> None:
    """The model is served with ``runner: pooling`` (vLLM's answer names the ``api``), and
    is no classifier, or (``cross_encoder``: score and rerank) a one-class one."""
    if llm.engine.config.runner != "pooling":
        raise OpenAIError(
            f"The model '{model}' does not support {api} API: it is served for generation "
            f"(set its parameter runner to 'pooling' to serve {serves})",
            param="model",
        )
    if llm.engine.args.is_token_classifier:
        raise OpenAIError(
            f"The model '{model}' does not support {api} API: it is a token classifier, "
            "whose answers are on /pooling with task 'token_classify'",
            param="model",
        )
    labels = llm.engine.args.num_labels
    if labels and not (cross_encoder and labels == 1):
        also = " (a one-class classifier also scores pairs of texts)" if cross_encoder else ""
        raise OpenAIError(
            f"The model '{model}' does not support {api} API: it is a sequence classifier "
            f"of {labels} classes, whose answers are on /classify{also}",
            param="model",
        )


def check_queue(llm: EngineClient, priority: int, count: int, what: str, param: str) -> None:
    """``priority`` is one the engine takes, and ``count`` pooled inputs fit its queue
    (``what``: the message's start, ``{}`` the count)."""
    try:
        llm.engine.check_priority(priority)
    except KilnError as exc:
        raise OpenAIError(str(exc), param="priority") from None
    config = llm.engine.config
    most = config.max_waiting + config.max_num_seqs
    if count > most:
        raise OpenAIError(
            f"{what.format(count)}, more than the model queues at once ({most})", param=param
        )


def pooling_fields(body: dict[str, Any]) -> dict[str, Any]:
    """A score, rerank or classify body's common fields, checked: ``model``,
    ``truncate_prompt_tokens``, ``priority``, ``request_id``; vLLM's activation flags must
    be booleans."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    try:
        truncate = integer(body, "truncate_prompt_tokens")
        priority = integer(body, "priority") or 0
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    check_truncate(truncate)
    for key in ("use_activation", "activation", "softmax"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise OpenAIError(f"'{key}' must be a boolean, got {body[key]!r}", param=key)
    request_id = body_request_id(body)
    return {
        "model": model,
        "truncate_prompt_tokens": truncate,
        "priority": priority,
        "request_id": request_id,
    }


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """A pooling answer's ``usage`` (vLLM's: the inputs' tokens, nothing generated)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }


def _too_long(limit: int, tokens: int) -> OpenAIError:
    return OpenAIError(
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{tokens} tokens in the input for embedding generation. Please reduce the length "
        "of the input.",
        param="input",
        code="context_length_exceeded",
    )


def check_truncate(truncate: int | None) -> None:
    """vLLM's ``truncate_prompt_tokens`` of a pooling request: N >= 1, or -1 (the context)."""
    if truncate is not None and truncate < 1 and truncate != -1:
        raise OpenAIError(
            f"truncate_prompt_tokens must be >= 1 (or -1: the model's context), got {truncate}",
            param="truncate_prompt_tokens",
        )


def kept_tokens(truncate: int | None, limit: int) -> int | None:
    """How many of an input's last tokens ``truncate_prompt_tokens`` keeps (None: all)."""
    if truncate is None:
        return None
    keep = limit if truncate == -1 else truncate
    if keep > limit:
        raise OpenAIError(
            f"truncate_prompt_tokens ({keep}) is greater than max_model_len ({limit})",
            param="truncate_prompt_tokens",
        )
    return keep


def token_ids(llm: EngineClient, req: EmbeddingRequest) -> list[list[int]]:
    """Each input's token ids, truncated as asked and checked against the context and the
    vocabulary. On a worker thread: tokenizing takes time in proportion to the text."""
    limit = llm.engine.config.max_model_len
    vocab = llm.engine.args.vocab_size
    keep = kept_tokens(req.truncate_prompt_tokens, limit)
    inputs = req.inputs
    if req.messages is not None:
        assert req.template is not None
        template = with_server_kwargs(llm, req.template)
        messages = for_template(llm, req.messages, template)
        inputs = [llm.tokenizer.apply_chat_template(messages, **template)]
        # what the template added (tools, documents, its variables) counts too
        check_prompt_chars(len(inputs[0]), limit, "messages")
    out = []
    for item in inputs:
        if isinstance(item, list):
            if any(not 0 <= t < vocab for t in item):
                raise OpenAIError(f"input token ids must be in [0, {vocab})", param="input")
            ids = item
        else:
            ids = llm.tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
        if keep is not None:
            ids = ids[-keep:] if req.truncation_side == "left" else ids[:keep]
        if not ids:
            raise OpenAIError("an input has no tokens", param="input")
        if len(ids) > limit:
            raise _too_long(limit, len(ids))
        out.append(ids)
    return out


def _base64(vector: torch.Tensor, dtype: str, endianness: str) -> str:
    import torch

    cast = vector.to(getattr(torch, dtype))
    if dtype == "bfloat16":  # numpy has no bfloat16: its bits as 16-bit integers
        cast = cast.view(torch.int16)
    array = cast.numpy()
    if endianness != "native":
        array = array.astype(array.dtype.newbyteorder("<" if endianness == "little" else ">"))
    return base64.b64encode(array.tobytes()).decode()


def response_body(
    llm: EngineClient, req: EmbeddingRequest, vectors: list[torch.Tensor], prompt_tokens: int
) -> bytes:
    """The answer, as JSON bytes. On a worker thread: encoding is in proportion to the
    vectors."""
    import torch

    from kiln.llm.pooling import finish

    normalize = req.normalize
    if normalize is None:
        normalize = llm.engine.config.pooler_config.normalize is not False
    if req.task == "token_embed":  # every token's vector, each normalized alone
        stacked: Any = [finish(v, req.dimensions, normalize) for v in vectors]
    else:
        stacked = finish(torch.stack(vectors), req.dimensions, normalize)
    data = []
    for index, vector in enumerate(stacked):
        embedding: Any = (
            vector.numpy()
            if req.encoding_format == "float"
            else _base64(vector, req.embed_dtype, req.endianness)
        )
        if req.pooling:
            data.append({"index": index, "object": "pooling", "data": embedding})
        else:
            data.append({"index": index, "object": "embedding", "embedding": embedding})
    body = list_body(req, "pool" if req.pooling else "embd", data, prompt_tokens)
    return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)


def list_body(
    req: EmbeddingRequest, prefix: str, data: list[Any], prompt_tokens: int
) -> dict[str, Any]:
    """A pooling answer's body (vLLM's: embeddings, pooling, classification)."""
    return {
        "id": f"{prefix}-{answer_id(req.request_id)}",
        "object": "list",
        "created": int(time.time()),
        "model": req.model,
        "data": data,
        "usage": pooling_usage(prompt_tokens),
    }
