"""pb_utils' public surface: what a model reaches as ``pb_utils.<name>`` stays there.

pb_utils.py re-exports what pb_tensor, pb_errors, pb_response, pb_config and pb_logger define.
``PUBLIC`` is every public name of pb_utils before that split: the names its top level
defined (classes, functions, constants) and its ``__all__``, read from
``git show main:src/kiln/backends/python/pb_utils.py`` at the split.
"""

from __future__ import annotations

import importlib
import traceback

import pytest

from kiln.backends.python import pb_utils

PUBLIC = [
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceResponseSender",
    "InferenceTrace",
    "Logger",
    "MemoryType",
    "Metric",
    "MetricFamily",
    "MetricKind",
    "ModelConfig",
    "PreferredMemory",
    "TRITONSERVER_MEMORY_CPU",
    "TRITONSERVER_MEMORY_CPU_PINNED",
    "TRITONSERVER_MEMORY_GPU",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TRITONSERVER_REQUEST_RELEASE_ALL",
    "TRITONSERVER_REQUEST_RELEASE_RESCHEDULE",
    "TRITONSERVER_RESPONSE_COMPLETE_FINAL",
    "TRITON_STRING_TO_NUMPY",
    "TYPE_BYTES",
    "Tensor",
    "TritonError",
    "TritonModelException",
    "deserialize_bytes_tensor",
    "get_input_config_by_name",
    "get_input_tensor_by_name",
    "get_output_config_by_name",
    "get_output_tensor_by_name",
    "install",
    "is_model_ready",
    "load_model",
    "numpy_to_triton_type",
    "serialize_byte_tensor",
    "triton_string_to_numpy",
    "triton_to_numpy_type",
    "unload_model",
    "using_decoupled_model_transaction_policy",
]
#: Those of ``PUBLIC`` that were not in ``__all__`` (``from pb_utils import *`` skips them).
NOT_IN_ALL = {
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_END",
    "TRITONSERVER_REQUEST_FLAG_SEQUENCE_START",
    "TYPE_BYTES",
}


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_is_still_importable_from_pb_utils(name: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from kiln.backends.python.pb_utils import {name}", namespace)
    assert namespace[name] is getattr(pb_utils, name)


def test_the_triton_module_name_reaches_all_of_them() -> None:
    pb_utils.install()
    module = importlib.import_module("triton_python_backend_utils")
    assert [name for name in PUBLIC if not hasattr(module, name)] == []


def test_all_is_unchanged() -> None:
    assert sorted(pb_utils.__all__) == sorted(set(PUBLIC) - NOT_IN_ALL)


def test_the_classes_still_name_pb_utils_as_their_module() -> None:
    classes = [
        getattr(pb_utils, name) for name in PUBLIC if isinstance(getattr(pb_utils, name), type)
    ]
    # ModelConfig has always been autocomplete's; MetricKind and MemoryType are enums.
    own = [c for c in classes if c is not pb_utils.ModelConfig]
    assert [c.__name__ for c in own if c.__module__ != pb_utils.__name__] == []


def test_a_model_s_failure_names_the_exception_as_before() -> None:
    """The last line of a model's traceback is the error message its client sees."""
    with pytest.raises(pb_utils.TritonModelException) as caught:
        pb_utils.Tensor("X", [1, 2])
    line = traceback.format_exception_only(caught.type, caught.value)[-1].strip()
    assert line == (
        "kiln.backends.python.pb_utils.TritonModelException: "
        "Tensor 'X': expected a numpy array, got list"
    )
