"""One request's state while the engine works on it."""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the OpenAI frontend reads SamplingParams without loading torch
    import llguidance
    import torch

    from kiln.llm.engine import RequestOutput
    from kiln.llm.lora import LoRARequest
    from kiln.llm.sampler import TokenLogprobs
    from kiln.llm.structured import StructuredOutputsParams

log = logging.getLogger(__name__)

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
    #: vLLM's ``logprob_token_ids``: with ``logprobs``, these tokens' logprobs (after the
    #: sampled one's) stand in place of the top alternatives
    logprob_token_ids: tuple[int, ...] = ()
    #: samples of the prompt (OpenAI's ``n``); sample ``i`` draws with ``seed + i``
    n: int = 1
    #: OpenAI's ``logit_bias``: (token id, bias) pairs added to the logits before sampling
    logit_bias: tuple[tuple[int, float], ...] = ()
    #: logprobs of the prompt's tokens too, with this many top alternatives (vLLM's
    #: ``prompt_logprobs``; the completions API's ``echo`` with ``logprobs``)
    prompt_logprobs: int | None = None
    #: vLLM's ``cache_salt``: the prefix cache matches only requests with the same salt
    cache_salt: str | None = None
    #: vLLM's ``min_tokens``: EOS and ``stop_token_ids`` are banned (and stop nothing)
    #: until this many tokens are out
    min_tokens: int = 0
    #: vLLM's ``bad_words``, tokenized: a sequence's last token is banned wherever the
    #: output ends with the ones before it (a one-token word is banned everywhere)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    #: vLLM's ``allowed_token_ids``: the only tokens it may sample (empty: all of them)
    allowed_token_ids: tuple[int, ...] = ()
    #: vLLM's ``structured_outputs``: the constraint the output must follow
    structured_outputs: StructuredOutputsParams | None = None
    #: a thinking model's end-of-reasoning marker (``</think>``'s token ids): the
    #: constraint applies from after it, as vLLM's does with a reasoning parser (unless the
    #: prompt holds it already: thinking turned off by the template)
    reasoning_end: tuple[int, ...] = ()
    #: vLLM's ``thinking_token_budget``: at most this many tokens of reasoning (between
    #: ``reasoning_start`` and ``reasoning_end``); then the end marker is forced (None: no
    #: limit)
    thinking_token_budget: int | None = None
    #: the start-of-reasoning marker (``<think>``'s token ids), with the budget
    reasoning_start: tuple[int, ...] = ()
    #: vLLM's ``stream_interval``: a sample's tokens reach its reader in runs of this many
    #: (its first and last at once); raised to the engine's ``--stream-interval``. None:
    #: the engine's. The reader's side alone (kiln.llm.async_engine.OutputCollector)
    stream_interval: int | None = None


