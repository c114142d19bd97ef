"""Sampling fields of a request body (OpenAI's or Triton's generate) -> checked values.

Both frontends read the same names with the same ranges, so the checks live here once; a
bad value raises :class:`InvalidField`, which names the field for the frontend's error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from kiln.core.errors import KilnError, Status

#: the fields :func:`sampling_fields` reads
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "cache_salt",
    "min_tokens",
    "allowed_token_ids",
    "stream_interval",
    "thinking_token_budget",
)

#: vLLM's smallest temperature above 0: a smaller one is raised to it
MIN_TEMPERATURE = 0.01
#: OpenAI's bound on a ``logit_bias`` value
MAX_LOGIT_BIAS = 100.0
#: vLLM's bounds on integer fields (``seed``, ``top_k``...): a torch ``long``. A value out
#: of them overflows a tensor on the engine's thread, where it would fail the whole step.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: ``stop_token_ids`` are checked against every sampled token: a few suffice
MAX_STOP_TOKEN_IDS = 1024
#: ``allowed_token_ids``: more than any vocabulary holds (Gemma's 262,144) is a mistake
MAX_ALLOWED_TOKEN_IDS = 262144
#: a ``logit_bias`` key: ASCII digits only (``str.isdigit`` takes "²" and other scripts'
#: digits, which ``int`` refuses)
_TOKEN_ID = re.compile(r"[0-9]{1,19}")


class InvalidField(KilnError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message, Status.INVALID_ARG)
        self.field = field


def number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidField(key, f"'{key}' must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:  # an integer past float's range
        raise InvalidField(key, f"'{key}' is out of range") from None


def integer(
    body: Mapping[str, Any], key: str, low: int = INT64_MIN, high: int = INT64_MAX
) -> int | None:
    """An integer field in [``low``, ``high``] (by default a torch ``long``, as vLLM's)."""
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidField(key, f"'{key}' must be an integer, got {value!r}")
    if not low <= value <= high:
        raise InvalidField(key, f"{key} must be in [{low}, {high}], got {value}")
    return value


def _in_range(key: str, value: float, low: float, high: float) -> float:
    if not low <= value <= high:
        raise InvalidField(key, f"{key} must be in [{low:g}, {high:g}], got {value:g}")
    return value


def logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias``: an object from token id (a JSON key, so a string of digits)
    to a bias in [-100, 100]; as (id, bias) pairs, ids ascending."""
    raw = body.get("logit_bias")
    if raw is None:
        return ()
    if not isinstance(raw, dict):
        raise InvalidField("logit_bias", f"'logit_bias' must be an object, got {raw!r}")
    pairs: dict[int, float] = {}
    for key, value in raw.items():
        text = str(key)
        if not _TOKEN_ID.fullmatch(text):
            raise InvalidField(
                "logit_bias", f"logit_bias keys must be token ids (integers), got {key!r}"
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise InvalidField("logit_bias", f"logit_bias[{text}] must be a number, got {value!r}")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise InvalidField(
                "logit_bias",
                f"logit_bias[{text}] must be in [-100, 100], got {value:g}",
            )
        pairs[int(text)] = float(value)
    return tuple(sorted(pairs.items()))


def allowed_token_ids(body: Mapping[str, Any]) -> tuple[int, ...]:
    """vLLM's ``allowed_token_ids``: the only tokens the request may sample (empty: all).
    The vocabulary's bound is the engine's (``check_request``)."""
    raw = body.get("allowed_token_ids")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise InvalidField(
            "allowed_token_ids", "'allowed_token_ids' must be a non-empty list of token ids"
        )
    if len(raw) > MAX_ALLOWED_TOKEN_IDS:
        raise InvalidField(
            "allowed_token_ids",
            f"'allowed_token_ids' holds {len(raw)} ids, more than {MAX_ALLOWED_TOKEN_IDS}",
        )
    if not all(type(t) is int and 0 <= t <= INT64_MAX for t in raw):
        raise InvalidField("allowed_token_ids", "allowed_token_ids must be token ids (>= 0)")
    return tuple(raw)


def with_defaults(body: dict[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with the model's default sampling values (its generation_config.json, as
    vLLM's ``--generation-config auto``) for the fields it leaves out or sets to null."""
    if not defaults:
        return body
    missing = {k: v for k, v in defaults.items() if body.get(k) is None}
    return {**body, **missing} if missing else body


def sampling_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """Keyword arguments of :class:`~kiln.llm.sequence.SamplingParams` (all but
    ``max_tokens`` and ``logprobs``, whose defaults and names differ per API)."""
    temperature = number(body, "temperature", 1.0)
    # vLLM's bounds and messages; a temperature too small to divide logits by without
    # overflowing float32 (under 0.01, not 0) is raised to 0.01, as vLLM raises it
    if not math.isfinite(temperature):
        raise InvalidField(
            "temperature", f"temperature must be a finite number, got {temperature}."
        )
    if temperature < 0:
        raise InvalidField("temperature", f"temperature must be non-negative, got {temperature}.")
    if temperature > 2:
        raise InvalidField("temperature", f"temperature must be in [0, 2], got {temperature}.")
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise InvalidField("top_p", f"top_p must be in (0, 1], got {top_p}")
    top_k = integer(body, "top_k") or 0  # past the vocabulary: all of it (the sampler clamps)
    if top_k < -1:
        raise InvalidField("top_k", f"top_k must be -1 (off) or positive, got {top_k}")
    repetition = number(body, "repetition_penalty", 1.0)
    if repetition <= 0:
        raise InvalidField(
            "repetition_penalty", f"repetition_penalty must be > 0, got {repetition:g}"
        )
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in stop_ids
    ):
        raise InvalidField("stop_token_ids", "'stop_token_ids' must be a list of integers")
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidField(
            "stop_token_ids",
            f"'stop_token_ids' holds {len(stop_ids)} ids, more than {MAX_STOP_TOKEN_IDS}",
        )
    # the vocabulary's bound is the engine's (check_request); this one keeps ids integers
    if any(not 0 <= t <= INT64_MAX for t in stop_ids):
        raise InvalidField("stop_token_ids", "stop_token_ids must be token ids (>= 0)")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidField("ignore_eos", f"'ignore_eos' must be a boolean, got {ignore_eos!r}")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidField("cache_salt", f"'cache_salt' must be a non-empty string, got {salt!r}")
    min_tokens = integer(body, "min_tokens") or 0
    if min_tokens < 0:
        raise InvalidField("min_tokens", f"min_tokens must be >= 0, got {min_tokens}")
    interval = integer(body, "stream_interval")
    if interval is not None and interval < 1:
        raise InvalidField("stream_interval", f"stream_interval must be >= 1, got {interval}")
    budget = integer(body, "thinking_token_budget")
    if budget is not None and budget < -1:
        raise InvalidField(
            "thinking_token_budget",
            f"thinking_token_budget must be a non-negative integer or -1 for unlimited, "
            f"got {budget}",
        )
    return {
        "thinking_token_budget": None if budget == -1 else budget,
        "cache_salt": salt,
        "min_tokens": min_tokens,
        "stream_interval": interval,
        "logit_bias": logit_bias(body),
        "allowed_token_ids": allowed_token_ids(body),
        "temperature": temperature,
        "top_p": top_p,
        "top_k": max(top_k, 0),
        "min_p": _in_range("min_p", number(body, "min_p", 0.0), 0.0, 1.0),
        "repetition_penalty": repetition,
        "presence_penalty": _in_range(
            "presence_penalty", number(body, "presence_penalty", 0.0), -2.0, 2.0
        ),
        "frequency_penalty": _in_range(
            "frequency_penalty", number(body, "frequency_penalty", 0.0), -2.0, 2.0
        ),
        "seed": integer(body, "seed"),
        "stop_token_ids": tuple(stop_ids),
        "ignore_eos": ignore_eos,
    }
