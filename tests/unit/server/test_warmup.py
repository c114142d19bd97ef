"""model_warmup: samples built from zero/random/file data, run on every instance at load."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError
from kiln.server.runtime import ModelRuntime
from kiln.server.warmup import build_samples

BOOM = 13.0  # an INPUT row starting with this makes the recording model raise


class Record:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: list[tuple[int, dict[str, np.ndarray]]] = []
        self.closed = 0


class RecordingBackend(Backend):
    name: ClassVar[str] = "recording"
    record: ClassVar[Record]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        with self.record.lock:
            self.record.calls.append(
                (self.instance.index, {k: v.copy() for k, v in inputs.items()})
            )
        if BOOM in inputs["INPUT"]:
            raise ValueError("the recording model refuses 13")
        return {"OUT": inputs["INPUT"] * 2}

    def close(self) -> None:
        with self.record.lock:
            self.record.closed += 1


MODEL = """
name: "rec"
max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 3 ] }},
        {{ name: "TEXT" data_type: TYPE_STRING dims: [ 2 ] }},
        {{ name: "GRID" data_type: TYPE_INT32 dims: [ 2, 2 ] reshape {{ shape: [ 4 ] }} }},
        {{ name: "EXTRA" data_type: TYPE_FP32 dims: [ 1 ] optional: true }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ 3 ] }} ]
instance_group [ {{ count: 3 kind: KIND_CPU }} ]
{warmup}
"""

ZERO_INPUTS = """
  inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true } }
  inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] zero_data: true } }
  inputs { key: "GRID" value: { data_type: TYPE_INT32 dims: [ 2, 2 ] zero_data: true } }
"""

FILE_INPUTS = """
  inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 3 ] input_data_file: "input" } }
  inputs { key: "TEXT" value: { data_type: TYPE_STRING dims: [ 2 ] input_data_file: "text" } }
  inputs { key: "GRID" value: { data_type: TYPE_INT32 dims: [ 2, 2 ] random_data: true } }
