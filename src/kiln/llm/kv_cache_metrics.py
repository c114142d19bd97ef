"""vLLM's KV-cache residency histograms (``--kv-cache-metrics``): how long a KV block lives
from its allocation to its eviction, how long it sat unused before it was evicted, and the
gaps between its reuses by the prefix cache.

As in vLLM, a block is followed with probability ``--kv-cache-metrics-sample`` when it is
taken from the free pool; a prefix-cache hit on it is an access (the last four are kept);
it is evicted when the pool hands it out again (so only with prefix caching on, as in
vLLM: without it the pool never looks at a block's past). Each followed block costs one
dict entry; blocks not followed cost a random draw at allocation and a dict miss at each
hit and eviction: nothing is done per token.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from dataclasses import dataclass, field

from kiln.llm.stats import Histogram

#: vLLM's ``kv_cache_residency`` buckets (seconds): millisecond reuse gaps up to
#: half-hour lifetimes
RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120,
    300, 600, 1200, 1800,
)  # fmt: skip
#: the accesses a followed block remembers (vLLM's ring of four)
ACCESS_HISTORY = 4

#: (family after ``vllm:``, help, the ``KVCacheResidency`` field it reads)
RESIDENCY_HISTOGRAMS = (
    ("kv_block_lifetime_seconds",
     "Histogram of KV cache block lifetime from allocation to eviction. Sampled metrics "
     "(controlled by --kv-cache-metrics-sample).", "lifetime"),
    ("kv_block_idle_before_evict_seconds",
     "Histogram of idle time before KV cache block eviction. Sampled metrics (controlled "
     "by --kv-cache-metrics-sample).", "idle_before_evict"),
    ("kv_block_reuse_gap_seconds",
     "Histogram of time gaps between consecutive KV cache block accesses. Only the most "
     "recent accesses are recorded (ring buffer). Sampled metrics (controlled by "
     "--kv-cache-metrics-sample).", "reuse_gap"),
)  # fmt: skip


@dataclass(slots=True)
class _Followed:
    born_ns: int
    last_access_ns: int
    accesses: deque[int] = field(default_factory=lambda: deque(maxlen=ACCESS_HISTORY))


@dataclass(slots=True)
class KVCacheResidency:
    """The followed blocks and the three histograms they feed. The engine's thread calls
    ``allocated``, ``accessed``, ``evicted``; the metrics read the histograms (each takes
    its own lock)."""

    sample_rate: float
    lifetime: Histogram = field(default_factory=lambda: Histogram(RESIDENCY_BUCKETS))
    idle_before_evict: Histogram = field(default_factory=lambda: Histogram(RESIDENCY_BUCKETS))
    reuse_gap: Histogram = field(default_factory=lambda: Histogram(RESIDENCY_BUCKETS))
    #: block id -> its state, for the followed blocks only
    followed: dict[int, _Followed] = field(default_factory=dict)
    draw: random.Random = field(default_factory=random.Random)

    def allocated(self, block_id: int) -> None:
        """A block left the free pool for a sequence: follow it with ``sample_rate``."""
        if self.draw.random() < self.sample_rate:
            now = time.monotonic_ns()
            self.followed[block_id] = _Followed(now, now)

    def accessed(self, block_id: int) -> None:
        """A prefix-cache hit handed the block to another sequence."""
        state = self.followed.get(block_id)
        if state is not None:
            now = time.monotonic_ns()
            state.last_access_ns = now
            state.accesses.append(now)

    def evicted(self, block_id: int) -> None:
        """The pool hands the block out again: what it held is gone."""
        state = self.followed.pop(block_id, None)
        if state is None:
            return
        now = time.monotonic_ns()
        self.lifetime.observe((now - state.born_ns) / 1e9)
        self.idle_before_evict.observe((now - state.last_access_ns) / 1e9)
        times = list(state.accesses)
        for before, after in itertools.pairwise(times):
            self.reuse_gap.observe((after - before) / 1e9)

    def reset(self) -> None:
        """The prefix cache was reset: no block is followed any more (vLLM's ``reset``)."""
        self.followed.clear()
