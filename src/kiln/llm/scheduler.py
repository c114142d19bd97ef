"""Iteration-level (continuous) batching with a token budget per step.

Every step each sequence is given tokens to run so that its ``num_computed_tokens`` catches
up with its ``num_tokens`` (vLLM V1's formulation): a prompt's prefill, one token of decode,
or a chunk of a long prompt when the budget runs short, all in the same batch. Running
sequences go first, in admission order; waiting ones join between steps while the budget,
``max_num_seqs`` and the free blocks allow (by default room for the whole prompt, as vLLM's
``scheduler_reserve_full_isl``, and ``watermark`` blocks of headroom), starting from the
longest chain of their blocks already in the prefix cache. The waiting queue is served in
arrival order (``fcfs``) or by (``priority``, arrival) under the ``priority`` policy. When
a running sequence needs a block and none is free, a sequence is preempted: the latest
admitted (``fcfs``) or the one with the worst (priority, arrival); its blocks are freed and
it returns to the waiting queue to be recomputed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kiln.core.errors import KilnError, Status
from kiln.llm.block_manager import BlockManager
from kiln.llm.config import EngineConfig
from kiln.llm.sequence import Sequence, SequenceStatus
from kiln.llm.spec_config import draft_budget


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: ``num_new_tokens[i]`` tokens of ``seqs[i]`` to run."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    #: copy-on-write block copies (src, dst) to make before the step runs
    copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        #: blocks a waiting request must leave free to join a running batch (``watermark``)
        self.watermark_blocks = int(config.watermark * block_manager.num_blocks)
        spec = config.speculative_config
        #: drafts a decoding sequence may have verified per step (0: no speculation)
        self.num_speculative_tokens = spec.num_speculative_tokens if spec is not None else 0

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise KilnError(
                f"llm engine: the waiting queue is full ({self.config.max_waiting} requests)",
                Status.UNAVAILABLE,
            )
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str, index: int | None = None) -> list[Sequence]:
        """Remove the request's sequences (or its sample ``index`` alone) and free them.
        Samples still waiting to be forked from an aborted sequence go with it."""
        removed: list[Sequence] = []
        for queue in (self.waiting, self.running):
            for seq in [s for s in queue if s.request_id == request_id]:
                if index is None or seq.index == index:
                    queue.remove(seq)
                    self.block_manager.free(seq)
                    removed.append(seq)
        for seq in list(removed):
            removed.extend(seq.forks)
            seq.forks = []
        for seq in removed:
            seq.finish("abort")
        return removed

    def _victim(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda s: s.sort_key)
        return self.running[-1]

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self.num_speculative_tokens and seq.num_computed_tokens + 1 == seq.num_tokens:
                # room (slots and budget) for drafts: the engine proposes at most this many
                # (the budget of those n-gram lookup does not find stays unused this step)
                k = draft_budget(seq, self.num_speculative_tokens, self.config.max_model_len)
                n += min(k, budget - 1)
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
                victim = self._victim()
                at = self.running.index(victim)
                del self.running[at]
                if at < i:  # scheduled earlier in this step (priority): take it back
                    k = out.seqs.index(victim)
                    budget += out.num_new_tokens.pop(k)
                    del out.seqs[k]
                    i -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        self._admit(out, budget)
        out.copies = self.block_manager.take_copies({s.seq_id for s in out.seqs})
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        # Admitting while preempting would thrash: the blocks just freed belong to the
        # preempted sequence, now first in line.
        if out.preempted:
            return
        if self.config.scheduling_policy == "priority":
            self.waiting = deque(sorted(self.waiting, key=lambda s: s.sort_key))
        lora = self.config.lora_config
        max_loras = lora.max_loras if lora is not None else 0
        loras = {s.lora_request.lora_int_id for s in self.running if s.lora_request}
        skipped: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            adapter = seq.lora_request
            if adapter and adapter.lora_int_id not in loras and len(loras) >= max_loras:
                # as vLLM: it waits for a slot (an adapter to leave the batch), others go on
                skipped.append(self.waiting.popleft())
                continue
            # a request's n samples all run once its prompt is done: room for all of them
            if len(self.running) + 1 + len(seq.forks) > self.config.max_num_seqs:
                break
            hits = self.block_manager.find_cached(seq)
            computed = len(hits) * self.block_manager.block_size
            n = min(seq.num_tokens - computed, budget)
            # vLLM's admission gates: room for the whole prompt (not only this step's
            # chunk), and the watermark's headroom once something else runs this step
            must_fit = seq.num_tokens if self.config.scheduler_reserve_full_isl else 0
            reserve = self.watermark_blocks if out.seqs else 0
            if not self.block_manager.admit(seq, hits, computed + n, must_fit, reserve):
                break  # nobody overtakes the head of the queue
            self.waiting.popleft()
            if adapter:
                loras.add(adapter.lora_int_id)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        self.waiting.extendleft(reversed(skipped))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = seq.num_draft_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def preempt_running(self) -> None:
        """Send every running sequence back to the queue, its blocks freed (it is
        recomputed when it runs again), keeping their order at the queue's head."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []

    def remove_finished(self) -> list[Sequence]:
        """Drop (and free) the running sequences that finished this step."""
        done = [s for s in self.running if s.is_finished]
        if done:
            self.running = [s for s in self.running if not s.is_finished]
            for seq in done:
                self.block_manager.free(seq)
        return done
