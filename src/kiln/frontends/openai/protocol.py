"""OpenAI's error shape and the request fields kiln knows: the tables of each endpoint's
fields, the unsupported ones (:data:`UNSUPPORTED_FIELDS`), and the checks every endpoint
shares (``flag``, ``request_id``, a prompt's length in characters, ``/detokenize``'s ids).

Only translation lives here: the engine enforces the context length and the queue bound.
A generation's fields are read in ``generation_fields`` and ``generation_request``, a chat
request's messages and template options in ``chat_input``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.frontends.openai.request_ids import MAX_LENGTH as MAX_REQUEST_ID
from kiln.llm.params import SAMPLING_FIELDS, InvalidField
from kiln.llm.structured import REQUEST_FIELDS as STRUCTURED_FIELDS

log = logging.getLogger(__name__)

#: OpenAI and vLLM request fields that kiln knows but does not implement, each with the
#: values that ask for nothing (clients that fill in every field send those). Any other
#: value answers 400 naming the field: never a 200 that quietly did something else. The
#: one list of them: a change that implements a field removes its line.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    # tool calling: OpenAI's deprecated function calling (``tools`` replaced it)
    "functions": (None, []),
    "function_call": (None, "none"),
    # other OpenAI fields
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "web_search_options": (None,),
    "store": (None, False),
    # other vLLM fields
    "logits_processors": (None, []),
    "mm_processor_kwargs": (None, {}),
    "prompt_embeds": (None,),
    "kv_transfer_params": (None,),
    "vllm_xargs": (None,),
}
_COMMON_FIELDS = (
    *SAMPLING_FIELDS,
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "n",
    "best_of",  # = n only (see generation_fields.best_of)
    "stop",
    "logprobs",
    "logprob_token_ids",
    "echo",
    "prompt_logprobs",
    "priority",
    "user",  # OpenAI's end-user id, for the provider's abuse monitoring: nothing to do
    "request_id",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "bad_words",
    "truncate_prompt_tokens",
    "add_special_tokens",
    "return_tokens_as_token_ids",
    "use_beam_search",
    "length_penalty",  # beam search's
    *STRUCTURED_FIELDS,
)
#: the template's options, for chat and /tokenize
_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "chat_template_kwargs",
    "documents",
    "reasoning_effort",
    "chat_template",
)
COMPLETION_FIELDS = frozenset((*_COMMON_FIELDS, "prompt"))
CHAT_FIELDS = frozenset(
    (
        *_COMMON_FIELDS,
        *_TEMPLATE_FIELDS,
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "include_reasoning",
    )
) | {"tools", "tool_choice", "parallel_tool_calls"}
TOKENIZE_FIELDS = frozenset(
    (
        "model",
        "prompt",
        "messages",
        "return_token_strs",
        "tools",
        "add_special_tokens",
        *_TEMPLATE_FIELDS,
    )
)
DETOKENIZE_FIELDS = frozenset(("model", "tokens"))
#: unknown field names already warned about (one warning each, as vLLM logs them); bounded,
#: since the names come from clients
_WARNED: set[str] = set()
_MAX_WARNED = 1024

#: a prompt longer than ``max_model_len`` times this many characters cannot fit the
#: context whatever the tokenizer (real ones average 3-5 characters a token): refused
#: before tokenizing it, which costs time in proportion to its length
MAX_CHARS_PER_TOKEN = 64


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = (
            message,
            status,
            param,
            code,
            type_,
        )

    @classmethod
    def from_kiln(cls, exc: KilnError) -> OpenAIError:
        status = exc.status.http_status
        type_ = "invalid_request_error" if status < 500 else "server_error"
        if exc.status is Status.UNAVAILABLE:
            type_ = "service_unavailable"
        param = exc.field if isinstance(exc, InvalidField) else None
        return cls(str(exc), status, param=param, type_=type_)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def check_fields(body: dict[str, Any], known: frozenset[str], what: str) -> None:
    """400 for a field of :data:`UNSUPPORTED_FIELDS` that asks for something; one log
    warning per field name that nobody knows (the request goes on without it)."""
    for key, value in body.items():
        harmless = UNSUPPORTED_FIELDS.get(key)
        if harmless is not None:
            # a bool is an int in Python: 1 must not pass for True, nor 0 for False
            if not any(value == h and type(value) is type(h) for h in harmless):
                allowed = [json.dumps(h) for h in harmless if h is not None]
                raise OpenAIError(
                    f"'{key}' is not supported by kiln: send no '{key}'"
                    + (f", or {' or '.join(allowed)}" if allowed else ""),
                    param=key,
                )
        elif key not in known and key not in _WARNED and len(_WARNED) < _MAX_WARNED:
            _WARNED.add(key)
            log.warning(
                "%s request: field %r is not an OpenAI or vLLM field kiln knows: ignored "
                "(logged once per field name)",
                what,
                key[:100],
            )


def body_request_id(body: dict[str, Any]) -> str | None:
    """The body's ``request_id`` (vLLM's): a non-empty string of at most
    :data:`~kiln.frontends.openai.request_ids.MAX_LENGTH` characters, as the X-Request-Id
    header. It names the answer, and every chunk of a stream repeats it."""
    value = body.get("request_id")
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise OpenAIError("'request_id' must be a non-empty string", param="request_id")
    if len(value) > MAX_REQUEST_ID:
        raise OpenAIError(
            f"'request_id' is {len(value)} characters long: at most {MAX_REQUEST_ID} are taken",
            param="request_id",
        )
    return value


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise OpenAIError(f"'{key}' must be a boolean, got {value!r}", param=key)
    return value


def check_prompt_chars(chars: int, max_model_len: int, param: str) -> None:
    """Refuse a prompt of ``chars`` characters that cannot fit ``max_model_len`` tokens
    (see :data:`MAX_CHARS_PER_TOKEN`), without tokenizing it."""
    limit = max_model_len * MAX_CHARS_PER_TOKEN
    if chars > limit:
        raise OpenAIError(
            f"This model's maximum context length is {max_model_len} tokens. However, the "
            f"{param} has {chars} characters, more than {limit} ({MAX_CHARS_PER_TOKEN} per "
            "token), which cannot fit. Please reduce the prompt.",
            param=param,
            code="context_length_exceeded",
        )


def detokenize_ids(body: dict[str, Any], vocab: int) -> list[int]:
    """``/detokenize``'s ``tokens``: token ids of the vocabulary."""
    check_fields(body, DETOKENIZE_FIELDS, "detokenize")
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise OpenAIError("'tokens' must be a list of token ids", param="tokens")
    if any(not 0 <= t < vocab for t in tokens):
        raise OpenAIError(f"token ids must be in [0, {vocab})", param="tokens")
    return tokens
