"""vLLM's ``VLLM_BATCH_INVARIANT``: with ``batch_invariant`` on, a request's tokens and
logprobs are the same bits alone, in a full batch, joined by others mid-way (mixed
prefill and decode steps), split into prefill chunks, after preemption and from the prefix
cache. The product that makes it so (oneDNN on fixed tiles) is checked row by row, and
what kiln has no invariant path for is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kiln.core.errors import KilnError  # noqa: E402
from kiln.llm import cpu_linear  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from kiln.llm.spec_config import SpeculativeConfig  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch without oneDNN")

PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3,
                        prompt_logprobs=1)  # fmt: skip
PROBE = [5, 17, 42, 99, 3, 8, 120, 64, 7]
OTHERS = [[7 + i, 8 * i % 200 + 1, 9, 10 + i] * (1 + i % 4) for i in range(10)]

Run = tuple[list[int], list[object], list[object]]


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


def engine(folder: Path, **kw: object) -> LLMEngine:
    settings = dict(batch_invariant=True, block_size=4, num_gpu_blocks=256, max_num_seqs=16)
    settings.update(kw)
    return LLMEngine(folder, EngineConfig(**settings))  # type: ignore[arg-type]


def run(
    eng: LLMEngine,
    join_after: int = -1,
    others: list[list[int]] = OTHERS,
    params: SamplingParams = PARAMS,
) -> Run:
    """The probe's tokens, logprobs and prompt logprobs; ``others`` join after
    ``join_after`` steps (-1: with it, 0: never)."""
    tokens: list[int] = []
    logprobs: list[object] = []
    prompt: list[object] = []
    if join_after == -1:
        for i, p in enumerate(others):
            eng.add_request(f"o{i}", p, params)
    eng.add_request("probe", PROBE, params)
    steps = 0
    while eng.has_work():
        steps += 1
        if steps == join_after:
            for i, p in enumerate(others):
                eng.add_request(f"o{i}", p, params)
        for out in eng.step():
            if out.request_id == "probe":
                tokens += out.new_token_ids
                logprobs += out.logprobs or []
                prompt += out.prompt_logprobs or []
    return tokens, logprobs, prompt


def test_tiles_give_every_row_the_same_bits_whatever_beside_it() -> None:
    torch.manual_seed(0)
    linear = cpu_linear.PackedLinear.wrap(torch.nn.Linear(96, 200, bias=True))
    linear.tile = cpu_linear.TILE_ROWS
    row = torch.randn(1, 96)
    alone = linear(row)
    for n in (1, 2, 15, 16, 17, 40, 150, 300):
        batch = torch.cat([torch.randn(n, 96) * 5, row, torch.randn(3, 96)])
        assert torch.equal(linear(batch)[n], alone[0])
    # 3-D input (a step's [tokens, hidden] as [1, tokens, hidden]) keeps its shape
    assert linear(row.view(1, 1, 96)).shape == (1, 1, 200)


def test_a_request_is_the_same_alone_and_in_any_batch(llama: Path) -> None:
    alone = run(engine(llama), others=[])
    assert len(alone[0]) == 10 and len(alone[1]) == 10 and len(alone[2]) == len(PROBE)
    assert run(engine(llama)) == alone  # a full batch from the start
    for join_after in (1, 3, 6):  # others' prefills in the probe's decode steps
        assert run(engine(llama), join_after) == alone
    # prefill split in chunks of 4 tokens, and a batch budget shared with the others
    assert run(engine(llama, max_num_batched_tokens=4)) == alone
    assert run(engine(llama, max_num_batched_tokens=12), 2) == alone


def test_preemption_and_the_prefix_cache_keep_the_bits(llama: Path) -> None:
    alone = run(engine(llama), others=[])
    # few blocks: the batch preempts and recomputes
    tight = engine(llama, num_gpu_blocks=24)
    assert run(tight, 2) == alone
    assert tight.scheduler.num_preemptions > 0
    # the probe again on a warm engine: its prompt's blocks come from the prefix cache
    # (prompt logprobs are not asked: they would be computed again, not read)
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)
    alone = run(engine(llama), others=[], params=plain)
    warm = engine(llama)
    run(warm, others=[], params=plain)
    before = warm.block_manager.stats.hits
    assert run(warm, 2, params=plain) == alone
    assert warm.block_manager.stats.hits >= before + 8  # two full blocks of the probe


def test_the_environment_switch_and_the_refusals(
    llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert EngineConfig().batch_invariant
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert not EngineConfig().batch_invariant
    cases = {
        "it runs on the CPU in float32": {"dtype": "bfloat16"},
        "attention_backend 'cpu'": {"attention_backend": "torch"},
        "not supported with speculative_config": {
            "speculative_config": SpeculativeConfig.from_json(
                '{"method": "ngram", "num_speculative_tokens": 2}'
            )
        },
    }
    for message, kw in cases.items():
        with pytest.raises(KilnError, match=message):
            engine(llama, **kw)


def test_the_parameter_and_the_settings_it_excludes(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.backends.base import InstanceSpec
    from kiln.config.model_config_pb2 import ModelConfig
    from kiln.llm.backend import engine_config

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    config = ModelConfig(name="m", backend="llm")
    spec = InstanceSpec("m_0", "cpu", 0, 0, 1)
    assert not engine_config(config, spec).batch_invariant
    config.parameters["batch_invariant"].string_value = "true"
    assert engine_config(config, spec).batch_invariant
    config.parameters["batch_invariant"].string_value = "maybe"
    with pytest.raises(KilnError, match="batch_invariant must be true or false"):
        engine_config(config, spec)
    with pytest.raises(KilnError, match="not supported with tensor_parallel_size > 1"):
        EngineConfig(batch_invariant=True, tensor_parallel_size=2).check()
