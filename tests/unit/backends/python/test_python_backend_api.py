"""The pb_utils shim, the shared-memory arena and auto_complete_config's ModelConfig."""

from __future__ import annotations

import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.backends.python import pb_utils
from kiln.backends.python.arena import Arena, deserialize_bytes, serialize_bytes

# ---- arena ---------------------------------------------------------------------------


@pytest.fixture
def arenas() -> Iterator[tuple[Arena, Arena]]:
    writer = Arena.create("kiln-test-", size=4096)
    reader = Arena.attach(writer.path)
    yield writer, reader
    reader.close()
    writer.close()


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([[1, -2], [3, 4]], dtype=np.int64),
        np.array([True, False, True]),
        np.arange(6, dtype=np.float16).reshape(2, 3),
        np.zeros((0, 5), dtype=np.int32),
        np.array(7, dtype=np.uint8),
        np.arange(10, dtype=np.float64)[::2],  # not contiguous
        np.arange(12, dtype=np.int64).reshape(3, 4).T,  # Fortran order: copied by numpy
        np.arange(6, dtype=">i4"),  # big-endian: its bytes as they are
        np.array(["2020-01-01"], dtype="datetime64[D]"),  # exports no buffer: numpy copies
    ],
)
def test_arena_roundtrip_numbers(arenas: tuple[Arena, Arena], array: np.ndarray) -> None:
    writer, reader = arenas
    header = writer.write("T", array)
    assert header[0] == "T" and header[2] == array.shape
    got = reader.read(header)
    assert got.dtype == array.dtype
    np.testing.assert_array_equal(got, array)


def test_arena_roundtrip_bytes(arenas: tuple[Arena, Arena]) -> None:
    writer, reader = arenas
    array = np.array([[b"a", b""], ["h\u00e9llo", b"\x00\xff"]], dtype=object)
    header = writer.write("S", array)
    assert header[1] == "BYTES"
    got = reader.read(header)
    assert got.shape == (2, 2) and got.dtype == object
    assert got.tolist() == [[b"a", b""], ["h\u00e9llo".encode(), b"\x00\xff"]]


def test_cancellation_flags_start_at_zero_over_old_data(arenas: tuple[Arena, Arena]) -> None:
    """A batch's flags land where the last batch's tensors were: they must read 0 until
    the server sets one, and the worker (the reader) sees exactly that one."""
    writer, reader = arenas
    writer.write("OLD", np.full(64, 255, np.uint8))
    writer.reset()
    offset = writer.zero_flags(3)
    assert [reader.flag(offset + i) for i in range(3)] == [False, False, False]
    writer.set_flag(offset + 1)
    assert [reader.flag(offset + i) for i in range(3)] == [False, True, False]


def test_bytes_serialization_is_length_prefixed() -> None:
    raw = serialize_bytes(np.array([b"ab", b"c"], dtype=object))
    assert raw == b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"
    assert deserialize_bytes(raw, (2,)).tolist() == [b"ab", b"c"]


def test_arena_grows_and_reader_remaps(arenas: tuple[Arena, Arena]) -> None:
    writer, reader = arenas
    small = writer.write("A", np.arange(10, dtype=np.int32))
    big_array = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    big = writer.write("B", big_array)  # far past the 4 KiB the arena started with
    assert writer.size >= big[3] + big[4] > 4096
    np.testing.assert_array_equal(reader.read(big), big_array)
    np.testing.assert_array_equal(reader.read(small), np.arange(10, dtype=np.int32))
    assert small[3] % 64 == 0 and big[3] % 64 == 0


def test_arena_reset_reuses_space_and_view_mode(arenas: tuple[Arena, Arena]) -> None:
    writer, reader = arenas
    first = writer.write("A", np.ones(4, np.float32))
    view = reader.read(first, copy=False)
    writer.reset()
    second = writer.write("A", np.full(4, 2, np.float32))
    assert second[3] == first[3]
    np.testing.assert_array_equal(view, np.full(4, 2, np.float32))  # a view sees the reuse


