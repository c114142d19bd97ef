"""vLLM's weight versions (``kiln.llm.weight_versions``): the engine labels each sample's
output tokens with the weight version they were sampled under, reports the spans when the
labels change (never per token), and the frontend, the offline ``LLM`` and the engine
process carry them to the finished sample, as vLLM's output processor does."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.llm import weight_versions
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.engine_control import EngineControl
from kiln.llm.sequence import SamplingParams
from tests.llm_models import build_tiny_llm

PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def engine(folder: Path) -> LLMEngine:
    return LLMEngine(folder, EngineConfig(block_size=4, num_gpu_blocks=64))


def collect(engine: LLMEngine) -> dict[tuple[str, int], list[RequestOutput]]:
    outs: dict[tuple[str, int], list[RequestOutput]] = {}
    while engine.has_work():
        for r in engine.step():
            outs.setdefault((r.request_id, r.index), []).append(r)
    return outs


def last_starts(outs: list[RequestOutput]) -> list[tuple[str, int]] | None:
    sent = [o.weight_version_starts for o in outs if o.weight_version_starts is not None]
    return sent[-1] if sent else None


def test_spans_cover_the_tokens_and_drop_versions_that_sampled_nothing() -> None:
    assert weight_versions.spans(None, 5) is None
    assert weight_versions.spans([("a", 0)], 0) == []  # vLLM: no token, no span
    assert weight_versions.spans([("a", 0), ("b", 3)], 7) == [
        {"version": "a", "start": 0, "end": 3},
        {"version": "b", "start": 3, "end": 7},
    ]
    # a stop string cut the sample before the second version's first token
    assert weight_versions.spans([("a", 0), ("b", 3)], 3) == [
        {"version": "a", "start": 0, "end": 3}
    ]


def test_a_version_change_mid_generation_splits_the_spans_at_that_step(
    engine: LLMEngine,
) -> None:
    control = EngineControl(engine)
    assert control.run("t", "state", {})["weight_version"] == "default"
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=12, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip
    first: list[RequestOutput] = []
    for _ in range(4):
        first += engine.step()
    made = sum(len(o.new_token_ids) for o in first)
    assert 0 < made < 12
    # only the sample's first output carried the starts, not one per token
    assert [o.weight_version_starts for o in first] == [[("default", 0)]] + [None] * (
        len(first) - 1
    )
    assert control.run("t", "set_weight_version", {"version": "step-7"}) == {}
    assert control.run("t", "state", {})["weight_version"] == "step-7"
    rest = collect(engine)[("a", 0)]
    starts = last_starts(rest)
    assert starts == [("default", 0), ("step-7", made)]
    assert rest[-1].finished
    assert weight_versions.spans(starts, 12) == [
        {"version": "default", "start": 0, "end": made},
        {"version": "step-7", "start": made, "end": 12},
    ]


def test_versions_that_sampled_nothing_leave_no_span_and_n_samples_each_get_theirs(
    engine: LLMEngine,
) -> None:
    engine.set_weight_version("v1")
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=6, n=2, temperature=1.0,
                                                   ignore_eos=True, seed=3))  # fmt: skip
    # two changes before any token: only the last one labels the tokens
    engine.set_weight_version("v2")
    engine.set_weight_version("v3")
    outs = collect(engine)
    for index in (0, 1):
        starts = last_starts(outs[("a", index)])
        assert weight_versions.spans(starts, 6) == [{"version": "v3", "start": 0, "end": 6}]
    # back and forth with no token in between is no change
    engine.add_request("b", PROMPT, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True))  # fmt: skip
    engine.step()
    engine.set_weight_version("v4")
    engine.set_weight_version("v3")
    starts = last_starts(collect(engine)[("b", 0)])
    assert weight_versions.spans(starts, 6) == [{"version": "v3", "start": 0, "end": 6}]


def test_the_offline_llm_reports_spans_and_refuses_weight_transfer(folder: Path) -> None:
    from kiln.llm.offline import LLM
    from kiln.llm.offline import SamplingParams as OfflineParams

    llm = LLM(str(folder), block_size=4, num_gpu_blocks=64)
    assert llm.get_weight_version() == "default"
    llm.update_weight_version("ckpt-12")
    assert llm.get_weight_version() == "ckpt-12"
    params = OfflineParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)
    (sample,) = out.outputs
    assert [(s.version, s.start, s.end) for s in sample.weight_versions or []] == [
        ("ckpt-12", 0, 5)
    ]
    with pytest.raises(ValueError, match="at most 256"):
        llm.update_weight_version("x" * 257)
    for call in (llm.start_weight_update, llm.shutdown_weight_transfer_engine):
        with pytest.raises(NotImplementedError, match="no weight transfer engine"):
            call()
    with pytest.raises(NotImplementedError, match="no weight transfer engine"):
        llm.update_weights({"update_info": {}})
    assert llm.get_weight_version() == "ckpt-12"
