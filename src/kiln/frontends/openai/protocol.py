"""OpenAI request bodies -> checked values; OpenAI's error shape.

Only translation lives here: the engine enforces the context length and the queue bound.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status
from kiln.frontends.openai.content import content_text
from kiln.frontends.openai.request_ids import MAX_LENGTH as MAX_REQUEST_ID
from kiln.llm.params import SAMPLING_FIELDS, InvalidField, integer, sampling_fields
from kiln.llm.sequence import SamplingParams
from kiln.llm.structured import REQUEST_FIELDS as STRUCTURED_FIELDS
from kiln.llm.structured import from_request as structured_outputs

if TYPE_CHECKING:
    from kiln.frontends.openai.reasoning import ReasoningParser
    from kiln.frontends.openai.tools import ToolRequest
    from kiln.llm.engine_client import EngineClient

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
    "best_of",  # = n only (see _best_of)
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
#: the longest chat template a request may bring (--trust-request-chat-template)
MAX_REQUEST_TEMPLATE_CHARS = 1 << 16
#: OpenAI's ``reasoning_effort`` values, and vLLM's ``max``
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
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

_ROLES = ("system", "user", "assistant", "tool", "developer")
#: the most messages one chat request may hold: far past any real conversation, and the
#: chat template renders each of them (a bound on that work, with the prompt's length)
MAX_MESSAGES = 4096
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


@dataclass(slots=True)
class GenerationRequest:
    model: str
    #: text or token ids, one engine request each (a completions list; chat: one)
    prompts: list[str | list[int]]
    max_tokens: int | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    #: vLLM's ``stream_options.continuous_usage_stats``: every chunk carries ``usage``
    continuous_usage: bool = False
    echo: bool = False
    #: vLLM's ``prompt_logprobs`` field was asked for: the answer carries it
    prompt_logprobs_field: bool = False
    #: vLLM's request priority: lower runs earlier (``scheduling_policy: priority`` only)
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: the tokenizer's special tokens (BOS) are added to a text prompt (vLLM's field: on
    #: for completions, off for chat, whose template writes its own)
    add_special_tokens: bool = True
    #: vLLM's: logprobs name tokens ``token_id:<id>`` instead of by their text
    return_tokens_as_token_ids: bool = False
    bad_words: tuple[str, ...] = ()
    #: keep the prompt's last this many tokens (vLLM's ``truncate_prompt_tokens``)
    truncate_prompt_tokens: int | None = None
    #: chat: the answer's role, and (vLLM's ``echo``) the last message's text it starts with
    role: str = "assistant"
    chat_echo: str = ""
    #: the client's ``request_id`` (vLLM's): the answer's ``id`` is built from it
    request_id: str | None = None
    #: chat: the template's options (:func:`chat_template_options`)
    template: dict[str, Any] = field(default_factory=dict)
    #: chat: ``tools`` and ``tool_choice`` (kiln.frontends.openai.tools)
    tools: ToolRequest | None = None
    #: chat on a model with a reasoning parser: the answer's ``<think>`` part is split off
    reasoning: ReasoningParser | None = None
    #: vLLM's ``include_reasoning``: false leaves the reasoning out of the answer
    include_reasoning: bool = True
    #: vLLM's ``use_beam_search``: ``n`` beams (kiln.llm.beam_search), ranked with
    #: ``length_penalty``
    beam_search: bool = False
    length_penalty: float = 1.0


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """How many top alternatives per token: completions' ``logprobs: int``, or chat's
    ``logprobs: true`` with ``top_logprobs: int``; None when logprobs are off."""
    if chat:
        wanted = body.get("logprobs")
        if wanted is not None and not isinstance(wanted, bool):
            raise OpenAIError(f"'logprobs' must be a boolean, got {wanted!r}", param="logprobs")
        key, count = "top_logprobs", integer(body, "top_logprobs")
        if count is not None and not wanted:
            raise OpenAIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        count = (count or 0) if wanted else None
    else:
        key, count = "logprobs", integer(body, "logprobs")
    # the upper bound is the model's (--max-logprobs, vLLM's 20 by default): check_request
    if count is not None and count < 0:
        raise OpenAIError(f"{key} must be >= 0, got {count}", param=key)
    return count


#: vLLM's bound on ``logprob_token_ids``
MAX_LOGPROB_TOKEN_IDS = 128


def _logprob_token_ids(body: dict[str, Any], logprobs: int | None, beam: bool) -> tuple[int, ...]:
    """vLLM's ``logprob_token_ids``: the tokens whose logprobs each output token lists in
    place of the top alternatives (with logprobs asked for; not with beam search)."""
    ids = body.get("logprob_token_ids")
    if not ids:
        return ()
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise OpenAIError(
            "'logprob_token_ids' must be a list of token ids (integers >= 0)",
            param="logprob_token_ids",
        )
    if len(ids) > MAX_LOGPROB_TOKEN_IDS:
        raise OpenAIError(
            f"'logprob_token_ids' holds {len(ids)} ids, more than {MAX_LOGPROB_TOKEN_IDS}",
            param="logprob_token_ids",
        )
    if beam:
        raise OpenAIError(
            "`logprob_token_ids` is not supported with beam search.", param="logprob_token_ids"
        )
    if logprobs is None:  # vLLM's words (chat's; completions need ``logprobs`` set)
        raise OpenAIError(
            "when using `logprob_token_ids`, `logprobs` must be set to true.",
            param="logprob_token_ids",
        )
    return tuple(ids)


#: ``bad_words`` are matched against every sequence's output at every step: a bound on that
MAX_BAD_WORDS = 256


#: ``length_penalty``'s bound: the score divides by length ** length_penalty, which must
#: stay a finite float for every length a context holds
MAX_LENGTH_PENALTY = 10.0
#: sampling fields that change which tokens a sampler picks but not the model's logprobs,
#: which alone rank beams: refused with beam search unless they ask for nothing
_BEAM_REFUSED = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": (),
    "allowed_token_ids": (),
}


def _beam_search(body: dict[str, Any], fields: dict[str, Any]) -> tuple[bool, float]:
    """``use_beam_search`` and ``length_penalty``; beam search runs without penalties,
    logit biases, allowed or banned tokens (a 400 names the field: never ignored)."""
    beam = flag(body, "use_beam_search", False)
    raw = body.get("length_penalty")
    penalty = 1.0
    if raw is not None:
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise OpenAIError(
                f"'length_penalty' must be a number, got {raw!r}", param="length_penalty"
            )
        if not -MAX_LENGTH_PENALTY <= raw <= MAX_LENGTH_PENALTY:
            raise OpenAIError(
                f"length_penalty must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}], "
                f"got {raw}",
                param="length_penalty",
            )
        penalty = float(raw)
    if not beam:
        if penalty != 1.0:
            raise OpenAIError(
                "'length_penalty' ranks beams: it needs 'use_beam_search': true",
                param="length_penalty",
            )
        return False, penalty
    for key, neutral in _BEAM_REFUSED.items():
        if fields.get(key, neutral) != neutral:
            raise OpenAIError(
                f"'{key}' does not apply to beam search (beams are ranked by the model's "
                f"logprobs): send no '{key}' with 'use_beam_search'",
                param=key,
            )
    if body.get("bad_words"):
        raise OpenAIError(
            "'bad_words' does not apply to beam search: send no 'bad_words' with 'use_beam_search'",
            param="bad_words",
        )
    return True, penalty


def _best_of(body: dict[str, Any], n: int) -> None:
    """``best_of`` equal to ``n`` is plain sampling; kiln does not rank extra samples."""
    best_of = integer(body, "best_of")
    if best_of is None or best_of == n:
        return
    if best_of < n:
        raise OpenAIError(f"best_of must be >= n ({n}), got {best_of}", param="best_of")
    raise OpenAIError(
        f"'best_of' greater than n is not supported by kiln (got {best_of}, n = {n}): ask for "
        "n choices and rank them with their logprobs",
        param="best_of",
    )


#: OpenAI's bound on stop strings
MAX_STOPS = 4


def _stops(stop: Any) -> tuple[str, ...]:
    """``stop``: a string, or a list of up to :data:`MAX_STOPS` non-empty strings."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOPS
        or not all(isinstance(s, str) and s for s in stops)
    ):
        raise OpenAIError(
            f"'stop' must be a string or a list of up to {MAX_STOPS} non-empty strings",
            param="stop",
        )
    return tuple(stops)


