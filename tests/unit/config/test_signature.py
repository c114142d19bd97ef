"""ModelSignature.validate: the one place every frontend's requests are checked."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.config.loader import parse_config_text
from kiln.config.signature import ModelSignature
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferInput, RequestedOutput

BATCHING = ModelSignature(
    parse_config_text("""
name: "m"
max_batch_size: 4
input [
  { name: "A" data_type: TYPE_FP32 dims: [ 2, -1 ] },
  { name: "B" data_type: TYPE_INT32 dims: [ 3 ] },
  { name: "OPT" data_type: TYPE_STRING dims: [ 1 ] optional: true }
]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]
""")
)
FIXED = ModelSignature(
    parse_config_text("""
name: "f"
input [ { name: "X" data_type: TYPE_BOOL dims: [ 2, 2 ] } ]
output [ { name: "Y" data_type: TYPE_BOOL dims: [ 2, 2 ] } ]
""")
)


def _tensor(name: str, datatype: DataType, shape: tuple[int, ...]) -> InferInput:
    return InferInput(name, datatype, shape, np.zeros(shape, dtype=datatype.numpy_dtype))


def _a(shape: tuple[int, ...] = (2, 2, 5)) -> InferInput:
    return _tensor("A", DataType.FP32, shape)


def _b(shape: tuple[int, ...] = (2, 3)) -> InferInput:
    return _tensor("B", DataType.INT32, shape)


def _request(*inputs: InferInput, outputs: tuple[str, ...] = ()) -> InferenceRequest:
    return InferenceRequest("m", inputs=list(inputs), outputs=[RequestedOutput(n) for n in outputs])


def test_valid_requests_return_the_batch_size() -> None:
    assert BATCHING.validate(_request(_a(), _b())) == 2
    assert BATCHING.validate(_request(_a((4, 2, 1)), _b((4, 3)), outputs=("Y",))) == 4
    opt = _tensor("OPT", DataType.BYTES, (1, 1))
    assert BATCHING.validate(_request(_a((1, 2, 7)), _b((1, 3)), opt)) == 1
    assert FIXED.validate(_request(_tensor("X", DataType.BOOL, (2, 2)))) == 1


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (_request(_a(), _b(), _tensor("C", DataType.FP32, (2, 1))),
         "unexpected inference input 'C' for model 'm'"),
        (_request(_a(), _a(), _b()), "input 'A' given more than once for model 'm'"),
        (_request(_a()),
         "expected 2 inputs but got 1 inputs for model 'm'. Got input(s) ['A'], but missing "
         "required input(s) ['B']"),
        (_request(_a(), _tensor("B", DataType.FP32, (2, 3))),
         "unexpected datatype TYPE_FP32 for inference input 'B', expecting TYPE_INT32 for "
         "model 'm'"),
        (_request(_a(), _b(())), "input 'B' for model 'm' has no batch dimension"),
        (_request(_a((3, 2, 5)), _b((2, 3))),
         "inputs of model 'm' disagree on the batch size: 'B' has 2, others have 3"),
        (_request(_a((2, 3, 5)), _b()),
         "unexpected shape for input 'A' for model 'm'. Expected [-1,2,-1], got [2,3,5]"),
        (_request(_a((2, 2)), _b()),
         "unexpected shape for input 'A' for model 'm'. Expected [-1,2,-1], got [2,2]"),
        (_request(_a((0, 2, 5)), _b((0, 3))), "batch-size must be >= 1 for 'm'"),
        (_request(_a((5, 2, 5)), _b((5, 3))), "batch-size must be <= 4 for 'm'"),
        (_request(_a(), _b(), outputs=("Z",)), "unexpected inference output 'Z' for model 'm'"),
    ],
)  # fmt: skip
def test_every_error(request_: InferenceRequest, words: str) -> None:
    with pytest.raises(KilnError) as info:
        BATCHING.validate(request_)
    assert info.value.status is Status.INVALID_ARG
    assert words in info.value.message


def test_non_batching_model_takes_shape_as_is() -> None:
    with pytest.raises(KilnError) as info:
        FIXED.validate(_request(_tensor("X", DataType.BOOL, (1, 2, 2))))
    assert "Expected [2,2], got [1,2,2]" in info.value.message


def test_full_shapes() -> None:
    assert BATCHING.inputs["A"].full_shape(BATCHING.max_batch_size) == [-1, 2, -1]
    assert FIXED.inputs["X"].full_shape(FIXED.max_batch_size) == [2, 2]
    assert BATCHING.required == ["A", "B"]
    assert BATCHING.output_names == ["Y"]
