"""Paged KV-cache bookkeeping: fixed-size blocks, a free pool, per-sequence block tables,
and the prefix cache (vLLM V1's automatic prefix caching).

The KV tensors themselves live in the model runner; this module only decides which
physical block holds which logical block of which sequence. A block's ``ref_count`` is the
number of block tables that hold it: a cached prefix or the prompt of ``n`` samples is
shared, and a block is released only when its last holder lets go.

Prefix cache: once a block is full of computed tokens it is registered under a hash of its
tokens chained with its parent block's hash. A new sequence looks its full blocks up in
order and reuses the longest chain found. A hash is only a key: a hit also compares the
block's stored token ids and its parent's content key, so a hash collision (or a parent
evicted and refilled since) can never hand out the wrong KV. A request's ``cache_salt``
(vLLM's) roots its chain: its first block's hash starts from the salt and the block keeps
it, so requests with different salts (or one without) never share a cached block, and a
tenant cannot learn from timing which prompts another one sent. A LoRA adapter roots its
requests' chains the same way (with its never-reused int id): the same prompt under two
adapters, or under one and the base model, has different K/V. A released block that holds
cached content is *evictable*: it stays findable, in least-recently-released order, and is
only recycled when the pool of blank blocks is empty.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kiln.llm.kv_cache_metrics import KVCacheResidency
from kiln.llm.sequence import Sequence

#: what roots a sequence's chain: its ``cache_salt``, with its LoRA adapter's id if any
CacheRoot = str | tuple[str | None, int] | None


def _root(seq: Sequence) -> CacheRoot:
    lora = seq.lora_request
    salt = seq.params.cache_salt
    return salt if lora is None else (salt, lora.lora_int_id)


def _salt_root(salt: CacheRoot) -> int | None:
    """What a salted chain's first block hashes from (None: unsalted). A str's hash varies
    between processes, which the prefix cache, held in one, never sees."""
    return None if salt is None else hash(("cache_salt", salt))


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained block hash. Python's hash of a tuple of ints is stable across runs (ints are
    not salted); tests replace this function to force collisions."""
    return hash((parent_hash, token_ids))


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    #: set while the block is registered in the prefix cache
    block_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    #: content key of the parent block when this one was registered (None: first block)
    parent_key: int | None = None
    #: the ``cache_salt`` (and LoRA id) of the request that registered it (first blocks only)
    salt: CacheRoot = None
    #: unique per registration: children chain to it, and it dies with the eviction
    content_key: int = -1


@dataclass(slots=True)
class PrefixCacheStats:
    """vLLM's ``prefix_cache_queries`` / ``prefix_cache_hits``, in tokens."""

    queries: int = 0
    hits: int = 0


