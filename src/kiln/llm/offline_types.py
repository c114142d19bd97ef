"""The offline API's request and output types, vLLM's shapes and names
(``kiln.llm.offline``: ``LLM`` takes and gives these; ``from kiln.llm import
SamplingParams`` reaches them there)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class SamplingParams:
    """vLLM's ``SamplingParams`` fields kiln's engine runs (its names and defaults);
    ``None`` leaves a field to the model's generation_config.json, as vLLM's ``LLM`` does."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None

    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


@dataclass
class Logprob:
    """vLLM's: a token's logprob (``rank``: 1 for the likeliest)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class WeightVersionSpan:
    """vLLM's: output tokens ``[start, end)`` were sampled by the weights labelled
    ``version``."""

    version: str
    start: int
    end: int


@dataclass
class CompletionOutput:
    """vLLM's: one sample of a prompt."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    #: per generated token, its logprob and its top alternatives' (with ``logprobs``)
    logprobs: list[dict[int, Logprob]] | None
    #: ``stop`` (EOS, a stop token or string) or ``length``
    finish_reason: str | None = None
    #: the stop string, or the ``stop_token_ids`` token, that ended it (None: EOS, length)
    stop_reason: str | int | None = None
    #: on a finished sample: the spans of its tokens sampled under each weight version
    weight_versions: list[WeightVersionSpan] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """vLLM's: one prompt's outputs, its ``n`` samples."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams`` (``LLM.beam_search``): ``beam_width`` beams ranked by
    cumulative logprob / length ** ``length_penalty`` (kiln.llm.beam_search). The
    ``temperature`` is accepted and, as the model's logprobs alone rank beams, unused."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    #: vLLM's constrained beam search: not in kiln (a ValueError)
    structured_outputs: Any = None


@dataclass
class BeamSearchSequence:
    """vLLM's: one beam. ``tokens`` and ``text`` hold the prompt and the output (with the
    EOS that ended it), as vLLM's offline beam search returns them."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best ``beam_width`` beams, best first."""

    sequences: list[BeamSearchSequence]


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    """vLLM's: ``encode``'s raw result (``token_embed``: [tokens, hidden])."""

    data: Any


@dataclass
class PoolingRequestOutput:
    """vLLM's ``EmbeddingRequestOutput`` / ``ClassificationRequestOutput``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: Any
    finished: bool = True
