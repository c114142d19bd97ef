"""The flex-attention backend on CPU (eager ``flex_attention``): greedy tokens identical to
``transformers`` through chunked prefill and mixed prefill+decode steps (with a sliding
window too), and the BlockMask's block-level sparsity checked against the dense causal (or
windowed) mask (the eager path ignores it, the compiled GPU kernels rely on it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")

from kiln.llm.attention_flex import FLEX_RECOMPILE_LIMIT, Q_BLOCK, FlexMetadata, _build_group
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.sampler import SampledToken
from kiln.llm.scheduler import SchedulerOutput
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm, reference_generate

# eager flex_attention warns once that it is not compiled: that is the point on CPU
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# eager flex_attention costs ~0.1 s a call on CPU whatever the size: few, short requests
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99, 3], list(range(7, 26)), [250]]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(llama: Path) -> list[list[int]]:
    return [reference_generate(llama, p, GREEDY.max_tokens) for p in PROMPTS]


def flex_engine(folder: Path, **kw: int) -> LLMEngine:
    # a small cache: eager flex scores every slot of it
    config = EngineConfig(attention_backend="flex", num_gpu_blocks=24, **kw)  # type: ignore[arg-type]
    return LLMEngine(folder, config)


def test_flex_chunked_prefill_and_mixed_steps_match_transformers(
    llama: Path, expected: list[list[int]]
) -> None:
    engine = flex_engine(llama, max_num_batched_tokens=7)
    assert engine.runner.attention_backend == "flex"
    steps: list[list[int]] = []
    run = engine.runner.run

    def observed(out: SchedulerOutput) -> dict[int, SampledToken]:
        steps.append(list(out.num_new_tokens))
        return run(out)

    engine.runner.run = observed  # type: ignore[method-assign]
    assert engine.generate(PROMPTS, GREEDY) == expected
    # prompt chunks ran beside decodes, and a chunk started mid-page
    assert any(1 in s and any(n > 1 for n in s) for s in steps)
    assert engine.stats.max_step_tokens <= 7
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_flex_prefix_cache_hit_and_qwen2(tmp_path: Path) -> None:
    folder = build_tiny_llm(tmp_path / "q", arch="qwen2")
    shared = list(range(40, 76))  # two full 16-token pages reused by the second request
    prompts = [[*shared, 3], [*shared, 9, 4]]
    want = [reference_generate(folder, p, 6) for p in prompts]
    engine = flex_engine(folder)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts[:1], params) == want[:1]
    assert engine.generate(prompts[1:], params) == want[1:]
    assert engine.block_manager.stats.hits >= 32


def test_flex_sliding_window_matches_transformers(tmp_path: Path) -> None:
    """Mistral with a window of 8 over 16-token pages: a 40-token prompt in chunks beside a
    decode, then a prefix-cache hit past the window."""
    folder = build_tiny_llm(tmp_path / "m", arch="mistral", sliding_window=8)
    prompts = [list(range(30, 70)), [5, 17, 42, 99, 3]]
    hit = [*range(30, 62), 7, 9]  # the first prompt's first two pages
    want = [reference_generate(folder, p, 12) for p in [*prompts, hit]]
    engine = flex_engine(folder, max_num_batched_tokens=16)
    assert engine.config.max_model_len == 256
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert engine.generate(prompts, params) == want[:2]
    assert engine.generate([hit], params) == want[2:]
    assert engine.block_manager.stats.hits == 32
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _dense_truth(
    tables: list[list[int]], computed: list[int], new: list[int], bs: int, pages: int, lq: int,
    window: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """[B, Lq, slots]: row r of sequence b (position computed+r) sees its own slots at
    positions <= its own (and > its own - window); padding rows see nothing."""
    truth = torch.zeros(len(new), lq, pages * bs, dtype=torch.bool)
    for b, (table, c, n) in enumerate(zip(tables, computed, new, strict=True)):
        for r in range(n):
            low = 0 if window is None else max(0, c + r - window + 1)
            for p in range(low, c + r + 1):
                truth[b, r, table[p // bs] * bs + p % bs] = True
    return truth


@pytest.mark.parametrize("window", [None, 5, 150])
def test_block_mask_sparsity_matches_the_dense_causal_mask(window: int | None) -> None:
    """A window of 5 (a page and a bit: every page partial) or 150 (over a query block:
    full pages in the middle, partial at both edges)."""
    bs, pages = 4, 80
    # shared prefix page 7, a chunk starting mid-page, a prefill over two query blocks
    tables = [[7, 2, 9], [7, 11, 3, 5], list(range(20, 60)), [1, 0]]
    computed = [6, 3, 0, 5]
    new = [5, 10, Q_BLOCK + 30, 2]
    meta = FlexMetadata.build(tables, computed, new, bs, pages, CPU, window=window)
    (group,) = meta.groups
    lq = group.token_index.shape[1]
    truth = _dense_truth(tables, computed, new, bs, pages, lq, window)
    # mask_mod alone is exact on real rows (the eager path relies on it)
    b, q, kv = torch.meshgrid(
        torch.arange(len(new)), torch.arange(lq), torch.arange(pages * bs), indexing="ij"
    )
    mask_mod = group.block_mask.mask_mod
    dense = mask_mod(b, torch.zeros_like(b), q, kv)
    valid = group.query_valid[:, :, None]
    assert torch.equal(dense & valid, truth)
    # block level: full blocks all visible, partial ones hold the rest, nothing is missed
    nq = -(-lq // Q_BLOCK)
    num_full = int(group.full_kv_num_blocks.sum())
    assert (num_full > 0) == (window != 5)
    for bi in range(len(new)):
        for j in range(nq):
            rows = truth[bi, j * Q_BLOCK : (j + 1) * Q_BLOCK].view(-1, pages, bs)
            real = group.query_valid[bi, j * Q_BLOCK : (j + 1) * Q_BLOCK]
            n_full = int(group.full_kv_num_blocks[bi, 0, j])
            n_part = int(group.kv_num_blocks[bi, 0, j])
            full = group.full_kv_indices[bi, 0, j, :n_full].tolist()
            part = group.kv_indices[bi, 0, j, :n_part].tolist()
            assert not set(full) & set(part)
            for page in full:
                assert rows[real][:, page].all()
            seen = {p for p in range(pages) if rows[:, p].any()}
            assert seen == set(full) | set(part)


def test_decodes_and_prefills_go_in_separate_groups() -> None:
    meta = FlexMetadata.build([[0], [1, 2], [3]], [4, 0, 2], [1, 20, 1], 16, 8, CPU)
    decode, prefill = meta.groups
    assert decode.is_decode and decode.token_index[:, 0].tolist() == [0, 21]
    assert not prefill.is_decode and prefill.token_index[0, :20].tolist() == list(range(1, 21))
    assert meta.slot_mapping.tolist() == [4] + [16 + i for i in range(16)] + [32, 33, 34, 35, 50]
    assert meta.kernel_options is None and not meta.compiled


def test_compiled_flex_stays_within_its_recompile_limit() -> None:
    """What the CUDA path compiles, traced by Dynamo on CPU (backend "eager": no kernels):
    decode graphs' captures, then prefills and eager decodes of assorted sizes, for a model
    with full and windowed layers. That is more variants than torch.compile's default limit
    of 8, which fullgraph=True turns into FailOnRecompileLimitHit; FLEX_RECOMPILE_LIMIT holds
    them."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    attend = torch.compile(
        flex_attention,
        fullgraph=True,
        backend="eager",
        recompile_limit=FLEX_RECOMPILE_LIMIT,
        isolate_recompiles=True,
    )
    bs, pages, heads, kv_heads, dim = 16, 64, 4, 2, 16
    keys = torch.zeros(1, kv_heads, pages * bs, dim)

    def step(new: list[int], computed: list[int], window: int | None, width: int = 0) -> None:
        tables, first = [], 0
        for c, n in zip(computed, new, strict=True):
            used = -(-(c + n) // bs)
            tables.append(list(range(first, first + used)))
            first += used
        starts = [sum(new[:i]) for i in range(len(new))]
        group = _build_group(tables, computed, new, starts, bs, pages, CPU, width, True, window)
        queries = torch.zeros(len(new), heads, group.token_index.shape[1], dim)
        attend(
            queries,
            keys,
            keys,
            block_mask=group.block_mask,
            enable_gqa=True,
            kernel_options={"BLOCK_N": bs},
        )

    before = counters["stats"]["unique_graphs"]
    for window in (None, 24):
        for size in (8, 4, 2, 1):  # DecodeGraphs captures, largest first
            step([1] * size, [0] * size, window, width=16)
        for new, computed in (([5], [0]), ([19], [0]), ([40, 7], [0, 0]), ([200], [0])):
            step(new, computed, window)
        for size in (1, 3, 8):
            step([1] * size, [30 + 17 * i for i in range(size)], window)
    compiled = counters["stats"]["unique_graphs"] - before
    assert 8 < compiled <= FLEX_RECOMPILE_LIMIT // 2
    torch._dynamo.reset()


def test_cuda_path_compiles_flex_with_that_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.llm import attention_flex

    calls: list[dict[str, object]] = []

    def compile_(fn: object, *, fullgraph: bool = False, recompile_limit: int = 8) -> object:
        calls.append({"fullgraph": fullgraph, "recompile_limit": recompile_limit})
        return fn

    monkeypatch.setattr(attention_flex, "_compiled", None)
    monkeypatch.setattr(torch, "compile", compile_)
    attention_flex._flex()
    assert calls == [{"fullgraph": True, "recompile_limit": FLEX_RECOMPILE_LIMIT}]


def test_an_older_torch_gets_the_limit_through_dynamo_s_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch < 2.13's ``compile`` has no ``recompile_limit`` (found on a GPU machine with
    torch 2.11): dynamo's global limit is raised to it instead, never lowered."""
    from kiln.llm import attention_flex

    calls: list[dict[str, object]] = []

    def old_compile(fn: object, *, fullgraph: bool = False) -> object:
        calls.append({"fullgraph": fullgraph})
        return fn

    # a stand-in for dynamo's config: the real one is global to the test process
    config = SimpleNamespace(recompile_limit=8)
    monkeypatch.setattr(attention_flex, "_dynamo_config", lambda: config)
    monkeypatch.setattr(attention_flex, "_compiled", None)
    monkeypatch.setattr(torch, "compile", old_compile)
    attention_flex._flex()
    assert calls == [{"fullgraph": True}]
    assert config.recompile_limit == FLEX_RECOMPILE_LIMIT
    monkeypatch.setattr(attention_flex, "_compiled", None)
    config.recompile_limit = 10 * FLEX_RECOMPILE_LIMIT
    attention_flex._flex()
    assert config.recompile_limit == 10 * FLEX_RECOMPILE_LIMIT
    older = SimpleNamespace(cache_size_limit=8)  # its name before torch 2.6
    monkeypatch.setattr(attention_flex, "_dynamo_config", lambda: older)
    monkeypatch.setattr(attention_flex, "_compiled", None)
    attention_flex._flex()
    assert older.cache_size_limit == FLEX_RECOMPILE_LIMIT


def test_unknown_attention_backend_is_refused(llama: Path) -> None:
    from kiln.core.errors import KilnError

    with pytest.raises(KilnError, match="attention_backend must be one of auto, torch, cpu, flex"):
        LLMEngine(llama, EngineConfig(attention_backend="flash"))
    assert LLMEngine(llama, EngineConfig(num_gpu_blocks=8)).runner.attention_backend == "cpu"
