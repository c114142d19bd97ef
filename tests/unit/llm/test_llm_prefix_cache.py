"""Prefix caching: a hit skips the cached blocks yet keeps greedy tokens identical to
``transformers``; released cached blocks are recycled least recently used first, and only
when no blank block is left; a hash collision never hands out another prompt's KV."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.llm import block_manager as bm_module
from kiln.llm.block_manager import BlockManager
from kiln.llm.sequence import SamplingParams, Sequence

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PREFIX = list(range(40, 72))  # 32 tokens: 8 full blocks of 4


def _seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), GREEDY)


def _compute(bm: BlockManager, seq: Sequence) -> None:
    """Admit ``seq`` with its cache hits, 'compute' it whole and register its blocks."""
    assert bm.admit(seq, bm.find_cached(seq), seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_blocks(seq)


# -- the block manager alone ----------------------------------------------------------------


def test_released_cached_blocks_are_recycled_lru_and_only_when_no_blank_is_left() -> None:
    bm = BlockManager(6, 2)
    a, b = _seq([1, 2, 3, 4], "a"), _seq([5, 6, 7, 8], "b")
    for s in (a, b):
        _compute(bm, s)
    a0, a1 = a.block_table
    b0, b1 = b.block_table
    bm.free(a)
    bm.free(b)
    # tails go first: a's last block is the least recently released
    assert list(bm.evictable) == [a1, a0, b1, b0]
    c = _seq([1, 2, 9], "c")
    assert bm.find_cached(c) == [a0]
    _compute(bm, c)  # touching a0 takes it out of the evictable list...
    bm.free(c)  # ...and releasing it again makes it the most recent
    assert list(bm.evictable) == [a1, b1, b0, a0]
    assert bm.num_free_blocks == 6
    bm.check([])
    # 3 blocks wanted, 2 blank ones left: the third is the least recently used cached one
    d = _seq([20, 21, 22, 23, 24, 25], "d")
    _compute(bm, d)
    assert a1 in d.block_table
    assert list(bm.evictable) == [b1, b0, a0]
    bm.check([d])
    # a1's content is gone from the cache; a0 and b's chain are still found
    assert bm.find_cached(_seq([1, 2, 3, 4, 0])) == [a0]
    assert bm.find_cached(_seq([5, 6, 7, 8, 0])) == [b0, b1]


def test_hits_are_capped_so_one_token_is_always_computed() -> None:
    bm = BlockManager(8, 4)
    first = _seq(list(range(12)))
    _compute(bm, first)
    bm.free(first)
    # the same 12 tokens: only 2 of the 3 cached blocks are reused, the last is recomputed
    assert len(bm.find_cached(_seq(list(range(12))))) == 2
    # one more token: the 3 blocks are reused and only that token is computed
    longer = _seq([*range(12), 99])
    hits = bm.find_cached(longer)
    assert len(hits) == 3
    assert bm.admit(longer, hits, longer.num_tokens)
    assert longer.num_computed_tokens == 12
    assert (bm.stats.queries, bm.stats.hits) == (12 + 13, 12)


def test_a_constant_hash_never_reuses_another_prompts_blocks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 7)
    bm = BlockManager(8, 2)
    a = _seq([1, 2, 3, 4, 5])
    _compute(bm, a)
    first = a.block_table[0]
    bm.free(a)
    assert bm.cached == {7: first}  # [3, 4] collided with [1, 2]: not registered
    assert bm.find_cached(_seq([9, 9, 3, 4, 5])) == []  # the same hash, other tokens
    assert bm.find_cached(_seq([1, 2, 3, 4, 5])) == [first]
    bm.check([])


def test_a_hash_blind_to_the_parent_cannot_chain_onto_another_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the hash ignores the parent, so a block's key says nothing about its prefix
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: hash(tokens))
    bm = BlockManager(8, 2)
    a, q = _seq([1, 2, 3, 4, 0]), _seq([5, 6, 0])
    _compute(bm, a)
    _compute(bm, q)
    bm.free(a)
    bm.free(q)
    # [5, 6] then [3, 4]: both keys hit, but the cached [3, 4] was computed after [1, 2]
    assert bm.find_cached(_seq([5, 6, 3, 4, 0])) == [bm.cached[hash((5, 6))]]
    assert len(bm.find_cached(_seq([1, 2, 3, 4, 0]))) == 2
    bm.check([])


def _salted(tokens: list[int], salt: str | None, rid: str = "r") -> Sequence:
    return Sequence(rid, list(tokens), SamplingParams(max_tokens=6, cache_salt=salt))


def test_a_cache_salt_keeps_requests_of_other_salts_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``cache_salt``: the same prompt under another salt, or none, finds nothing
    the salted request cached; under the same salt it finds all of it."""
    bm = BlockManager(16, 2)
    tenant_a = _salted([1, 2, 3, 4, 5], "tenant-a")
    _compute(bm, tenant_a)
    blocks = tenant_a.block_table[:2]
    bm.free(tenant_a)
    assert bm.find_cached(_salted([1, 2, 3, 4, 5], "tenant-b")) == []
    assert bm.find_cached(_salted([1, 2, 3, 4, 5], None)) == []
    assert bm.find_cached(_salted([1, 2, 3, 4, 5], "tenant-a")) == blocks
    # and an unsalted request's blocks are no salted request's hit
    plain = _salted([7, 8, 9, 10, 11], None)
    _compute(bm, plain)
    bm.free(plain)
    assert bm.find_cached(_salted([7, 8, 9, 10, 11], "tenant-a")) == []
    bm.check([])
    # a hash that ignores the salt (a collision) still never crosses it
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: hash(tokens))
    other = BlockManager(16, 2)
    first = _salted([1, 2, 3, 4, 5], "tenant-a")
    _compute(other, first)
    other.free(first)
    assert other.find_cached(_salted([1, 2, 3, 4, 5], "tenant-b")) == []
    assert len(other.find_cached(_salted([1, 2, 3, 4, 5], "tenant-a"))) == 2