def test_arenas_hold_no_file_descriptors() -> None:
    """A worker has two arenas per batch its pipe holds (16 by default): an arena keeps no
    descriptor of its own; before Python 3.13 its mapping holds one (mmap's duplicate)."""
    import os

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    per_arena = 0 if sys.version_info >= (3, 13) else 1
    before = open_fds()
    pairs = [(w, Arena.attach(w.path)) for w in (Arena.create("kiln-fd-", 4096) for _ in range(16))]
    assert open_fds() == before + 32 * per_arena  # it was two per arena
    writer, reader = pairs[0]
    header = writer.write("BIG", np.arange(10_000, dtype=np.float64))  # grows the file
    assert reader.read(header).tolist() == list(range(10_000))  # the reader maps more
    assert open_fds() == before + 32 * per_arena  # the old mappings' went with them
    for w, r in pairs:
        r.close()
        w.close()
    assert open_fds() == before


def test_serve_raises_the_soft_open_files_limit_to_the_hard_one() -> None:
    import resource

    from kiln.launch import raise_fd_limit

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        old, new = raise_fd_limit()
        assert old == lowered
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == new > lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_arena_close_unlinks_the_file() -> None:
    arena = Arena.create("kiln-test-")
    path = Path(arena.path)
    assert path.exists()
    arena.close()
    assert not path.exists()


# ---- pb_utils --------------------------------------------------------------------------


def test_install_makes_the_triton_module_importable() -> None:
    pb_utils.install()
    module = importlib.import_module("triton_python_backend_utils")
    assert module is pb_utils
    assert sys.modules["triton_python_backend_utils"] is pb_utils


def test_tensor_and_lookup_by_name() -> None:
    a = pb_utils.Tensor("A", np.arange(3, dtype=np.int32))
    b = pb_utils.Tensor("B", np.zeros((2, 2), np.float32))
    request = pb_utils.InferenceRequest(
        inputs=[a, b], requested_output_names=["OUT"], request_id="r1", parameters={"k": 1}
    )
    assert pb_utils.get_input_tensor_by_name(request, "B") is b
    assert pb_utils.get_input_tensor_by_name(request, "C") is None
    assert a.name() == "A" and a.shape() == [3] and a.is_cpu()
    np.testing.assert_array_equal(a.as_numpy(), [0, 1, 2])
    assert request.request_id() == "r1"
    assert json.loads(request.parameters()) == {"k": 1}
    assert request.requested_output_names() == ["OUT"]
    response = pb_utils.InferenceResponse(output_tensors=[b])
    assert pb_utils.get_output_tensor_by_name(response, "B") is b
    assert not response.has_error() and response.error() is None


def test_tensor_refuses_non_arrays() -> None:
    with pytest.raises(pb_utils.TritonModelException, match=r"'X'.*numpy array.*list"):
        pb_utils.Tensor("X", [1, 2])  # type: ignore[arg-type]


def test_error_response() -> None:
    error = pb_utils.TritonError("bad input", pb_utils.TritonError.INVALID_ARG)
    response = pb_utils.InferenceResponse(error=error)
    assert response.has_error()
    assert response.error() is error
    assert error.message() == "bad input" and error.code() == pb_utils.TritonError.INVALID_ARG


def test_response_parameters_are_json_of_plain_values() -> None:
    given = {"count": 3, "label": "ok", "exact": True, "scale": 0.5}
    assert json.loads(pb_utils.InferenceResponse(parameters=given).parameters()) == given
    as_text = pb_utils.InferenceResponse(parameters=json.dumps(given))
    assert json.loads(as_text.parameters()) == given
    assert pb_utils.InferenceResponse().parameters() == "{}"


@pytest.mark.parametrize(
    ("parameters", "says"),
    [
        ({"shape": [1, 2]}, r"parameter 'shape' must be a bool, int, float or str, got list"),
        ({"none": None}, r"parameter 'none' .* got NoneType"),
        ({3: "x"}, r"key 3 must be a str"),
        ("{not json", r"not valid JSON"),
        ("[1, 2]", r"must be a dict, got list"),
    ],
)
def test_bad_response_parameters_are_refused_naming_the_key(parameters: Any, says: str) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=says):
        pb_utils.InferenceResponse(parameters=parameters)


def test_config_helpers() -> None:
    config = {
        "input": [{"name": "IN", "data_type": "TYPE_UINT8", "dims": [3]}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [3]}],
    }
    for form in (config, json.dumps(config)):
        out = pb_utils.get_output_config_by_name(form, "OUT")
        assert out is not None and out["data_type"] == "TYPE_FP32"
        assert pb_utils.get_input_config_by_name(form, "IN") == config["input"][0]
        assert pb_utils.get_output_config_by_name(form, "NOPE") is None
    assert pb_utils.triton_string_to_numpy("TYPE_FP32") is np.float32
    assert pb_utils.triton_string_to_numpy("TYPE_STRING") is np.object_
    with pytest.raises(pb_utils.TritonModelException, match="TYPE_NOPE"):
        pb_utils.triton_string_to_numpy("TYPE_NOPE")