def _stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
    """``stream_options``: (``include_usage``, usage on every chunk). As vLLM and OpenAI,
    options given to a request that does not stream are refused (an empty object or null
    asks for nothing)."""
    if options is None:
        return False, False
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    if options and not stream:
        raise OpenAIError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    values = []
    for key in ("include_usage", "continuous_usage_stats"):
        value = options.get(key)
        if value is not None and not isinstance(value, bool):
            raise OpenAIError(
                f"'stream_options.{key}' must be a boolean, got {value!r}",
                param="stream_options",
            )
        values.append(bool(value))
    include, continuous = values
    return include, include and continuous


def _output_fields(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's output and prompt options (keyword arguments of :class:`GenerationRequest`)."""
    words = body.get("bad_words")
    if words is None:
        words = []
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise OpenAIError("'bad_words' must be a list of strings", param="bad_words")
    if len(words) > MAX_BAD_WORDS:
        raise OpenAIError(
            f"'bad_words' holds {len(words)} words, more than {MAX_BAD_WORDS}", param="bad_words"
        )
    truncate = integer(body, "truncate_prompt_tokens")
    if truncate is not None and truncate < 1 and truncate != -1:
        raise OpenAIError(
            f"truncate_prompt_tokens must be >= 1 (or -1: the model's context), got {truncate}",
            param="truncate_prompt_tokens",
        )
    request_id = body_request_id(body)
    flag(body, "spaces_between_special_tokens", True)  # no effect with tokenizer.json's
    return {
        "include_stop_str_in_output": flag(body, "include_stop_str_in_output", False),
        "return_tokens_as_token_ids": flag(body, "return_tokens_as_token_ids", False),
        "skip_special_tokens": flag(body, "skip_special_tokens", True),
        "bad_words": tuple(w for w in words if w.strip()),
        "truncate_prompt_tokens": truncate,
        "request_id": request_id,
    }


def _common(
    body: dict[str, Any], prompts: list[str | list[int]], max_key: str, chat: bool
) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    try:
        fields = sampling_fields(body)
        max_tokens = integer(body, max_key)
        if max_tokens is None and max_key != "max_tokens":
            max_tokens = integer(body, "max_tokens")
            if max_tokens is not None:  # an error names the field the client sent
                max_key = "max_tokens"
        n = integer(body, "n")
        priority = integer(body, "priority") or 0
        _best_of(body, n or 1)
        output = _output_fields(body)
        structured = structured_outputs(body)
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    beam, length_penalty = _beam_search(body, fields)
    if max_tokens is not None and max_tokens <= 0:
        raise OpenAIError(f"{max_key} must be at least 1, got {max_tokens}", param=max_key)
    if n is not None and n < 1:
        raise OpenAIError(f"n must be at least 1, got {n}", param="n")
    stops = _stops(body.get("stop"))
    logprobs = _logprobs(body, chat)
    chosen = _logprob_token_ids(body, logprobs, beam)
    echo = flag(body, "echo", False)
    stream = flag(body, "stream", False)
    include_usage, continuous_usage = _stream_options(body.get("stream_options"), stream)
    try:
        prompt_logprobs = integer(body, "prompt_logprobs")
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if prompt_logprobs is not None:
        if prompt_logprobs < 0:
            raise OpenAIError(
                f"prompt_logprobs must be >= 0, got {prompt_logprobs}", param="prompt_logprobs"
            )
        if stream:
            raise OpenAIError(
                "prompt_logprobs is answered with the whole response: not with stream",
                param="prompt_logprobs",
            )
    echoed = logprobs if echo and not chat else None
    params = SamplingParams(
        max_tokens=max_tokens or 1,  # the default is settled once the prompt's length is known
        logprobs=logprobs,
        n=n or 1,
        # an echoed prompt gets its logprobs too (completions, whole or streamed)
        prompt_logprobs=max((v for v in (echoed, prompt_logprobs) if v is not None), default=None),
        structured_outputs=structured,
        logprob_token_ids=chosen,
        **fields,
    )
    return GenerationRequest(
        model=model,
        prompts=prompts,
        max_tokens=max_tokens,
        params=params,
        stream=stream,
        include_usage=include_usage,
        continuous_usage=continuous_usage,
        stop=stops,
        echo=echo,
        prompt_logprobs_field=prompt_logprobs is not None,
        priority=priority,
        add_special_tokens=flag(body, "add_special_tokens", not chat),
        beam_search=beam,
        length_penalty=length_penalty,
        **output,
    )


def _is_token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    """The ``prompt`` field as a list of prompts: a string, token ids, or a list of either
    (OpenAI's batch: choice ``index`` = prompt ``i`` * ``n`` + sample ``j``)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or _is_token_ids(prompt):
        prompts: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt:
        prompts = prompt
    else:
        prompts = [None]
    for i, p in enumerate(prompts):
        if not (isinstance(p, str) and p) and not _is_token_ids(p):
            where = "'prompt'" if len(prompts) == 1 else f"prompt[{i}]"
            raise OpenAIError(
                f"{where} must be a non-empty string or a list of token ids (or 'prompt' a "
                "list of those)",
                param="prompt",
            )
    return prompts


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    check_fields(body, COMPLETION_FIELDS, "completions")
    return _common(body, completion_prompts(body), "max_tokens", chat=False)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("'messages' must be a non-empty list", param="messages")
    if len(messages) > MAX_MESSAGES:
        raise OpenAIError(
            f"'messages' holds {len(messages)} messages, more than {MAX_MESSAGES}",
            param="messages",
        )
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise OpenAIError(
                f"messages[{i}] must be an object with a 'role' in {list(_ROLES)}",
                param=f"messages[{i}].role",
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: kiln serves text only
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(t, str)
                for p, t in zip(content, texts, strict=True)
            ):
                raise OpenAIError(
                    f"messages[{i}].content: only text parts are supported",
                    param=f"messages[{i}].content",
                )
            # kept as parts: --chat-template-content-format decides how the template
            # gets them (content.template_content)
            content = [{"type": "text", "text": t} for t in texts]
        if content is None and m.get("role") == "assistant" and m.get("tool_calls"):
            content = ""  # OpenAI's: an assistant turn that only calls tools has none
        if not isinstance(content, str | list):
            raise OpenAIError(
                f"messages[{i}].content must be a string or a list of text parts",
                param=f"messages[{i}].content",
            )
        out.append({**m, "content": content})
    return out


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


def chat_template_options(body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's template options of a chat or ``/tokenize`` request, as keyword arguments of
    ``Tokenizer.apply_chat_template``."""
    continue_final = flag(body, "continue_final_message", False)
    # transformers refuses both at once; vLLM too, when both are sent true. Asking to
    # continue the last message alone turns the generation prompt off.
    add_prompt = flag(body, "add_generation_prompt", not continue_final)
    if continue_final and add_prompt:
        raise OpenAIError(
            "Cannot set both 'continue_final_message' and 'add_generation_prompt' to true",
            param="continue_final_message",
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise OpenAIError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    if "messages" in kwargs:
        raise OpenAIError(
            "chat_template_kwargs may not set 'messages': send them in 'messages'",
            param="chat_template_kwargs",
        )
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(isinstance(d, dict) for d in documents):
            raise OpenAIError("'documents' must be a list of objects", param="documents")
        kwargs = {"documents": documents, **kwargs}
    effort = body.get("reasoning_effort")
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise OpenAIError(
                f"'reasoning_effort' must be one of {list(REASONING_EFFORTS)}, got {effort!r}",
                param="reasoning_effort",
            )
        # vLLM's: the template reads it (gpt-oss's, Qwen's, ...), and a template that
        # thinks on request (enable_thinking) thinks unless the effort is "none" and the
        # client's chat_template_kwargs did not say
        thinking = {} if "enable_thinking" in kwargs else {"enable_thinking": effort != "none"}
        kwargs = {**kwargs, **thinking, "reasoning_effort": effort}
    template = body.get("chat_template")
    if template is not None and (not isinstance(template, str) or not template.strip()):
        raise OpenAIError("'chat_template' must be a non-empty string", param="chat_template")
    if template is not None and len(template) > MAX_REQUEST_TEMPLATE_CHARS:
        raise OpenAIError(
            f"'chat_template' holds {len(template)} characters, more than "
            f"{MAX_REQUEST_TEMPLATE_CHARS}",
            param="chat_template",
        )
    return {
        "add_generation_prompt": add_prompt,
        "continue_final_message": continue_final,
        "template_kwargs": kwargs,
        "chat_template": template,
    }


def with_server_kwargs(llm: EngineClient, template: dict[str, Any]) -> dict[str, Any]:
    """``template`` (``chat_template_options``) over the server's
    ``--default-chat-template-kwargs``: a request's own variables win, as in vLLM. A
    request's own ``chat_template`` only where the server trusts them
    (``--trust-request-chat-template``), as vLLM: else a 400."""
    if template.get("chat_template") is not None and not llm.trust_request_chat_template:
        raise OpenAIError(
            "Chat template is passed with request, but --trust-request-chat-template is not "
            "set. Refused request with untrusted chat template.",
            param="chat_template",
        )
    defaults = llm.default_chat_template_kwargs
    if not defaults:
        return template
    return {**template, "template_kwargs": {**defaults, **template["template_kwargs"]}}


def chat_request(
    body: dict[str, Any],
    messages: list[dict[str, Any]],
    rendered_prompt: str,
    template: dict[str, Any],
    response_role: str = "assistant",
) -> GenerationRequest:
    req = _common(body, [rendered_prompt], "max_completion_tokens", chat=True)
    # vLLM's roles: the answer is the server's --response-role (the assistant's) after a
    # generation prompt, else it continues the last message's role; echo starts it with
    # that message when it is ours
    req.role = response_role if template["add_generation_prompt"] else messages[-1]["role"]
    if req.echo and messages[-1]["role"] == req.role:
        req.chat_echo = content_text(messages[-1]["content"])
    req.template = template
    req.include_reasoning = flag(body, "include_reasoning", True)
    return req


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
