"""Ragged batching: the merged batch, every batch input kind, scattered outputs, config
checks (kiln/scheduling/ragged.py, kiln/config/loader.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import InstanceSpec
from kiln.backends.python.backend import PythonBackend
from kiln.config.loader import validate_config
from kiln.config.model_config_pb2 import ModelConfig
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError
from kiln.core.stats import RequestTimes
from kiln.scheduling.base import Job
from kiln.scheduling.ragged import RaggedBatching

CONFIG = """
name: "ragged"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] allow_ragged_batch: true },
        { name: "SCALE" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "SUM" data_type: TYPE_FP32 dims: [ 1 ] } ]
batch_input [
  { kind: BATCH_ELEMENT_COUNT target_name: "COUNT" data_type: TYPE_INT32 source_input: "INPUT" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "ENDS" data_type: TYPE_FP32
    source_input: "INPUT" },
  { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO target_name: "OFFSETS"
    data_type: TYPE_INT64 source_input: "INPUT" },
  { kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "LONGEST" data_type: TYPE_INT32
    source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE target_name: "SHAPES" data_type: TYPE_INT64 source_input: "INPUT" },
  { kind: BATCH_ITEM_SHAPE_FLATTEN target_name: "FLAT" data_type: TYPE_INT32
    source_input: "INPUT" }
]
batch_output [ { target_name: "OUT" kind: BATCH_SCATTER_WITH_INPUT_SHAPE source_input: "INPUT" } ]
"""


def config(text: str = CONFIG) -> ModelConfig:
    return text_format.Parse(text, ModelConfig())


def job(lengths: list[int], scale: float = 1.0) -> Job:
    """One request of len(lengths) batch rows; row i holds lengths[i] values (they must be
    equal: a request's own rows are a dense array)."""
    rows, width = len(lengths), lengths[0]
    data = np.arange(rows * width, dtype=np.float32).reshape(rows, width) + 100 * width
    inputs = {"INPUT": data, "SCALE": np.full((rows, 1), scale, np.float32)}
    return Job(inputs, ["OUT", "SUM"], rows, RequestTimes())


def test_ragged_inputs_are_flattened_end_to_end_with_every_batch_input() -> None:
    ragged = RaggedBatching.of(config())
    assert ragged is not None
    jobs = [job([3]), job([4, 4]), job([5])]  # element counts 3, 8, 5
    merged = ragged.merge(jobs)
    assert merged["INPUT"].shape == (16,)
    np.testing.assert_array_equal(
        merged["INPUT"], np.concatenate([j.inputs["INPUT"].reshape(-1) for j in jobs])
    )
    assert merged["SCALE"].shape == (4, 1)  # not ragged: along the batch dimension
    assert merged["COUNT"].tolist() == [3, 8, 5] and merged["COUNT"].dtype == np.int32
    assert merged["ENDS"].tolist() == [3.0, 11.0, 16.0] and merged["ENDS"].dtype == np.float32
    assert merged["OFFSETS"].tolist() == [0, 3, 11, 16] and merged["OFFSETS"].dtype == np.int64
    assert merged["LONGEST"].shape == (8,)  # the largest element count, as a shape
    # one row per batch item (the second request has two), without the batch dimension
    assert merged["SHAPES"].tolist() == [[3], [4], [4], [5]]
    assert merged["FLAT"].tolist() == [3, 4, 4, 5] and merged["FLAT"].dtype == np.int32


def test_requests_differing_only_in_ragged_shapes_share_a_batch() -> None:
    ragged = RaggedBatching.of(config())
    assert ragged is not None
    assert ragged.key(job([3]).inputs) == ragged.key(job([7, 7]).inputs)
    other = job([3])
    other.inputs["SCALE"] = np.ones((1, 2), np.float32)  # a non-ragged input of another shape
    assert ragged.key(other.inputs) != ragged.key(job([3]).inputs)


def test_a_scattered_output_goes_back_in_each_request_s_input_shape() -> None:
    ragged = RaggedBatching.of(config())
    assert ragged is not None
    jobs = [job([3]), job([4, 4]), job([5])]
    merged = ragged.merge(jobs)
    outputs = {"OUT": merged["INPUT"] * 2, "SUM": np.arange(4, dtype=np.float32).reshape(4, 1)}
    parts = ragged.split(outputs, jobs)
    for part, j in zip(parts, jobs, strict=True):
        np.testing.assert_array_equal(part["OUT"], j.inputs["INPUT"] * 2)
    # a plain output splits along the batch dimension (rows 0 | 1, 2 | 3)
    assert [p["SUM"].tolist() for p in parts] == [[[0.0]], [[1.0], [2.0]], [[3.0]]]
    (alone,) = ragged.split({"OUT": jobs[2].inputs["INPUT"].reshape(-1)}, [jobs[2]])
    assert alone["OUT"].shape == (1, 5)


def test_a_scattered_output_of_the_wrong_length_names_the_output_and_input() -> None:
    ragged = RaggedBatching.of(config())
    assert ragged is not None
    jobs = [job([3]), job([5])]
    with pytest.raises(KilnError) as info:
        ragged.split({"OUT": np.zeros(7, np.float32), "SUM": np.zeros((2, 1))}, jobs)
    assert info.value.message == (
        "model 'ragged' returned output 'OUT' with 7 rows, but its batch_output "
        "BATCH_SCATTER_WITH_INPUT_SHAPE needs 8: the element count of input 'INPUT' in the batch"
    )


def test_batch_inputs_are_not_the_client_s_to_send() -> None:
    cfg = config()
    cfg.input.add(name="ENDS", data_type=cfg.input[0].data_type, dims=[-1])  # auto-completed
    assert set(ModelSignature(cfg).inputs) == {"INPUT", "SCALE"}


def test_a_model_without_ragged_batching_has_none() -> None:
    assert RaggedBatching.of(config('name: "plain" max_batch_size: 4')) is None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            ("max_batch_size: 8", "max_batch_size: 0"),
            'input "INPUT": allow_ragged_batch needs max_batch_size > 0',
        ),
        (
            ('"COUNT" data_type: TYPE_INT32', '"COUNT" data_type: TYPE_FP16'),
            "batch_input[0] data_type must be one of TYPE_INT32, TYPE_INT64, TYPE_FP32, got "
            "TYPE_FP16",
        ),
        (
            (
                'target_name: "SHAPES" data_type: TYPE_INT64 source_input: "INPUT"',
                'target_name: "SHAPES" data_type: TYPE_INT64 source_input: "NOPE"',
            ),
            'batch_input[4] source_input "NOPE" is not an input of the model',
        ),
        (
            ('batch_output [ { target_name: "OUT"', 'batch_output [ { target_name: "GONE"'),
            'batch_output[0] target_name "GONE" is not an output of the model',
        ),
        (
            ("batch_output [", "sequence_batching { }\nbatch_output ["),
            "ragged batching (allow_ragged_batch, batch_input, batch_output) works with "
            "dynamic_batching or no scheduler, not with sequence_batching",
        ),
    ],
)
def test_config_errors_name_the_field(change: tuple[str, str], message: str) -> None:
    text = CONFIG.replace(*change)
    assert text != CONFIG
    problems = validate_config(config(text), "ragged", "ragged/config.pbtxt", text)
    assert any(message in str(p) for p in problems), [str(p) for p in problems]


def test_the_python_backend_refuses_batch_inputs(tmp_path: Path) -> None:
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.py").write_text("class TritonPythonModel:\n    pass\n")
    cfg = config(CONFIG.replace('name: "ragged"', 'name: "ragged"\nbackend: "python"'))
    with pytest.raises(KilnError) as info:
        PythonBackend(cfg, tmp_path / "1", InstanceSpec("ragged", "cpu", 0, 0, 1))
    assert "batch_input and batch_output do not apply" in info.value.message
    assert "'ragged'" in info.value.message