def test_triton_data_type_numbers_both_ways() -> None:
    """TRITONSERVER_DataType's numbers, as Triton's helpers and Tensor.triton_dtype() use
    them: BOOL 1 ... FP32 11, FP64 12, BYTES 13; none for a type without a number."""
    numbered = {1: np.bool_, 2: np.uint8, 8: np.int32, 9: np.int64, 10: np.float16,
                11: np.float32, 12: np.float64, 13: np.object_}  # fmt: skip
    for number, numpy_type in numbered.items():
        assert pb_utils.triton_to_numpy_type(number) is numpy_type
        assert pb_utils.numpy_to_triton_type(numpy_type) == number
        assert pb_utils.numpy_to_triton_type(np.dtype(numpy_type)) == number
    assert pb_utils.numpy_to_triton_type(np.bytes_) == 13
    assert pb_utils.triton_to_numpy_type(14) is None  # BF16: NumPy has none
    assert pb_utils.numpy_to_triton_type(np.complex64) is None
    assert pb_utils.Tensor("X", np.zeros(2, np.float32)).triton_dtype() == 11
    assert pb_utils.Tensor("S", np.array([b"a"], dtype=object)).triton_dtype() == 13
    assert pb_utils.TRITON_STRING_TO_NUMPY["TYPE_INT16"] is np.int16


def test_decoupled_policy_from_the_config_dict_or_its_json() -> None:
    decoupled = {"name": "m", "model_transaction_policy": {"decoupled": True}}
    for form in (decoupled, json.dumps(decoupled)):
        assert pb_utils.using_decoupled_model_transaction_policy(form) is True
    plain = {"name": "m", "model_transaction_policy": {"decoupled": False}}
    assert pb_utils.using_decoupled_model_transaction_policy(plain) is False
    assert pb_utils.using_decoupled_model_transaction_policy({"name": "m"}) is False


def test_logger_takes_triton_s_levels(capsys: pytest.CaptureFixture[str]) -> None:
    logger = pb_utils.Logger
    logger.log("plain")  # INFO unless told
    logger.log("careful", logger.WARNING)
    logger.log("broke", pb_utils.Logger.LogLevel.ERROR)
    logger.log_verbose("detail")
    logger.log_warn("again")
    assert capsys.readouterr().err.splitlines() == [
        "INFO: plain", "WARNING: careful", "ERROR: broke", "VERBOSE: detail", "WARNING: again",
    ]  # fmt: skip
    with pytest.raises(pb_utils.TritonModelException, match="unknown level 9"):
        logger.log("x", 9)


def test_triton_s_request_flags_trace_and_enum_names() -> None:
    request = pb_utils.InferenceRequest(model_name="seq", inputs=[])
    request.set_flags(pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START)
    assert request.flags() == pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START
    trace = request.trace()
    assert isinstance(trace, pb_utils.InferenceTrace) and trace.get_context() is None
    # what a BLS call written for Triton passes along
    call = pb_utils.InferenceRequest(model_name="m", inputs=[], requested_output_names=[],
                                     trace=trace, preferred_memory=pb_utils.PreferredMemory(
                                         pb_utils.MemoryType.TRITONSERVER_MEMORY_CPU))  # fmt: skip
    assert call.model_name() == "m"
    kinds = (pb_utils.COUNTER, pb_utils.GAUGE, pb_utils.HISTOGRAM)
    assert kinds == (pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE,
                     pb_utils.MetricFamily.HISTOGRAM)  # fmt: skip
    assert pb_utils.MetricKind.GAUGE is pb_utils.GAUGE


def test_byte_tensor_helpers() -> None:
    encoded = pb_utils.serialize_byte_tensor(np.array([b"x", b"yz"], dtype=object))
    assert encoded.dtype == np.uint8
    assert pb_utils.deserialize_bytes_tensor(encoded).tolist() == [b"x", b"yz"]


def test_response_sender_only_for_decoupled_models() -> None:
    request = pb_utils.InferenceRequest(inputs=[])
    with pytest.raises(pb_utils.TritonModelException, match="decoupled"):
        request.get_response_sender()


