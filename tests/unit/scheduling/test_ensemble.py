"""Ensembles: graph validation, load through the repository manager, and the step DAG at
request time, with a recording test backend whose steps can rendezvous or fail on demand."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from kiln.backends import registry
from kiln.backends.base import Backend, parameter
from kiln.config.ensemble_graph import find_cycle, graph_problems, steps_of
from kiln.config.loader import parse_config_text, validate_config
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferInput, RequestedOutput
from kiln.repository.manager import RepositoryManager
from kiln.server.runtime import runtime_factory

FAIL = -1.0  # an output row starting with this makes the recording model raise


class RecordingBackend(Backend):
    """``Y = sum(inputs) + add``; models named in ``rendezvous`` wait for each other."""

    name: ClassVar[str] = "recording"
    rendezvous: ClassVar[set[str]] = set()
    barrier: ClassVar[threading.Barrier] = threading.Barrier(2)
    calls: ClassVar[list[str]] = []
    created: ClassVar[list[str]] = []

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.created.append(self.config.name)

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        self.calls.append(self.config.name)
        if self.config.name in self.rendezvous:
            # Run one after the other, the first waiter times out and breaks the barrier.
            self.barrier.wait(timeout=10)
        total = sum(inputs[n] for n in sorted(inputs))
        result = np.asarray(total + np.float32(parameter(self.config, "add", "0")))
        if (result[..., 0] == FAIL).any():
            raise ValueError(f"{self.config.name} refuses rows starting with {FAIL}")
        return {"Y": result}


def _model(name: str, inputs: tuple[str, ...] = ("X",), add: int = 0, mbs: int = 8) -> str:
    tensors = ", ".join(f'{{ name: "{i}" data_type: TYPE_FP32 dims: [ 4 ] }}' for i in inputs)
    return f"""