@dataclass(slots=True)
class BlockManager:
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    blocks: list[Block] = field(init=False)
    #: blank blocks (no cached content), taken first
    free_block_ids: deque[int] = field(init=False)
    #: released blocks with cached content, least recently released first
    evictable: OrderedDict[int, None] = field(default_factory=OrderedDict)
    cached: dict[int, int] = field(default_factory=dict)  # hash -> block_id
    stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    #: copy-on-write copies decided since the last ``take_copies``: (seq_id, src, dst)
    copies: list[tuple[int, int, int]] = field(default_factory=list)
    #: vLLM's ``--kv-cache-metrics``: the sampled blocks' residency (None: off)
    residency: KVCacheResidency | None = None
    _keys: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.blocks = [Block(i) for i in range(self.num_blocks)]
        self.free_block_ids = deque(range(self.num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence could take now: blank ones and evictable cached ones."""
        return len(self.free_block_ids) + len(self.evictable)

    def usage(self) -> float:
        """Fraction of blocks held by some sequence (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / max(self.num_blocks, 1)

    # -- prefix cache ----------------------------------------------------------------------

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        bs = self.block_size
        for i in range(len(seq.block_hashes), num_blocks):
            parent = seq.block_hashes[i - 1] if i else _salt_root(_root(seq))
            seq.block_hashes.append(hash_block(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs])))
        return seq.block_hashes

    def find_cached(self, seq: Sequence) -> list[int]:
        """The longest chain of cached blocks matching ``seq``'s leading full blocks. At
        least one token is left to compute (its logits are needed): the hit is capped at
        ``num_tokens - 1`` tokens, so a fully cached prompt recomputes its last block."""
        if not self.enable_prefix_caching or seq.wants_prompt_logprobs:
            return []  # (prompt logprobs need every prompt position's logits)
        bs = self.block_size
        limit = (seq.num_tokens - 1) // bs
        hits: list[int] = []
        parent_key: int | None = None
        for i, h in enumerate(self._hashes(seq, limit)[:limit]):
            block_id = self.cached.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            if (
                block.parent_key != parent_key
                or block.token_ids != tuple(seq.token_ids[i * bs : (i + 1) * bs])
                or (i == 0 and block.salt != _root(seq))
            ):
                break  # a colliding hash or a stale chain: never trust the hash alone
            hits.append(block_id)
            parent_key = block.content_key
        return hits

    def cache_blocks(self, seq: Sequence) -> None:
        """Register the blocks of ``seq`` that are now full of computed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        hashes = self._hashes(seq, full)
        for i in range(seq.num_cached_blocks, full):
            parent_key = seq.chain_keys[i - 1] if i else None
            if parent_key == -1:  # the chain above is not cached: nothing below is findable
                seq.chain_keys.append(-1)
                continue
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            salt = _root(seq) if i == 0 else None
            block = self.blocks[seq.block_table[i]]
            other = self.cached.get(hashes[i])
            if other is None:
                block.block_hash, block.token_ids, block.parent_key = hashes[i], tokens, parent_key
                block.salt = salt
                block.content_key = next(self._keys)
                self.cached[hashes[i]] = block.block_id
                seq.chain_keys.append(block.content_key)
            else:
                same = self.blocks[other]
                # the same content computed twice (requests admitted together): chain on
                # the registered copy; a collision leaves the rest of this chain uncached
                dup = same.token_ids == tokens and (same.parent_key, same.salt) == (
                    parent_key,
                    salt,
                )
                seq.chain_keys.append(same.content_key if dup else -1)
        seq.num_cached_blocks = max(seq.num_cached_blocks, full)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's ``reset_prefix_cache``): only when no sequence
        holds a block (False, nothing changed, otherwise), so no live chain loses its keys."""
        if any(block.ref_count for block in self.blocks):
            return False
        for block in self.blocks:
            block.block_hash, block.token_ids, block.parent_key = None, (), None
            block.salt = None
            block.content_key = -1
        self.cached.clear()
        self.evictable.clear()
        self.free_block_ids = deque(range(self.num_blocks))
        if self.residency is not None:
            self.residency.reset()
        return True

    # -- allocation ------------------------------------------------------------------------

    def _take(self) -> int:
        if self.free_block_ids:
            block_id = self.free_block_ids.popleft()
        else:
            block_id, _ = self.evictable.popitem(last=False)  # least recently released
            block = self.blocks[block_id]
            if block.block_hash is not None and self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids, block.parent_key = None, (), None
            block.salt = None
            block.content_key = -1
        self.blocks[block_id].ref_count = 1
        residency = self.residency
        if residency is not None and self.enable_prefix_caching:
            # vLLM's pool: what a block held dies when it is handed out again
            residency.evicted(block_id)
            residency.allocated(block_id)
        return block_id

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.evictable[block_id]
        block.ref_count += 1
        if self.residency is not None:
            self.residency.accessed(block_id)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks ``seq`` needs so that its first ``num_tokens`` tokens have a slot."""
        want = -(-num_tokens // self.block_size)
        return max(want - len(seq.block_table), 0)

    def admit(
        self, seq: Sequence, hits: list[int], num_tokens: int, must_fit: int = 0, reserve: int = 0
    ) -> bool:
        """Give a waiting sequence (empty block table) the cached blocks ``hits`` and fresh
        ones up to ``num_tokens``; False (nothing taken) if the pool is too small to hold
        ``max(num_tokens, must_fit)`` tokens and still have ``reserve`` blocks free."""
        need = -(-num_tokens // self.block_size) - len(hits)
        fit = -(-max(num_tokens, must_fit) // self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.blocks[b].ref_count == 0)
        if fit + revived + reserve > self.num_free_blocks:
            return False
        for block_id in hits:
            self._touch(block_id)
        seq.block_table = [*hits, *(self._take() for _ in range(need))]
        seq.chain_keys = [self.blocks[b].content_key for b in hits]
        seq.num_cached_blocks = len(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self.stats.queries += seq.num_tokens
            self.stats.hits += seq.num_computed_tokens
        return True

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow ``seq``'s block table to cover ``num_tokens``; copy-on-write the block it is
        about to write into if another sequence shares it. False (nothing taken) if the
        pool is too small."""
        need = self.blocks_needed(seq, num_tokens)
        at = seq.num_computed_tokens // self.block_size
        cow = at < len(seq.block_table) and self.blocks[seq.block_table[at]].ref_count > 1
        if need + cow > self.num_free_blocks:
            return False
        if cow:
            src = seq.block_table[at]
            self.blocks[src].ref_count -= 1  # still held by another: never reaches 0 here
            seq.block_table[at] = self._take()
            self.copies.append((seq.seq_id, src, seq.block_table[at]))
            del seq.chain_keys[at:]
            seq.num_cached_blocks = min(seq.num_cached_blocks, at)
        seq.block_table.extend(self._take() for _ in range(need))
        return True

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release the tail blocks of ``seq`` past its first ``num_tokens`` tokens (slots a
        step reserved for speculative drafts that were rejected)."""
        keep = -(-num_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block.block_id] = None
                else:
                    self.free_block_ids.append(block.block_id)
        del seq.chain_keys[keep:]
        seq.num_cached_blocks = min(seq.num_cached_blocks, keep)

    def take_copies(self, keep: set[int]) -> list[tuple[int, int]]:
        """The pending copies of the sequences in ``keep`` (a preempted one's are void)."""
        out = [(src, dst) for sid, src, dst in self.copies if sid in keep]
        self.copies.clear()
        return out

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares every block of ``parent`` (the prompt of ``n`` samples)."""
        for block_id in parent.block_table:
            self.blocks[block_id].ref_count += 1
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.chain_keys = list(parent.chain_keys)
        child.num_cached_blocks = parent.num_cached_blocks

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``. Tail blocks go back first, so they are recycled
        first: a sequence's end is the part least likely to be shared again."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is not None:
                    self.evictable[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
        seq.block_table.clear()
        seq.chain_keys.clear()
        seq.num_cached_blocks = 0

    def check(self, live: Iterable[Sequence]) -> None:
        """Assert the accounting invariants (tests and debugging)."""
        holders = [0] * self.num_blocks
        for seq in live:
            for block_id in seq.block_table:
                holders[block_id] += 1
        free, evictable = set(self.free_block_ids), set(self.evictable)
        assert len(free) == len(self.free_block_ids), "a block is in the free pool twice"
        assert not free & evictable, f"blocks both blank and evictable: {free & evictable}"
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_count == holders[bid], (
                f"block {bid}: ref_count {block.ref_count}, held by {holders[bid]} block tables"
            )
            released = bid in free or bid in evictable
            assert released == (block.ref_count == 0), (
                f"block {bid}: ref_count {block.ref_count} but "
                f"{'released' if released else 'not released'}"
            )
            assert (bid in evictable) <= (block.block_hash is not None), (
                f"block {bid} is evictable without cached content"
            )
            assert (bid in free) <= (block.block_hash is None), (
                f"block {bid} is blank yet holds cached content"
            )
        for h, bid in self.cached.items():
            assert self.blocks[bid].block_hash == h, f"hash {h} maps to block {bid}, stale"
