"""vLLM's ``--speculative-config``: which proposer drafts tokens and how many per step.
Importing this module does not import torch (the CLI and config parsing read it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.core.errors import KilnError, Status

if TYPE_CHECKING:
    from kiln.llm.sequence import Sequence

#: ``ngram``: prompt lookup (the tokens that followed the context's last n-gram where it
#: occurred before); ``draft_model``: a smaller model with the target's vocabulary
SPECULATIVE_METHODS = ("ngram", "draft_model")
_FIELDS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def _refuse(message: str) -> KilnError:
    return KilnError(f"llm backend: speculative_config: {message}", Status.INVALID_ARG)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    #: the draft model's folder (``draft_model``)
    model: str | None = None
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 5

    @classmethod
    def from_json(cls, raw: str) -> SpeculativeConfig:
        """vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4, "prompt_lookup_min": 1}`` or ``{"model": PATH,
        "num_speculative_tokens": 4}`` (``method`` ``draft_model`` implied, as in vLLM)."""
        try:
            fields: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _refuse(f"not JSON: {exc}") from None
        if not isinstance(fields, dict):
            raise _refuse("must be a JSON object")
        unknown = sorted(set(fields) - set(_FIELDS))
        if unknown:
            raise _refuse(
                f"field '{unknown[0]}' is not supported by kiln (supported: {', '.join(_FIELDS)})"
            )
        model = fields.get("model")
        method = fields.get("method")
        if method is None:
            # vLLM: model "ngram" (or "[ngram]") names the method; any other model a draft
            method = "ngram" if model in (None, "ngram", "[ngram]") else "draft_model"
        if method in ("ngram", "draft_model") and model in ("ngram", "[ngram]"):
            model = None
        if method not in SPECULATIVE_METHODS:
            raise _refuse(
                f"method '{method}' is not supported by kiln "
                f"(supported: {', '.join(SPECULATIVE_METHODS)})"
            )
        if method == "draft_model" and not isinstance(model, str):
            raise _refuse("method 'draft_model' needs 'model': the draft model's folder")
        ints: dict[str, int] = {}
        # vLLM's defaults: 5 and 5 when neither is given; one given sets the other too
        lo, hi = fields.get("prompt_lookup_min"), fields.get("prompt_lookup_max")
        lookup = {"prompt_lookup_min": lo, "prompt_lookup_max": hi}
        for key in lookup:
            if lookup[key] is None:
                lookup[key] = hi if hi is not None else lo if lo is not None else 5
        for key, value in (("num_speculative_tokens", fields.get("num_speculative_tokens")),
                           *lookup.items()):  # fmt: skip
            if value is None:
                raise _refuse(f"'{key}' is required")
            if isinstance(value, bool) or not isinstance(value, int):
                raise _refuse(f"'{key}' must be an integer, got {value!r}")
            ints[key] = value
        config = cls(
            method,
            ints["num_speculative_tokens"],
            model,
            ints["prompt_lookup_max"],
            ints["prompt_lookup_min"],
        )
        config.check()
        return config

    def check(self, max_num_batched_tokens: int | None = None) -> None:
        k = self.num_speculative_tokens
        if k <= 0:
            raise _refuse(f"num_speculative_tokens must be at least 1, got {k}")
        if max_num_batched_tokens is not None and k + 1 > max_num_batched_tokens:
            # a decoding sequence's step (its last token and k drafts) must fit one step
            raise _refuse(
                f"num_speculative_tokens {k} is too large: 1 + {k} tokens do not fit "
                f"max_num_batched_tokens ({max_num_batched_tokens})"
            )
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if not 1 <= lo <= hi:
                raise _refuse(
                    "prompt_lookup_min and prompt_lookup_max must satisfy "
                    f"1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}"
                )


def can_speculate(seq: Sequence) -> bool:
    """Whether a decoding sequence may have drafts verified this step. The rejection
    sampler sees each row's distribution as position-independent processing (logit bias,
    temperature, min-p, top-k, top-p) of the logits: requests whose processing depends on
    the tokens before each row (penalties, ``bad_words``, ``min_tokens`` not yet reached,
    a grammar's mask), that keep to ``allowed_token_ids`` or that want logprobs decode one
    token a step, as without speculation."""
    p = seq.params
    return (
        seq.grammar is None
        and p.logprobs is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
        and not p.bad_words_token_ids
        and not p.allowed_token_ids
        and seq.num_output_tokens >= max(p.min_tokens, 1)
        and not seq.forks
    )


def draft_budget(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts ``seq`` can use this step: ``k``, fewer near ``max_tokens`` (a step
    emits at most drafts + 1 tokens) or ``max_model_len`` (every draft needs a position),
    none when it may not speculate."""
    if not can_speculate(seq):
        return 0
    left = min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)
    return max(min(k, left - 1), 0)