name: "{name}"
backend: "recording"
max_batch_size: {mbs}
input [ {tensors} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
parameters {{ key: "add" value {{ string_value: "{add}" }} }}
"""


def _step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> str:
    maps = [f'input_map {{ key: "{k}" value: "{v}" }}' for k, v in inputs.items()]
    maps += [f'output_map {{ key: "{k}" value: "{v}" }}' for k, v in outputs.items()]
    return f'{{ model_name: "{model}" model_version: -1 {" ".join(maps)} }}'


def _ensemble(name: str, steps: list[str], outputs: tuple[str, ...] = ("OUT",)) -> str:
    outs = ", ".join(f'{{ name: "{o}" data_type: TYPE_FP32 dims: [ 4 ] }}' for o in outputs)
    return f"""
name: "{name}"
platform: "ensemble"
max_batch_size: 8
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {outs} ]
ensemble_scheduling {{ step [ {", ".join(steps)} ] }}
"""


# left and right both read X and are independent; join waits for both.
DIAMOND = _ensemble(
    "diamond",
    [
        _step("left", {"X": "X"}, {"Y": "l"}),
        _step("right", {"X": "X"}, {"Y": "r"}),
        _step("join", {"A": "l", "B": "r"}, {"Y": "OUT"}),
    ],
    outputs=("OUT",),
)


def _write(repo: Path, name: str, config: str) -> None:
    (repo / name / "1").mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(config)


@pytest.fixture
async def repo(tmp_path: Path) -> AsyncIterator[tuple[Path, RepositoryManager]]:
    registry.register("recording", __name__, "RecordingBackend")
    RecordingBackend.rendezvous = set()
    RecordingBackend.barrier = threading.Barrier(2)
    RecordingBackend.calls = []
    RecordingBackend.created = []
    root = tmp_path / "repo"
    _write(root, "left", _model("left", add=1))
    _write(root, "right", _model("right", add=2))
    _write(root, "join", _model("join", ("A", "B")))
    _write(root, "diamond", DIAMOND)
    manager = RepositoryManager([root], runtime_factory(), drain_timeout=5)
    yield root, manager
    await manager.unload_all()


def _request(model: str, x: np.ndarray, outputs: tuple[str, ...] = ()) -> InferenceRequest:
    return InferenceRequest(
        model_name=model,
        inputs=[InferInput("X", DataType.FP32, tuple(x.shape), x)],
        outputs=[RequestedOutput(o) for o in outputs],
    )


def _problems(text: str) -> list[str]:
    config = parse_config_text(text)
    return [e.message for e in validate_config(config, config.name, "config.pbtxt")]


# ---- graph validation (config only) --------------------------------------------------


def test_diamond_is_valid() -> None:
    assert _problems(DIAMOND) == []
    assert find_cycle(steps_of(parse_config_text(DIAMOND))) == ""


def test_unset_model_version_means_latest() -> None:
    text = DIAMOND.replace("model_version: -1 ", "", 1).replace("-1", "3", 1)
    steps = steps_of(parse_config_text(text))
    assert [s.model_version for s in steps] == ["", "3", ""]


def test_cycle_names_steps_and_tensors() -> None:
    text = _ensemble(
        "loop",
        [
            _step("left", {"X": "X"}, {"Y": "OUT"}),
            _step("a", {"X": "b_out"}, {"Y": "a_out"}),
            _step("b", {"X": "a_out"}, {"Y": "b_out"}),
        ],
    )
    (message,) = _problems(text)
    assert message.startswith("in ensemble 'loop', steps form a cycle: ")
    assert "step 1 (model 'a')" in message and "step 2 (model 'b')" in message
    assert "'a_out'" in message and "'b_out'" in message


def test_step_reading_its_own_output_is_a_cycle() -> None:
    text = _ensemble("selfloop", [_step("join", {"A": "X", "B": "OUT"}, {"Y": "OUT"})])
    (message,) = _problems(text)
    assert "cycle: step 0 (model 'join') -> 'OUT' -> step 0 (model 'join')" in message


def test_missing_tensor_names_tensor_and_step() -> None:
    text = _ensemble("gap", [_step("join", {"A": "X", "B": "nowhere"}, {"Y": "OUT"})])
    (message,) = _problems(text)
    assert "step 0 (model 'join') input 'B' reads tensor 'nowhere'" in message
    assert "neither an ensemble input nor an output of any step" in message


def test_unproduced_output() -> None:
    text = _ensemble("short", [_step("left", {"X": "X"}, {"Y": "OUT"})], outputs=("OUT", "MORE"))
    assert _problems(text) == [
        "in ensemble 'short', ensemble output 'MORE' is not produced by any step"
    ]


def test_tensor_fed_twice() -> None:
    text = _ensemble(
        "twice", [_step("left", {"X": "X"}, {"Y": "OUT"}), _step("right", {"X": "X"}, {"Y": "OUT"})]
    )
    (message,) = _problems(text)
    assert "tensor 'OUT' is produced more than once" in message
    assert "step 0 (model 'left') output 'Y'" in message
    assert "step 1 (model 'right') output 'Y'" in message


def test_step_overwriting_an_ensemble_input() -> None:
    text = _ensemble("clobber", [_step("left", {"X": "X"}, {"Y": "X"})])
    messages = graph_problems(parse_config_text(text))
    assert any(
        "tensor 'X' is produced more than once: by ensemble input 'X'" in m for m in messages
    )


def test_ensemble_inputs_are_not_auto_completed() -> None:
    text = (
        'name: "bare" platform: "ensemble" ensemble_scheduling { step [ '
        + _step("left", {"X": "X"}, {"Y": "OUT"})
        + " ] }"
    )
    messages = _problems(text)
    assert any("no input is declared" in m for m in messages)
    assert any("no output is declared" in m for m in messages)


# ---- load through the repository -----------------------------------------------------


async def test_loading_the_ensemble_loads_its_composing_models(
    repo: tuple[Path, RepositoryManager],
) -> None:
    _, manager = repo
    await manager.load("diamond")
    assert all(manager.get(m).ready for m in ("left", "right", "join", "diamond"))
    assert not manager.get("diamond").config.instance_group


async def test_independent_steps_run_concurrently(repo: tuple[Path, RepositoryManager]) -> None:
    _, manager = repo
    RecordingBackend.rendezvous = {"left", "right"}  # each waits until the other runs
    await manager.load("diamond")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)  # batch 2 carried through every step
    response = await manager.get("diamond").infer(_request("diamond", x))
    (out,) = response.outputs
    assert out.name == "OUT" and out.shape == (2, 4)
    np.testing.assert_array_equal(out.data, (x + 1) + (x + 2))
    assert sorted(RecordingBackend.calls[:2]) == ["left", "right"]
    assert RecordingBackend.calls[2] == "join"


async def test_statistics_for_ensemble_and_each_step(repo: tuple[Path, RepositoryManager]) -> None:
    _, manager = repo
    await manager.load("diamond")
    x = np.ones((3, 4), np.float32)
    for _ in range(2):
        await manager.get("diamond").infer(_request("diamond", x))
    for model in ("diamond", "left", "right", "join"):
        stats = manager.get(model).stats
        assert stats.success.count == 2 and stats.inference_count == 6, model
    assert manager.get("left").stats.execution_count == 2
    assert manager.get("diamond").stats.execution_count == 0  # it never executes itself


async def test_failing_step_names_its_model_and_the_ensemble_keeps_serving(
    repo: tuple[Path, RepositoryManager],
) -> None:
    _, manager = repo
    await manager.load("diamond")
    ensemble = manager.get("diamond")
    bad = np.zeros((1, 4), np.float32)
    bad[0, 0] = FAIL - 1  # left adds 1 and fails; right adds 2 and succeeds
    with pytest.raises(KilnError) as info:
        await ensemble.infer(_request("diamond", bad))
    assert info.value.status is Status.INTERNAL
    assert info.value.message.startswith("in ensemble 'diamond', step 0 model 'left' failed: ")
    assert "left refuses rows" in info.value.message
    assert ensemble.stats.fail.count == 1 and manager.get("left").stats.fail.count == 1
    assert "join" not in RecordingBackend.calls  # no step starts after a failure
    response = await ensemble.infer(_request("diamond", np.zeros((1, 4), np.float32)))
    np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 3, np.float32))


async def test_step_input_rejected_by_its_model(repo: tuple[Path, RepositoryManager]) -> None:
    root, manager = repo
    await manager.load("diamond")
    # A hot reload of 'join' with a smaller batch limit: the ensemble sees it at once.
    _write(root, "join", _model("join", ("A", "B"), mbs=2))
    await manager.load("join")
    with pytest.raises(KilnError) as info:
        await manager.get("diamond").infer(_request("diamond", np.zeros((4, 4), np.float32)))
    assert info.value.status is Status.INVALID_ARG
    assert "step 2 model 'join' failed: inference request batch-size must be <= 2" in str(
        info.value
    )


async def test_unloaded_composing_model_makes_requests_unavailable(
    repo: tuple[Path, RepositoryManager],
) -> None:
    _, manager = repo
    await manager.load("diamond")
    await manager.unload("right")
    with pytest.raises(KilnError) as info:
        await manager.get("diamond").infer(_request("diamond", np.zeros((1, 4), np.float32)))
    assert info.value.status is Status.UNAVAILABLE
    assert "step 1 model 'right' failed" in info.value.message
    await manager.load("right")  # back: the ensemble serves again without a reload
    response = await manager.get("diamond").infer(_request("diamond", np.ones((1, 4), "f4")))
    np.testing.assert_array_equal(response.outputs[0].data, np.full((1, 4), 5, np.float32))


async def test_requested_outputs_only(repo: tuple[Path, RepositoryManager]) -> None:
    root, manager = repo
    steps = [_step("left", {"X": "X"}, {"Y": "L"}), _step("right", {"X": "L"}, {"Y": "R"})]
    _write(root, "chain", _ensemble("chain", steps, outputs=("L", "R")))
    await manager.load("chain")
    x = np.zeros((1, 4), np.float32)
    response = await manager.get("chain").infer(_request("chain", x, outputs=("R",)))
    assert [o.name for o in response.outputs] == ["R"]
    np.testing.assert_array_equal(response.outputs[0].data, x + 3)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        (
            _ensemble("bad", [_step("ghost", {"X": "X"}, {"Y": "OUT"})]),
            ["composing model 'ghost'", "no model folder 'ghost'"],
        ),
        (
            _ensemble("bad", [_step("left", {"NOPE": "X"}, {"Y": "OUT"})]),
            ["step 0 (model 'left') has no input 'NOPE'", "['X']"],
        ),
        (
            _ensemble("bad", [_step("join", {"A": "X"}, {"Y": "OUT"})]),
            ["step 0 (model 'join') required input(s) ['B'] are not mapped"],
        ),
        (
            _ensemble("bad", [_step("small", {"X": "X"}, {"Y": "OUT"})]),
            ["max_batch_size 8 is larger than step 0 (model 'small')'s max_batch_size 2"],
        ),
        (
            _ensemble("bad", [_step("bad", {"X": "X"}, {"Y": "OUT"})]),
            ["ensemble 'bad' contains itself through bad -> bad"],
        ),
        (
            _ensemble("bad", [_step("left", {"X": "X"}, {"Y": "OUT"})]).replace(
                'name: "OUT" data_type: TYPE_FP32', 'name: "OUT" data_type: TYPE_INT32'
            ),
            ["ensemble output 'OUT' expects TYPE_INT32 [-1, 4]", "tensor 'OUT' (step 0"],
        ),
    ],
)
async def test_load_fails_with_the_reason(
    repo: tuple[Path, RepositoryManager], config: str, words: list[str]
) -> None:
    root, manager = repo
    _write(root, "small", _model("small", mbs=2))
    _write(root, "bad", config)
    with pytest.raises(KilnError) as info:
        await manager.load("bad")
    assert info.value.message.startswith("failed to load 'bad'")
    for word in words:
        assert word in info.value.message
    (row,) = [r for r in manager.index() if r["name"] == "bad"]
    assert row["state"] == "UNAVAILABLE" and words[0] in row["reason"]


async def test_load_many_loads_each_composing_model_once(
    repo: tuple[Path, RepositoryManager],
) -> None:
    _, manager = repo
    await manager.load_many(manager.model_names())
    runtimes = {r.name: r for r in manager.runtimes()}
    assert set(runtimes) == {"diamond", "left", "right", "join"}
    assert all(r.ready for r in runtimes.values())
    assert sorted(RecordingBackend.created) == ["join", "left", "right"]  # no second load
