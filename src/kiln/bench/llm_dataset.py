"""Prompts for ``kiln bench --openai``: random token-length distributions or a JSONL file.

Random prompts follow ``vllm bench serve --dataset-name random``: input and output lengths
are drawn uniformly from ``[L * (1 - r), L * (1 + r)]``. For ``/v1/completions`` a random
prompt is a list of token ids (OpenAI's API accepts one), so its length is exact whatever
the server's tokenizer; ids come from ``[0, vocab_size)``, and the default 256 stays inside
every byte-level vocabulary. Chat messages must be text, so a random chat prompt is that
many common English words: about one token each in real vocabularies, and the true count
comes back in the server's ``usage`` anyway.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from kiln.bench.options import BenchError


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"

    @property
    def path(self) -> str:
        return "/v1/completions" if self is Endpoint.COMPLETIONS else "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One request to send: the prompt (text or token ids) and how many tokens to ask for."""

    prompt: str | list[int]
    max_tokens: int
    #: tokens in the prompt when known up front (token ids); 0 for text
    prompt_len: int = 0


# Short, frequent words: single tokens in the vocabularies of real chat models.
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "was",
    "with",
    "be",
    "by",
    "on",
    "not",
    "he",
    "this",
    "are",
    "or",
    "his",
    "from",
    "at",
    "which",
    "but",
    "have",
    "an",
    "they",
    "you",
    "were",
    "her",
    "she",
    "there",
    "been",
    "one",
    "all",
    "we",
    "their",
    "has",
    "would",
    "when",
    "if",
    "so",
    "no",
    "out",
    "up",
    "into",
    "its",
    "time",
    "more",
    "some",
    "only",
    "other",
    "new",
    "these",
    "two",
    "may",
    "first",
    "then",
    "do",
    "any",
    "like",
    "my",
    "now",
    "over",
    "such",
    "our",
    "man",
    "me",
    "even",
    "most",
    "made",
    "after",
    "also",
    "did",
    "many",
    "before",
    "must",
    "well",
]


def spread(length: int, ratio: float, rng: random.Random) -> int:
    """A length drawn uniformly from ``[length * (1 - ratio), length * (1 + ratio)]``, >= 1."""
    low = max(1, math.floor(length * (1.0 - ratio)))
    high = max(low, math.ceil(length * (1.0 + ratio)))
    return rng.randint(low, high)


def random_prompts(
    endpoint: Endpoint,
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    vocab_size: int,
    seed: int,
) -> list[BenchPrompt]:
    if input_len < 1 or output_len < 1:
        raise BenchError("--input-len and --output-len must be >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise BenchError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    if vocab_size < 1:
        raise BenchError(f"--vocab-size must be >= 1, got {vocab_size}")
    rng = random.Random(seed)
    out: list[BenchPrompt] = []
    for _ in range(num_prompts):
        n_in = spread(input_len, range_ratio, rng)
        n_out = spread(output_len, range_ratio, rng)
        if endpoint is Endpoint.COMPLETIONS:
            ids = [rng.randrange(vocab_size) for _ in range(n_in)]
            out.append(BenchPrompt(ids, n_out, prompt_len=n_in))
        else:
            out.append(BenchPrompt(" ".join(rng.choice(WORDS) for _ in range(n_in)), n_out))
    return out


def _entry(raw: Any, where: str, endpoint: Endpoint, output_len: int) -> BenchPrompt:
    if not isinstance(raw, dict):
        raise BenchError(f'{where}: expected an object like {{"prompt": ..., "max_tokens": N}}')
    prompt = raw.get("prompt")
    max_tokens = raw.get("max_tokens", output_len)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BenchError(f"{where}: 'max_tokens' must be an integer >= 1, got {max_tokens!r}")
    if isinstance(prompt, str) and prompt:
        return BenchPrompt(prompt, max_tokens)
    is_ids = isinstance(prompt, list) and bool(prompt)
    if is_ids and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):  # type: ignore[union-attr]
        if endpoint is Endpoint.CHAT:
            raise BenchError(f"{where}: token-id prompts need --endpoint completions")
        return BenchPrompt(list(prompt), max_tokens, prompt_len=len(prompt))  # type: ignore[arg-type]
    raise BenchError(f"{where}: 'prompt' must be a non-empty string or a list of token ids")


def load_jsonl(
    path: Path, endpoint: Endpoint, num_prompts: int, output_len: int
) -> list[BenchPrompt]:
    """The first ``num_prompts`` lines of ``path`` (all of them when there are fewer)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise BenchError(f"--dataset {path}: {exc.strerror or exc}") from None
    out: list[BenchPrompt] = []
    for number, line in enumerate(lines, 1):
        if len(out) == num_prompts:
            break
        if not line.strip():
            continue
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            raise BenchError(f"--dataset {path}:{number}: not valid JSON ({exc})") from None
        out.append(_entry(raw, f"--dataset {path}:{number}", endpoint, output_len))
    if not out:
        raise BenchError(f"--dataset {path}: no prompts in the file")
    return out
