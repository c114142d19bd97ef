"""One request's state while the engine works on it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the OpenAI frontend reads SamplingParams without loading torch
    import torch

_SEQ_IDS = itertools.count()


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI's and vLLM's names). ``temperature == 0``:
    greedy. ``logprobs``: how many top alternatives to return per token (None: no logprobs)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """Prompt and generated tokens, and how much of them the KV cache already holds.

    ``num_computed_tokens`` trails ``len(token_ids)`` by the tokens still to run through the
    model: the whole prompt at first, then one sampled token per step. A preempted sequence
    drops back to 0 and recomputes (vLLM's recompute preemption).
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.seed is not None:
            import torch

            self.generator = torch.Generator()
            self.generator.manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append(self, token_id: int) -> None:
        """Add a sampled token; finish on a stop token or at ``max_tokens``."""
        self.token_ids.append(token_id)
        p = self.params
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            self.finish("stop")
        elif self.num_output_tokens >= p.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