def _last(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where ``marker`` last begins in ``ids`` (-1: nowhere)."""
    if not marker:
        return -1
    n = len(marker)
    for at in range(len(ids) - n, -1, -1):
        if ids[at] == marker[0] and tuple(ids[at : at + n]) == marker:
            return at
    return -1


def find_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """Where the first of ``stops`` (in their order) occurs in ``text`` from ``start``,
    and which: the one stop-string search of the OpenAI frontend, Triton's tensors and the
    offline API."""
    for stop in stops:
        at = text.find(stop, start)
        if at >= 0:
            return at, stop
    return None


def token_by_token(
    out: RequestOutput, drop_stop_token: bool
) -> Iterator[tuple[list[int], list[TokenLogprobs], int, bool]]:
    """An output of several tokens (steps merged for a reader that fell behind, a
    ``stream_interval``, accepted drafts) one token at a time: (ids, logprobs, tokens
    generated up to it, whether it is the sample's last). A reader that checks stop strings
    token by token ends a sample at the token that completes one, and counts its usage up to
    there, however the steps were merged. ``drop_stop_token``: the last token (the stop
    token) gives no text."""
    count = len(out.new_token_ids)
    logprobs = out.logprobs or []
    aligned = len(logprobs) == count
    for j, token in enumerate(out.new_token_ids):
        last = j == count - 1
        ids = [] if last and drop_stop_token else [token]
        entries = logprobs[j : j + 1] if aligned else logprobs if last else []
        yield ids, entries, out.num_output_tokens - (count - 1 - j), last and out.finished


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class RequestState:
    """What the ``n`` sequences of one request share: its place in the queue and the times
    its latency histograms are measured from (``time.monotonic()``)."""

    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    #: prompt tokens the prefix cache held when it was first scheduled
    num_cached_tokens: int = 0
    #: sequences of the request not yet finished or aborted
    num_live: int = 1
    #: the most tokens one of its samples generated (vLLM's
    #: ``request_max_num_generation_tokens``), over the samples that left
    max_output_tokens: int = 0


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
    #: the stop token that finished it (vLLM's ``stop_reason``): its text is not output
    stop_token_id: int | None = None
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    #: which of the request's ``n`` samples this is (the OpenAI choice ``index``)
    index: int = 0
    request: RequestState = field(default_factory=RequestState)
    #: samples 1..n-1, waiting for this sequence's prompt: they are forked from it (sharing
    #: its blocks) when it samples its first token
    forks: list[Sequence] = field(default_factory=list)
    #: leading blocks of ``block_table`` known to the prefix cache (hit, or registered)
    num_cached_blocks: int = 0
    #: chained hash of each full block of ``token_ids`` (filled in as blocks fill up)
    block_hashes: list[int] = field(default_factory=list)
    #: the prefix cache's content key of each cached leading block (chains the next one)
    chain_keys: list[int] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None
    #: with ``prompt_logprobs``: one entry per prompt token computed so far (the first,
    #: which nothing predicts, is None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    #: with ``structured_outputs``: this sequence's own matcher, advanced by each token
    #: appended; it masks the sequence's logits every step
    grammar: llguidance.LLMatcher | None = None
    #: the grammar waits for ``params.reasoning_end`` (the model is still thinking)
    thinking: bool = False
    #: with ``params.thinking_token_budget``: inside the reasoning, the reasoning tokens
    #: so far, and the end marker's tokens still to force once the budget is spent
    budget_open: bool = False
    budget_used: int = 0
    forced: list[int] = field(default_factory=list)
    #: ``params.allowed_token_ids`` as a [vocab] mask on the logits' device (the sampler's,
    #: built on the sequence's first step)
    allowed_mask: torch.Tensor | None = None
    #: speculative decoding: the draft tokens this step verifies (after ``token_ids``)
    spec_token_ids: list[int] = field(default_factory=list)
    #: the draft model's distributions they were drawn from ([len(spec_token_ids), vocab]);
    #: None: a point mass on each (n-gram lookup, or a greedy request)
    spec_probs: torch.Tensor | None = None
    #: leading tokens whose K/V the draft model holds (in its own cache, same block table)
    num_draft_computed: int = 0
    #: the LoRA adapter it runs with (None: the base model)
    lora_request: LoRARequest | None = None
    #: (weight version, the output token it began at), oldest first (``weight_versions``)
    weight_version_starts: list[tuple[str, int]] = field(default_factory=list)
    #: the starts changed since the last output carried them
    weight_versions_changed: bool = False

    def __post_init__(self) -> None:
        self.num_prompt_tokens = len(self.token_ids)
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.params.seed is not None:
            import torch

            self.generator = torch.Generator()
            # distinct, reproducible streams for the n samples of one seeded request
            self.generator.manual_seed(self.params.seed + self.index)

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """The ``priority`` policy's order: lower priority value, then earlier arrival."""
        return (self.request.priority, self.request.arrival_time, self.seq_id)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not all computed: its prompt must run in full."""
        done = self.prompt_logprobs
        return done is not None and len(done) < self.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def constrained(self) -> bool:
        """Its grammar masks its next token (it has one, and is not still thinking)."""
        return self.grammar is not None and not self.thinking

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def start_budget(self) -> None:
        """With ``thinking_token_budget``: the reasoning is open when the prompt's last start
        marker comes after its last end marker (a template that opens it), as vLLM reads it."""
        p = self.params
        if p.thinking_token_budget is None or not p.reasoning_end:
            return
        self.budget_open = _last(self.token_ids, p.reasoning_start) > _last(
            self.token_ids, p.reasoning_end
        )
        if self.budget_open and p.thinking_token_budget == 0:
            self.forced = list(p.reasoning_end)

    def _output_ends_with(self, marker: tuple[int, ...]) -> bool:
        """The output (not the prompt) ends with ``marker``: only its last tokens read."""
        n = len(marker)
        ids = self.token_ids
        return len(ids) - n >= self.num_prompt_tokens and tuple(ids[-n:]) == marker

    def _count_thinking(self, token_id: int) -> None:
        p = self.params
        if self.forced and token_id == self.forced[0]:
            self.forced.pop(0)
        if not self.budget_open:
            start = p.reasoning_start
            if start and token_id == start[-1] and self._output_ends_with(start):
                self.budget_open, self.budget_used = True, 0
                if p.thinking_token_budget == 0:
                    self.forced = list(p.reasoning_end)
            return
        end = p.reasoning_end
        if token_id == end[-1] and self._output_ends_with(end):
            self.budget_open, self.forced = False, []
            return
        self.budget_used += 1
        budget = p.thinking_token_budget
        if budget is not None and self.budget_used >= budget and not self.forced:
            self.forced = list(end)

    def append(self, token_id: int) -> None:
        """Add a sampled token; finish on a stop token, when the grammar is complete (its
        matcher takes nothing more), or at ``max_tokens``."""
        self.token_ids.append(token_id)
        p = self.params
        if p.thinking_token_budget is not None and p.reasoning_end:
            self._count_thinking(token_id)
        grammar = self.grammar
        if self.thinking:
            # free text until the reasoning's end marker; the grammar starts after it
            end = p.reasoning_end
            if token_id == end[-1]:
                self.thinking = tuple(self.token_ids[-len(end) :]) != end
            grammar = None
        elif grammar is not None and not grammar.is_stopped():
            # the mask allowed only tokens the matcher takes: a refusal (an error state)
            # stops it too, and the sequence ends rather than leaving its grammar
            grammar.consume_token(token_id)
            if grammar.is_error():  # a limit of llguidance's parser, met while it runs
                error = grammar.get_error().strip().splitlines()
                log.warning(
                    "request %s: its structured output's grammar stopped at output token %d: %s",
                    self.request_id,
                    self.num_output_tokens,
                    error[0] if error else "?",
                )
        if grammar is not None and grammar.is_stopped():
            self.finish("stop")  # a complete grammar takes nothing more, min_tokens or not
            return
        if self.num_output_tokens < p.min_tokens:
            return  # as vLLM: nothing stops it before min_tokens (<= max_tokens)
        if token_id in p.stop_token_ids or (not p.ignore_eos and token_id in self.eos_token_ids):
            self.stop_token_id = token_id
            self.finish("stop")
        elif self.num_output_tokens >= p.max_tokens:
            self.finish("length")

    def finish(self, reason: str) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
