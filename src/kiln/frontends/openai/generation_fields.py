"""A generation request's fields beyond sampling: logprobs (and ``logprob_token_ids``),
beam search, ``best_of``, ``stop``, ``stream_options`` and vLLM's output options, each
checked and bounded."""

from __future__ import annotations

from typing import Any

from kiln.frontends.openai.protocol import OpenAIError, body_request_id, flag
from kiln.llm.params import integer


def logprobs(body: dict[str, Any], chat: bool) -> int | None:
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


def logprob_token_ids(body: dict[str, Any], logprobs: int | None, beam: bool) -> tuple[int, ...]:
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


def beam_search(body: dict[str, Any], fields: dict[str, Any]) -> tuple[bool, float]:
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


def best_of(body: dict[str, Any], n: int) -> None:
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


def stops(stop: Any) -> tuple[str, ...]:
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


def stream_options(options: Any, stream: bool) -> tuple[bool, bool]:
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


def output_fields(body: dict[str, Any]) -> dict[str, Any]:
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