def test_release_flags_default_to_all_and_take_reschedule() -> None:
    request = pb_utils.InferenceRequest(inputs=[])
    assert request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_ALL
    request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
    assert request._release_flags == pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE
    with pytest.raises(pb_utils.TritonModelException, match="unknown flags 4"):
        request.set_release_flags(4)


def test_a_bls_request_accepts_triton_s_preferred_memory() -> None:
    # Written for a GPU Triton; kiln answers in host memory but must load the model.
    memory = pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, 0)
    assert (memory.preferred_memory_type, memory.preferred_device_id) == (2, 0)
    request = pb_utils.InferenceRequest(
        model_name="mlp", inputs=[], requested_output_names=["y"], preferred_memory=memory
    )
    assert request.model_name() == "mlp"


def test_exec_outside_a_worker_says_why() -> None:
    request = pb_utils.InferenceRequest(model_name="mlp", inputs=[])
    with pytest.raises(pb_utils.TritonModelException, match="not running in kiln"):
        request.exec()


def test_model_control_outside_a_worker_says_why() -> None:
    for call in (lambda: pb_utils.load_model("mlp"), lambda: pb_utils.unload_model("mlp"),
                 lambda: pb_utils.is_model_ready("mlp")):  # fmt: skip
        with pytest.raises(pb_utils.TritonModelException, match="not running in kiln"):
            call()


@pytest.mark.parametrize(
    "files",
    [{"1/model.py": b"x"}, {"file:1/model.py": "text, not bytes"}],
    ids=["no file: prefix", "not bytes"],
)
def test_load_model_files_must_map_file_paths_to_bytes(files: Any) -> None:
    with pytest.raises(pb_utils.TritonModelException, match=r"load_model\('m'\): files maps"):
        pb_utils.load_model("m", files=files)


def test_unload_dependents_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    class Channel:
        def control(self, call: dict[str, Any]) -> None:
            calls.append(call)

    monkeypatch.setattr(pb_utils, "_channel", Channel())
    pb_utils.unload_model("ensemble", unload_dependents=True)
    pb_utils.unload_model("mlp")
    assert calls == [
        {"action": "unload", "name": "ensemble", "unload_dependents": True},
        {"action": "unload", "name": "mlp", "unload_dependents": False},
    ]


def test_model_control_without_a_server_names_the_model() -> None:
    from kiln.backends.python import bls
    from kiln.core.errors import KilnError

    with pytest.raises(KilnError, match=r"model control of 'mlp'.*no server is running"):
        bls.control({"action": "ready", "name": "mlp"})


# ---- auto_complete_config's ModelConfig ---------------------------------------------------


def test_auto_complete_fills_an_empty_config() -> None:
    config = pb_utils.ModelConfig({"name": "m", "max_batch_size": 0, "input": [], "output": []})
    config.set_max_batch_size(8)
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_output({"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]})
    config.set_dynamic_batching()
    config.set_model_transaction_policy({"decoupled": True})
    d = config.as_dict()
    assert d["max_batch_size"] == 8
    assert [i["name"] for i in d["input"]] == ["IN"]
    assert d["dynamic_batching"] == {}
    assert d["model_transaction_policy"] == {"decoupled": True}


def test_auto_complete_keeps_what_the_user_wrote() -> None:
    config = pb_utils.ModelConfig(
        json.dumps(
            {
                "max_batch_size": 2,
                "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": ["4"]}],
            }
        )
    )
    config.set_max_batch_size(8)  # a smaller configured value is allowed and kept
    config.add_input({"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "optional": True})
    d = config.as_dict()
    assert d["max_batch_size"] == 2
    assert d["input"] == [{"name": "IN", "data_type": "TYPE_FP32", "dims": ["4"], "optional": True}]


def test_auto_complete_conflicts_name_both_values() -> None:
    config = pb_utils.ModelConfig(
        {"max_batch_size": 16, "input": [{"name": "IN", "data_type": "TYPE_INT32", "dims": [4]}]}
    )
    with pytest.raises(ValueError, match=r"max_batch_size 16.*at most 8"):
        config.set_max_batch_size(8)
    with pytest.raises(ValueError, match=r"'IN'.*TYPE_INT32.*TYPE_FP32"):
        config.add_input({"name": "IN", "data_type": "TYPE_FP32"})
    with pytest.raises(ValueError, match=r"'IN'.*dims"):
        config.add_input({"name": "IN", "dims": [5]})
    with pytest.raises(ValueError, match="name"):
        config.add_output({"data_type": "TYPE_FP32"})
