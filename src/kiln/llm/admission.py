"""vLLM's admission limits: ``--max-num-queued-reqs`` and ``--max-num-queued-tokens``.

A request beyond them is refused at once with 503 (``Status.UNAVAILABLE``), so that a
load balancer or a client's retry sends it to another replica instead of letting it wait.
The counts are kept where requests enter the engine (``AsyncEngine``, ``EngineProcClient``),
for every frontend: samples in flight (a request with ``n`` samples counts ``n``, as
vLLM's), and the prompt tokens of requests with no output yet (still queued or in prefill;
a request counts its whole prompt until its first output, as vLLM counts it). A pooling
request (embeddings, scores, classification) counts one slot per prompt, and its prompts'
tokens until its vectors come: vLLM runs each prompt as a request of the same engine.
Refusals are counted per reason for ``vllm:admission_rejections``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kiln.core.errors import KilnError, Status

__all__ = ["QUEUE_FULL", "REASONS", "TOKENS_FULL", "Admission", "Ticket"]

#: vLLM's messages (its QueueOverflowError and MaxQueuedTokensError): a client matching
#: them sees the same text
QUEUE_FULL = (
    "The engine is currently busy and cannot accept new requests. Please try again later "
    "or on a different instance."
)
TOKENS_FULL = (
    "The engine has reached its prefill token backlog limit. Please try again later or on "
    "a different instance."
)

#: ``vllm:admission_rejections``' ``reason`` values (vLLM's ``ADMISSION_REASONS``)
REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")


@dataclass(slots=True)
class Ticket:
    """One admitted request's share of the counts."""

    slots: int
    prefill_tokens: int


class Admission:
    """The two limits (None: off) and what is counted against them; thread-safe."""

    def __init__(self, max_reqs: int | None, max_tokens: int | None) -> None:
        self.max_reqs = max_reqs
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self.slots = 0
        self.prefill_tokens = 0
        #: refusals per ``REASONS`` entry
        self.rejections = dict.fromkeys(REASONS, 0)

    def check(self, n: int = 1) -> None:
        """Refuse (503) a request of ``n`` samples the limits would not take now."""
        with self._lock:
            self._check(n)

    def _check(self, n: int) -> None:
        if self.max_reqs is not None and self.slots + n > self.max_reqs:
            self.rejections[REASONS[0]] += 1
            raise KilnError(QUEUE_FULL, Status.UNAVAILABLE)
        # as vLLM's: refused once the backlog has reached the limit (a long prompt alone
        # still runs on an idle engine)
        if self.max_tokens is not None and self.prefill_tokens >= self.max_tokens:
            self.rejections[REASONS[1]] += 1
            raise KilnError(TOKENS_FULL, Status.UNAVAILABLE)

    def admit(self, n: int, prompt_len: int) -> Ticket:
        """Count a request of ``n`` samples of a ``prompt_len``-token prompt, or refuse it."""
        return self.admit_prompts(n, n * prompt_len)

    def admit_prompts(self, slots: int, prompt_tokens: int) -> Ticket:
        """Count ``slots`` requests holding ``prompt_tokens`` prompt tokens in all (a
        pooling request's prompts), or refuse them."""
        with self._lock:
            self._check(slots)
            ticket = Ticket(slots, prompt_tokens)
            self.slots += ticket.slots
            self.prefill_tokens += ticket.prefill_tokens
            return ticket

    def prefilled(self, ticket: Ticket) -> None:
        """The request's first output came: its prompt is no longer in the backlog."""
        with self._lock:
            self.prefill_tokens -= ticket.prefill_tokens
            ticket.prefill_tokens = 0

    def release(self, ticket: Ticket) -> None:
        """The request ended (finished, failed or aborted)."""
        with self._lock:
            self.slots -= ticket.slots
            self.prefill_tokens -= ticket.prefill_tokens
            ticket.slots = ticket.prefill_tokens = 0
