"""OpenAI request bodies -> checked values; OpenAI's error shape.

Only translation lives here: the engine enforces the context length and the queue bound.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.llm.params import InvalidField, integer, sampling_fields
from kiln.llm.sequence import SamplingParams
from kiln.llm.structured import from_request as structured_outputs

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


@dataclass(slots=True)
class GenerationRequest:
    model: str
    prompt: str | list[int]  # text, or token ids (completions only)
    max_tokens: int | None
    params: SamplingParams
    stream: bool
    include_usage: bool
    stop: tuple[str, ...]
    echo: bool = False
    #: vLLM's ``prompt_logprobs`` field was asked for: the answer carries it
    prompt_logprobs_field: bool = False
    #: vLLM's request priority: lower runs earlier (``scheduling_policy: priority`` only)
    priority: int = 0


MAX_LOGPROBS = 20


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
    if count is not None and not 0 <= count <= MAX_LOGPROBS:
        raise OpenAIError(f"{key} must be in [0, {MAX_LOGPROBS}], got {count}", param=key)
    return count


def _common(
    body: dict[str, Any], prompt: str | list[int], max_key: str, chat: bool
) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise OpenAIError("'model' is required and must be a string", param="model")
    try:
        fields = sampling_fields(body)
        max_tokens = integer(body, max_key)
        if max_tokens is None and max_key != "max_tokens":
            max_tokens = integer(body, "max_tokens")
        n = integer(body, "n")
        priority = integer(body, "priority") or 0
        structured = structured_outputs(body)
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if max_tokens is not None and max_tokens <= 0:
        raise OpenAIError(f"{max_key} must be at least 1, got {max_tokens}", param=max_key)
    if n is not None and n < 1:
        raise OpenAIError(f"n must be at least 1, got {n}", param="n")
    stop = body.get("stop")
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise OpenAIError("'stop' must be a string or up to 4 non-empty strings", param="stop")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise OpenAIError("'stream_options' must be an object", param="stream_options")
    logprobs = _logprobs(body, chat)
    echo = bool(body.get("echo", False))
    stream = bool(body.get("stream", False))
    try:
        prompt_logprobs = integer(body, "prompt_logprobs")
    except InvalidField as exc:
        raise OpenAIError(exc.message, param=exc.field) from None
    if prompt_logprobs is not None:
        if not 0 <= prompt_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(
                f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {prompt_logprobs}",
                param="prompt_logprobs",
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
        **fields,
    )
    return GenerationRequest(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        params=params,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        stop=stops,
        echo=echo,
        prompt_logprobs_field=prompt_logprobs is not None,
        priority=priority,
    )


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise OpenAIError(
                "'prompt' must be a string or a list of token ids (one prompt per request)",
                param="prompt",
            )
    elif not isinstance(prompt, str) or not prompt:
        raise OpenAIError("'prompt' must be a non-empty string or token ids", param="prompt")
    return _common(body, prompt, "max_tokens", chat=False)


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
            content = "".join(t for t in texts if isinstance(t, str))
        if not isinstance(content, str):
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


def chat_request(body: dict[str, Any], rendered_prompt: str) -> GenerationRequest:
    return _common(body, rendered_prompt, "max_completion_tokens", chat=True)
