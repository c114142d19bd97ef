"""Beam search over the engine's one-token steps, as vLLM runs it (its ``use_beam_search``
and ``LLM.beam_search``).

Each step the engine runs every live beam as a one-token request that returns the
``2 x beam_width`` likeliest next tokens and their logprobs (the prefix cache holds what the
beams share, so a step computes each beam's new tokens only). Every (beam, token) pair is a
candidate: one ending in a stop token (EOS, ``stop_token_ids``) or whose text reaches a stop
string is complete; of the others the ``beam_width`` with the highest cumulative logprob
live on. At the end, complete and live beams are ranked by transformers' and vLLM's score,
``cumulative logprob / length ** length_penalty`` (the length counts the prompt and not the
stop token), and the best ``beam_width`` are the answer.

kiln's differences from vLLM's, each a superset: ``stop_token_ids``, stop strings and
``min_tokens`` apply, and the search ends early once no live beam can reach the answer
(the result is the one running every step would give). Only the model's logprobs rank
beams: sampling settings (temperature, top-p, ...) do not apply, so a search is
deterministic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from kiln.llm.sequence import find_stop

if TYPE_CHECKING:
    from kiln.llm.sampler import TokenLogprobs


@dataclass(slots=True)
class Beam:
    """One hypothesis: its output tokens (the stop token that ended it only with
    ``include_stop_str_in_output``) and a logprob entry per generated token (the stop
    token's too)."""

    tokens: list[int] = field(default_factory=list)
    cum_logprob: float = 0.0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    #: ``stop`` for a complete beam; None while it lives (``length`` in the answer)
    finish_reason: str | None = None
    #: the stop token or stop string that ended it
    stop_reason: int | str | None = None
    #: the text, once a stop string ended the beam (cut at it)
    text: str | None = None
    #: output tokens counted in the score's length (the stop token is not)
    counted: int = 0


class BeamSearch:
    """One prompt's search: :meth:`prompts` are the token ids to run one step of,
    :meth:`advance` takes each one's next-token logprobs, until :meth:`done`;
    :meth:`best` is the answer, best first."""

    def __init__(
        self,
        prompt_len: int,
        beam_width: int,
        max_tokens: int,
        *,
        eos_token_ids: Sequence[int] = (),
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        length_penalty: float = 1.0,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        stops: tuple[str, ...] = (),
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        """``decode``: an output's text, to find ``stops`` in (needed with them)."""
        if beam_width < 1 or max_tokens < 1:
            raise ValueError(f"beam_width and max_tokens must be >= 1: {beam_width}, {max_tokens}")
        if stops and decode is None:
            raise ValueError("stop strings need a decode function")
        self.prompt_len = prompt_len
        self.width = beam_width
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_token_ids) | (
            frozenset() if ignore_eos else frozenset(eos_token_ids)
        )
        self.length_penalty = length_penalty
        self.include_stop = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stops = stops
        self.decode = decode
        #: the most tokens a stop string can span
        self._stop_window = 4 * max((len(x) for x in stops), default=0) + 1
        self.live: list[Beam] = [Beam()]
        self.completed: list[Beam] = []
        self.steps = 0

    @property
    def num_candidates(self) -> int:
        """Next tokens asked of the engine per live beam (vLLM's and transformers' 2 x
        width: enough that ``width`` survive when some end)."""
        return 2 * self.width

    def prompts(self, prompt: list[int]) -> list[list[int]]:
        """The token ids of the next step's requests, one per live beam."""
        return [prompt + beam.tokens for beam in self.live]

    def score(self, beam: Beam) -> float:
        length = max(self.prompt_len + beam.counted, 1)
        return beam.cum_logprob / math.pow(length, self.length_penalty)

    def advance(self, dists: Sequence[TokenLogprobs]) -> None:
        """``dists[i]``: live beam ``i``'s next-token distribution (its ``top``: the
        candidates, best first)."""
        if len(dists) != len(self.live):
            raise ValueError(f"{len(dists)} distributions for {len(self.live)} live beams")
        self.steps += 1
        early = self.steps <= self.min_tokens  # min_tokens: nothing ends a beam yet
        pool: list[Beam] = []
        for beam, dist in zip(self.live, dists, strict=True):
            for token, logprob in dist.top[: self.num_candidates]:
                entry = replace(dist, token_id=token, logprob=logprob)
                cum = beam.cum_logprob + logprob
                logprobs = [*beam.logprobs, entry]
                if token in self.stop_ids:
                    if not early:
                        tokens = [*beam.tokens, token] if self.include_stop else beam.tokens
                        self.completed.append(
                            Beam(tokens, cum, logprobs, "stop", token, counted=beam.counted)
                        )
                    continue
                grown = Beam([*beam.tokens, token], cum, logprobs, counted=beam.counted + 1)
                if self.stops and not early and self._stopped(grown):
                    self.completed.append(grown)
                else:
                    pool.append(grown)
        # the same length for every candidate: ranking by cumulative logprob is by score
        pool.sort(key=lambda b: b.cum_logprob, reverse=True)
        self.live = pool[: self.width]

    def _stopped(self, beam: Beam) -> bool:
        """Whether the new token completes a stop string. Its parent held none, so only
        the output's end is decoded: the last tokens that can hold the longest stop (a
        character is at most 4 bytes, a token at least 1); the whole text only to cut it.
        Every candidate of every step is checked, so this must not grow with the output."""
        assert self.decode is not None
        tail = self.decode(beam.tokens[-self._stop_window :])
        if find_stop(tail, self.stops) is None:
            return False
        text = self.decode(beam.tokens)
        found = find_stop(text, self.stops)
        if found is None:  # the tail's start was a character cut in two
            return False
        at, stop = found
        beam.text = text[: at + (len(stop) if self.include_stop else 0)]
        beam.finish_reason, beam.stop_reason = "stop", stop
        return True

    def done(self) -> bool:
        return not self.live or self.steps >= self.max_tokens or self._settled()

    def _settled(self) -> bool:
        """No live beam, nor any beam it could grow into, can score above the
        ``width``-th best complete one: the answer is known. Cumulative logprobs only
        fall; the best a live beam can reach is its score now (``length_penalty`` <= 0)
        or its logprob spread over the longest length left (> 0)."""
        if len(self.completed) < self.width:
            return False
        kth = sorted((self.score(b) for b in self.completed), reverse=True)[self.width - 1]
        longest = max(self.prompt_len + self.max_tokens, 1)
        for beam in self.live:
            if self.length_penalty > 0:
                bound = beam.cum_logprob / math.pow(longest, self.length_penalty)
            else:
                bound = self.score(beam)
            if not bound < kth:
                return False
        return True

    def best(self) -> list[Beam]:
        """The answer: the ``width`` best of the complete and live beams, best first (a
        live one ran out of ``max_tokens``: ``length``)."""
        ranked = sorted([*self.completed, *self.live], key=self.score, reverse=True)
        out = ranked[: self.width]
        for beam in out:
            if beam.finish_reason is None:
                beam.finish_reason = "length"
        return out