"""


def config(warmup: str, mbs: int = 4) -> ModelConfig:
    return text_format.Parse(MODEL.format(mbs=mbs, warmup=warmup), ModelConfig())


def model_dir(tmp_path: Path, first: float = 1.5) -> Path:
    (tmp_path / "1").mkdir(exist_ok=True)
    (tmp_path / "warmup").mkdir(exist_ok=True)
    (tmp_path / "warmup" / "input").write_bytes(np.array([first, 2, 3], "<f4").tobytes())
    strings = b"".join(len(s).to_bytes(4, "little") + s for s in (b"hi", b"\xc3\xa9t\xc3\xa9"))
    (tmp_path / "warmup" / "text").write_bytes(strings)
    return tmp_path


def runtime(tmp_path: Path, cfg: ModelConfig) -> tuple[ModelRuntime, Record]:
    record = Record()
    backend = type("Recording", (RecordingBackend,), {"record": record})
    return ModelRuntime("rec", 1, cfg, tmp_path / "1", backend), record


async def test_every_sample_runs_count_times_on_every_instance(tmp_path: Path) -> None:
    cfg = config(
        f'model_warmup [ {{ name: "zeros" batch_size: 2 count: 2 {ZERO_INPUTS} }},'
        f' {{ name: "files" batch_size: 1 {FILE_INPUTS} }} ]'
    )
    rt, record = runtime(model_dir(tmp_path), cfg)
    await rt.load()
    try:
        assert rt.ready
        per_instance = {i: [c for idx, c in record.calls if idx == i] for i in range(3)}
        assert {i: len(calls) for i, calls in per_instance.items()} == {0: 3, 1: 3, 2: 3}
        for calls in per_instance.values():
            zeros, again, files = calls
            assert set(zeros) == {"INPUT", "TEXT", "GRID"}  # the optional input is left out
            np.testing.assert_array_equal(zeros["INPUT"], np.zeros((2, 3), np.float32))
            assert zeros["TEXT"].shape == (2, 2) and set(zeros["TEXT"].ravel()) == {b""}
            assert zeros["GRID"].shape == (2, 4)  # the config's reshape applies
            np.testing.assert_array_equal(again["INPUT"], zeros["INPUT"])
            np.testing.assert_array_equal(files["INPUT"], [[1.5, 2, 3]])
            assert files["TEXT"].tolist() == [[b"hi", "été".encode()]]
            assert files["GRID"].dtype == np.int32 and files["GRID"].shape == (1, 4)
            assert ((files["GRID"] >= 0) & (files["GRID"] < 100)).all()
        # Warm-up is not traffic: the statistics start clean.
        assert rt.stats.execution_count == 0 and rt.stats.success.count == 0
    finally:
        await rt.unload(5)


async def test_count_zero_runs_once_and_no_warmup_runs_nothing(tmp_path: Path) -> None:
    rt, record = runtime(model_dir(tmp_path), config(f"model_warmup [{{ {ZERO_INPUTS} }}]"))
    await rt.load()
    await rt.unload(5)
    assert len(record.calls) == 3  # batch_size unset: one request per instance
    assert all(call["INPUT"].shape == (1, 3) for _, call in record.calls)
    plain, nothing = runtime(tmp_path, config(""))
    await plain.load()
    await plain.unload(5)
    assert nothing.calls == []


async def test_a_failing_warmup_fails_the_load_and_closes_the_instances(tmp_path: Path) -> None:
    cfg = config(f'model_warmup [ {{ name: "boom" batch_size: 3 {FILE_INPUTS} }} ]')
    rt, record = runtime(model_dir(tmp_path, first=BOOM), cfg)
    with pytest.raises(KilnError) as err:
        await rt.load()
    message = err.value.message
    assert message.startswith("warm-up 'boom' failed: instance rec_0 #")
    assert "model 'rec' failed to execute: ValueError: the recording model refuses 13" in message
    assert not rt.ready
    assert record.closed == 3


@pytest.mark.parametrize(
    ("sample", "reason"),
    [
        (f"batch_size: 5 {ZERO_INPUTS}", "batch_size 5 exceeds max_batch_size 4"),
        (
            ZERO_INPUTS + 'inputs { key: "NOPE" value: { data_type: TYPE_FP32 dims: [1] '
            "zero_data: true } }",
            "unexpected input 'NOPE' for model 'rec'",
        ),
        (ZERO_INPUTS.split("\n", 2)[2], "no data for input 'INPUT'"),
        (
            ZERO_INPUTS.replace("TYPE_FP32", "TYPE_FP16"),
            "input 'INPUT' is TYPE_FP16, but the model expects TYPE_FP32",
        ),
        (
            ZERO_INPUTS.replace("dims: [ 3 ]", "dims: [ 4 ]"),
            "input 'INPUT' has dims [4], but the model expects [3]",
        ),
        (
            ZERO_INPUTS.replace(
                'zero_data: true } }\n  inputs { key: "TEXT"', '} }\n  inputs { key: "TEXT"'
            ),
            "input 'INPUT' sets none of zero_data, random_data, input_data_file",
        ),
        (
            FILE_INPUTS.replace('"input"', '"missing"'),
            "cannot read input_data_file 'warmup/missing'",
        ),
        (
            FILE_INPUTS.replace('"input"', '"../1/x"'),
            "input_data_file '../1/x' is outside warmup/",
        ),
        (
            FILE_INPUTS.replace('"input"', '"text"'),
            "input 'INPUT': input_data_file has 15 bytes, but 3 FP32 elements need 12",
        ),
        (
            FILE_INPUTS.replace('"text" }', '"input" }'),
            "input 'TEXT': input_data_file: element 0 runs past the end",
        ),
    ],
)
def test_malformed_samples_name_the_sample_and_the_reason(
    tmp_path: Path, sample: str, reason: str
) -> None:
    cfg = config(f'model_warmup [ {{ name: "bad" {sample} }} ]')
    with pytest.raises(KilnError) as err:
        build_samples(cfg, ModelSignature(cfg), model_dir(tmp_path))
    assert err.value.message.startswith("warm-up 'bad' failed: ")
    assert reason in err.value.message


def test_a_model_without_batching_takes_batch_size_one_only(tmp_path: Path) -> None:
    cfg = config(f'model_warmup [ {{ name: "nb" batch_size: 2 {ZERO_INPUTS} }} ]', mbs=0)
    with pytest.raises(KilnError) as err:
        build_samples(cfg, ModelSignature(cfg), model_dir(tmp_path))
    assert "batch_size is 2, but model 'rec' does not batch (use 1)" in err.value.message
    ok = config(f'model_warmup [ {{ name: "nb" batch_size: 1 {ZERO_INPUTS} }} ]', mbs=0)
    (sample,) = build_samples(ok, ModelSignature(ok), model_dir(tmp_path))
    assert sample.inputs["INPUT"].shape == (3,) and sample.inputs["GRID"].shape == (4,)


# ---- sequence models: the batcher's own inputs come with the sample ----------------------
SEQUENCE = """
name: "acc"
max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "END" control [ {{ kind: CONTROL_SEQUENCE_END bool_false_true: [ false, true ] }} ] }},
    {{ name: "READY" control [ {{ kind: CONTROL_SEQUENCE_READY fp32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
  state [ {{ input_name: "ACC_IN" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 2 ]
             initial_state {{ name: "one" data_type: TYPE_INT32 dims: [ 2 ]
                              data_file: "init" }} }} ]
}}
model_warmup [ {{ name: "seq" batch_size: {batch}
  inputs {{ key: "INPUT" value: {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true }} }}
  {more} }} ]
"""


def sequence_config(tmp_path: Path, mbs: int = 4, batch: int = 2, more: str = "") -> ModelConfig:
    (tmp_path / "initial_state").mkdir(exist_ok=True)
    (tmp_path / "initial_state" / "init").write_bytes(np.array([7, 8], "<i4").tobytes())
    text = SEQUENCE.format(mbs=mbs, batch=batch, more=more)
    return text_format.Parse(text, ModelConfig())


def test_a_sequence_sample_gets_its_controls_and_initial_state(tmp_path: Path) -> None:
    cfg = sequence_config(tmp_path)
    (sample,) = build_samples(cfg, ModelSignature(cfg), tmp_path)
    # each row is a whole sequence of one request: START, END and READY true, CORRID 0
    assert sample.inputs["START"].tolist() == [[1], [1]]
    assert sample.inputs["START"].dtype == np.int32
    assert sample.inputs["END"].tolist() == [[True], [True]]
    assert sample.inputs["READY"].tolist() == [[1.0], [1.0]]
    assert sample.inputs["READY"].dtype == np.float32
    assert sample.inputs["CORRID"].tolist() == [[0], [0]]
    assert sample.inputs["CORRID"].dtype == np.uint64
    assert sample.inputs["ACC_IN"].tolist() == [[7, 8], [7, 8]]  # the initial state
    unbatched = sequence_config(tmp_path, mbs=0, batch=1)
    (one,) = build_samples(unbatched, ModelSignature(unbatched), tmp_path)
    assert one.inputs["START"].tolist() == [1] and one.inputs["ACC_IN"].tolist() == [7, 8]


def test_a_sequence_sample_may_give_the_batcher_s_inputs_itself(tmp_path: Path) -> None:
    # as in Triton, where a warm-up request carries the controls the model reads
    more = 'inputs { key: "START" value: { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true } }'
    cfg = sequence_config(tmp_path, more=more)
    (sample,) = build_samples(cfg, ModelSignature(cfg), tmp_path)
    assert sample.inputs["START"].tolist() == [[0], [0]]
    assert sample.inputs["END"].tolist() == [[True], [True]]  # the rest still filled in


def test_a_sequence_input_of_the_wrong_type_names_it(tmp_path: Path) -> None:
    more = 'inputs { key: "START" value: { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } }'
    cfg = sequence_config(tmp_path, more=more)
    with pytest.raises(KilnError) as err:
        build_samples(cfg, ModelSignature(cfg), tmp_path)
    assert err.value.message == (
        "warm-up 'seq' failed: sequence input 'START' is TYPE_FP32, but the model's "
        "sequence_batching makes it TYPE_INT32"
    )
