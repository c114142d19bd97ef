"""Speculative decoding: proposers that draft tokens, and the rejection sampler that
verifies them against the target model's distributions in one step.

A decoding sequence's step runs its last token and its ``k`` drafts through the target
(``k + 1`` logit rows). Row ``j`` is the target's distribution ``p_j`` after the tokens
before draft ``j``. Draft ``j`` (drawn from ``q_j``) is accepted with probability
``min(1, p_j(d) / q_j(d))``; at the first rejection the token is drawn from
``normalize(max(0, p_j - q_j))`` and the rest are dropped; when all ``k`` are accepted a
bonus token is drawn from ``p_k``. Every emitted token then follows the target's
distribution (Leviathan et al., 2023; Chen et al., 2023). n-gram drafts are a point mass
(``q_j(d) = 1``): accepted with probability ``p_j(d)``, the residual is ``p_j`` without
``d``. Greedy requests accept a draft exactly when it is the target's argmax, so their
tokens are the target's own.
"""

from __future__ import annotations

import numpy as np
import torch

from kiln.llm.sampler import SampledToken, _argmax, apply_logit_bias, filtered_probs
from kiln.llm.sequence import Sequence


class NgramProposer:
    """Prompt lookup: the longest n-gram (``prompt_lookup_max`` down to ``prompt_lookup_min``
    tokens) ending the context that occurred before in it; the tokens that followed its
    latest earlier occurrence are the drafts."""

    def __init__(self, lookup_min: int, lookup_max: int) -> None:
        self.lookup_min, self.lookup_max = lookup_min, lookup_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        length = len(token_ids)
        if k <= 0 or length < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        earlier = tokens[:-1]  # a match must be followed by at least one token
        for n in range(min(self.lookup_max, length - 1), self.lookup_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(earlier, n)
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[0]) + n
                return token_ids[start : start + k]
        return []


def _race(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """Index ``i`` with probability ``weights[i] / weights.sum()`` (the exponential race
    the sampler uses; ``weights`` need not be normalized)."""
    if generator is None:
        q = torch.empty_like(weights).exponential_()
    else:
        q = torch.empty(weights.shape, dtype=weights.dtype).exponential_(generator=generator)
        q = q.to(weights.device)
    return int(_argmax((weights / q).unsqueeze(0))[0])


def rejection_sample(
    target: torch.Tensor,
    drafts: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """``target`` [k + 1, vocab]: the target's probabilities at each draft's place and
    after the last; ``draft_probs`` [k, vocab] the drafts' (None: point masses). Returns
    (drafts accepted, the token that follows them)."""
    k = len(drafts)
    rows = torch.arange(k, device=target.device)
    index = torch.tensor(drafts, device=target.device)
    p = target[rows, index]
    q = draft_probs[rows, index] if draft_probs is not None else torch.ones_like(p)
    if generator is None:
        u = torch.rand(k, device=target.device)
    else:
        u = torch.rand(k, generator=generator).to(target.device)
    # u < p / q, without dividing: p == q always accepts, p == 0 never does
    accepted = (u * q < p).tolist()
    a = accepted.index(False) if False in accepted else k
    if a == k:
        return k, _race(target[k], generator)  # the bonus token
    if draft_probs is not None:
        residual = (target[a] - draft_probs[a]).clamp_min(0)
    else:
        residual = target[a].clone()
        residual[drafts[a]] = 0
    if not bool((residual > 0).any()):
        residual = target[a]  # rounding left nothing: p and q agree, the draw is p's
    return a, _race(residual, generator)


def verify(logits: torch.Tensor, seqs: list[Sequence]) -> dict[int, SampledToken]:
    """``logits``: ``len(seq.spec_token_ids) + 1`` rows per sequence of ``seqs``, in
    order. The accepted drafts and the next token of each (by ``seq_id``)."""
    rows = [seq for seq in seqs for _ in range(len(seq.spec_token_ids) + 1)]
    logits = logits.float()
    if any(s.params.logit_bias for s in seqs):
        logits = apply_logit_bias(logits, rows)
    greedy = _argmax(logits).tolist()
    probs = filtered_probs(logits, rows) if any(s.params.temperature > 0 for s in seqs) else None
    out: dict[int, SampledToken] = {}
    at = 0
    for seq in seqs:
        drafts = seq.spec_token_ids
        k = len(drafts)
        if seq.params.temperature == 0 or probs is None:
            target = greedy[at : at + k + 1]
            a = 0
            while a < k and drafts[a] == target[a]:
                a += 1
            token = target[a]
        else:
            a, token = rejection_sample(
                probs[at : at + k + 1], drafts, seq.spec_probs, seq.generator
            )
        out[seq.seq_id] = SampledToken(token, accepted=tuple(drafts[:a]))
        at += k + 1
    return out


class SpecDecodeStats:
    """vLLM's ``spec_decode_*`` counters: verified draft runs, their tokens, those accepted,
    and accepted by draft position."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1
