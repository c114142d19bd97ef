"""Paged KV-cache bookkeeping: fixed-size blocks, a free pool, per-sequence block tables.

The KV tensors themselves live in the model runner; this module only decides which
physical block holds which logical block of which sequence. A block's ``ref_count`` is the
number of block tables that hold it, so a block shared by several sequences (a prefix) is
returned to the pool only when its last holder lets go.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from kiln.llm.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def usage(self) -> float:
        """Fraction of blocks held by some sequence (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have a slot."""
        want = -(-num_tokens // self.block_size)
        return max(want - len(seq.block_table), 0)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to cover ``num_tokens``; False (nothing taken) if the
        pool is too small."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free_block_ids):
            return False
        for _ in range(need):
            block = self.blocks[self.free_block_ids.popleft()]
            block.ref_count = 1
            seq.block_table.append(block.block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``. Tail blocks go back first, so they are reused
        first: a sequence's end is the part least likely to be shared again."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids.append(block_id)
        seq.block_table.clear()

    def check(self, live: Iterable[Sequence]) -> None:
        """Assert the accounting invariants (tests and debugging): every block is either
        free with no holder, or held by exactly ``ref_count`` block tables."""
        holders = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                holders[block_id] += 1
        free = set(self.free_block_ids)
        assert len(free) == len(self.free_block_ids), "a block is in the free pool twice"
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held by {holders[block.block_id]} block tables"
            )
            assert (block.block_id in free) == (block.ref_count == 0), (
                f"block {block.block_id}: ref_count {block.ref_count} but "
                f"{'in' if block.block_id in free else 'not in'} the free pool"
            )