# -- the engine against transformers ---------------------------------------------------------

pytest.importorskip("transformers")

from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.scheduler import SchedulerOutput  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def _engine(folder: Path, **kw: object) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(block_size=4, **kw))  # type: ignore[arg-type]


def _run(
    engine: LLMEngine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Tokens per request, and the tokens each step computed for it; the accounting is
    checked after every step."""
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    computed: dict[str, list[int]] = {rid: [] for rid in prompts}
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        out = schedule()
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            computed[seq.request_id].append(n)
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    try:
        while engine.has_work():
            for r in engine.step():
                tokens[r.request_id].extend(r.new_token_ids)
            engine.block_manager.check(engine.scheduler.running + list(engine.scheduler.waiting))
    finally:
        del engine.scheduler.schedule
    return tokens, computed


def _want(folder: Path, prompt: list[int]) -> list[int]:
    return reference_generate(folder, prompt, GREEDY.max_tokens)


def test_a_shared_prefix_is_computed_once(llama: Path) -> None:
    engine = _engine(llama)
    first = [*PREFIX, 3, 5, 7]
    second = [*PREFIX, 11, 13, 17, 19, 23]
    got, computed = _run(engine, {"a": first})
    assert got["a"] == _want(llama, first)
    got, computed = _run(engine, {"b": second})
    assert got["b"] == _want(llama, second)
    assert computed["b"][0] == 5  # the 32 prefix tokens came from the cache
    assert engine.block_manager.stats.hits == 32
    assert engine.block_manager.stats.queries == len(first) + len(second)


@pytest.mark.parametrize(("length", "recomputed"), [(33, 1), (32, 4)])
def test_a_fully_cached_prompt_recomputes_its_last_token(
    llama: Path, length: int, recomputed: int
) -> None:
    engine = _engine(llama)
    prompt = (PREFIX * 2)[:length]
    want = _want(llama, prompt)
    assert _run(engine, {"a": prompt})[0]["a"] == want
    got, computed = _run(engine, {"again": prompt})
    assert got["again"] == want
    # 33 tokens: 8 cached blocks, 1 token to compute; 32: the last block is recomputed
    assert computed["again"][0] == recomputed


def test_a_prefix_hit_with_chunked_prefill(llama: Path) -> None:
    engine = _engine(llama, max_num_batched_tokens=5)
    second = [*PREFIX, *range(100, 114)]
    _run(engine, {"a": [*PREFIX, 1]})
    got, computed = _run(engine, {"b": second})
    assert got["b"] == _want(llama, second)
    assert computed["b"][:3] == [5, 5, 4]  # 14 uncached tokens, in chunks of the budget
    assert engine.stats.max_step_tokens <= 5


def test_prefix_hits_across_preemption_keep_tokens_identical(llama: Path) -> None:
    # 20 blocks of 4: three 38-token sequences sharing 32 tokens outgrow what is left
    engine = _engine(llama, num_gpu_blocks=20)
    prompts = {f"r{i}": [*PREFIX, 200 + i, 201, 202, 203, 204, 205] for i in range(3)}
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    got, _ = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.stats.hits > 0
    for rid, prompt in prompts.items():
        assert got[rid] == reference_generate(llama, prompt, 14)
    engine.block_manager.check([])
    assert engine.block_manager.usage() == 0.0


def test_prefix_caching_can_be_disabled(llama: Path) -> None:
    engine = _engine(llama, enable_prefix_caching=False)
    prompt = [*PREFIX, 1]
    _run(engine, {"a": prompt})
    got, computed = _run(engine, {"b": prompt})
    assert got["b"] == _want(llama, prompt)
    assert computed["b"][0] == len(prompt)
    assert engine.block_manager.stats.queries == engine.block_manager.stats.hits == 0
    assert not engine.block_manager.cached and not engine.block_manager.evictable


def test_colliding_hashes_fall_back_to_computing(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 0)
    engine = _engine(llama)
    other = [*range(100, 132), 1]
    _run(engine, {"a": [*PREFIX, 1]})
    got, computed = _run(engine, {"b": other})
    assert got["b"] == _want(llama, other)
    assert computed["b"][0] == len(other)  # every block collided, nothing was reused
    # the same prompt still hits its first block (the one registered under the hash)
    got, computed = _run(engine, {"c": [*PREFIX, 1]})
    assert got["c"] == _want(llama, [*PREFIX, 1])
    assert computed["c"][0] == len(PREFIX) + 1 - 4
