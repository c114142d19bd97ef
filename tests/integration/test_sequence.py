"""Sequence batching end to end: tritonclient (HTTP, gRPC, gRPC streaming) against kiln serve.

The example repository's accumulators answer each request with the running sum of its
sequence; several sequences (uint64 and string ids) are interleaved so that the batcher
must keep their states apart. Expected sums come from the NumPy reference.
"""

from __future__ import annotations

import queue
import time
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository, reference_sequence
from tests.conftest import KilnProcess

MODELS = ["simple_sequence", "simple_sequence_oldest", "simple_sequence_state"]

# id -> values it sends; uint64 and string ids side by side (1 and "1" are different).
SEQUENCES: dict[Any, list[int]] = {
    1: [3, 4, -2, 10],
    "1": [100, 1],
    2**62 + 5: [7, 7, 7],  # tritonclient.grpc sends ids as int64: keep below 2**63
    "user-abc": [-5, 20, 1, 1, 2],
}


def interleaved(sequences: dict[Any, list[int]]) -> list[tuple[Any, int, int, bool, bool]]:
    """Round-robin over the sequences: (id, step, value, start, end)."""
    steps: list[tuple[Any, int, int, bool, bool]] = []
    for step in range(max(len(v) for v in sequences.values())):
        for sid, values in sequences.items():
            if step < len(values):
                steps.append((sid, step, values[step], step == 0, step == len(values) - 1))
    return steps


def expected(model: str, sequences: dict[Any, list[int]]) -> dict[Any, list[int]]:
    return {sid: reference_sequence(model, values) for sid, values in sequences.items()}


def http_input(value: int) -> httpclient.InferInput:
    tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return tensor


def grpc_input(value: int) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return tensor


def with_offset(sequences: dict[Any, list[int]], offset: int) -> dict[Any, list[int]]:
    """The same sequences under ids no other test uses (the server is shared)."""
    return {
        (sid + offset if isinstance(sid, int) else f"{sid}-{offset}"): values
        for sid, values in sequences.items()
    }


@pytest.mark.parametrize("model", MODELS)
def test_http_interleaved_sequences(kiln_server: KilnProcess, model: str) -> None:
    sequences = with_offset(SEQUENCES, 1000 + MODELS.index(model))
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    got: dict[Any, list[int]] = {sid: [] for sid in sequences}
    for sid, _, value, start, end in interleaved(sequences):
        result = client.infer(
            model, [http_input(value)], sequence_id=sid, sequence_start=start, sequence_end=end
        )
        got[sid].append(int(result.as_numpy("OUTPUT")[0, 0]))
    assert got == expected(model, sequences)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_interleaved_sequences(kiln_server: KilnProcess, model: str) -> None:
    sequences = with_offset(SEQUENCES, 2000 + MODELS.index(model))
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    got: dict[Any, list[int]] = {sid: [] for sid in sequences}
    for sid, _, value, start, end in interleaved(sequences):
        result = client.infer(
            model, [grpc_input(value)], sequence_id=sid, sequence_start=start, sequence_end=end
        )
        got[sid].append(int(result.as_numpy("OUTPUT")[0, 0]))
    assert got == expected(model, sequences)


@pytest.mark.parametrize("model", MODELS)
def test_grpc_stream_interleaved_sequences(kiln_server: KilnProcess, model: str) -> None:
    # Everything is sent before any answer is read, so requests queue up and batch.
    sequences = with_offset(SEQUENCES, 3000 + MODELS.index(model))
    ids = {f"s{i}": sid for i, sid in enumerate(sequences)}
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        plan = interleaved(sequences)
        for sid, step, value, start, end in plan:
            key = next(k for k, v in ids.items() if v == sid)
            client.async_stream_infer(
                model,
                [grpc_input(value)],
                request_id=f"{key}:{step}",
                sequence_id=sid,
                sequence_start=start,
                sequence_end=end,
            )
        got: dict[Any, dict[int, int]] = {sid: {} for sid in sequences}
        for _ in plan:
            result, error = answers.get(timeout=30)
            assert error is None, error
            key, step = result.get_response().id.split(":")
            got[ids[key]][int(step)] = int(result.as_numpy("OUTPUT")[0, 0])
    finally:
        client.stop_stream()
    ordered = {sid: [steps[i] for i in sorted(steps)] for sid, steps in got.items()}
    assert ordered == expected(model, sequences)


def test_statistics_count_sequence_requests(kiln_server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(kiln_server.http_url)
    before = client.get_inference_statistics("simple_sequence")["model_stats"][0]
    for step, value in enumerate([1, 2, 3]):
        client.infer(
            "simple_sequence",
            [http_input(value)],
            sequence_id=4242,
            sequence_start=step == 0,
            sequence_end=step == 2,
        )
    after = client.get_inference_statistics("simple_sequence")["model_stats"][0]
    success = after["inference_stats"]["success"]["count"]
    assert success - before["inference_stats"]["success"]["count"] == 3
    assert after["inference_count"] - before["inference_count"] == 3
    assert after["execution_count"] - before["execution_count"] >= 1


# ---- errors ----------------------------------------------------------------------------
def http_error(client: httpclient.InferenceServerClient, model: str, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [http_input(1)], **kwargs)
    assert info.value.status() == "400"
    return str(info.value.message())


def grpc_error(client: grpcclient.InferenceServerClient, model: str, **kwargs: Any) -> str:
    with pytest.raises(InferenceServerException) as info:
        client.infer(model, [grpc_input(1)], **kwargs)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    return str(info.value.message())


@pytest.mark.parametrize("model", ["simple_sequence", "simple_sequence_oldest"])
def test_errors_over_http_and_grpc(kiln_server: KilnProcess, model: str) -> None:
    http = httpclient.InferenceServerClient(kiln_server.http_url)
    grpc = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    base = 5000 + MODELS.index(model) * 10
    for error in (partial(http_error, http), partial(grpc_error, grpc)):
        base += 1
        # no sequence id at all
        message = error(model)
        assert f"model '{model}'" in message and "correlation ID" in message
        # unknown sequence without START
        message = error(model, sequence_id=base)
        assert f"sequence {base} to model '{model}' must specify the START flag" in message
        # after the sequence's END
        http.infer(model, [http_input(1)], sequence_id=f"e{base}", sequence_start=True)
        http.infer(model, [http_input(1)], sequence_id=f"e{base}", sequence_end=True)
        message = error(model, sequence_id=f"e{base}")
        assert f"sequence 'e{base}' to model '{model}'" in message
        assert "already ended" in message
    # the model keeps serving
    result = http.infer(
        model, [http_input(9)], sequence_id=base + 100, sequence_start=True, sequence_end=True
    )
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 9


def test_stream_reports_a_bad_request_and_stays_open(kiln_server: KilnProcess) -> None:
    answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        client.async_stream_infer("simple_sequence", [grpc_input(1)], sequence_id=6001)
        _, error = answers.get(timeout=30)
        assert error is not None and "must specify the START flag" in error.message()
        client.async_stream_infer(
            "simple_sequence", [grpc_input(4)], sequence_id=6001, sequence_start=True
        )
        result, error = answers.get(timeout=30)
        assert error is None and int(result.as_numpy("OUTPUT")[0, 0]) == 4
    finally:
        client.stop_stream()


def test_idle_sequence_is_released(tmp_path: Path, make_server: type[KilnProcess]) -> None:
    repo = tmp_path / "repo"
    build_example_repository(repo, ["simple_sequence"])
    config = repo / "simple_sequence" / "config.pbtxt"
    text = config.read_text()
    config.write_text(
        text.replace(
            "max_sequence_idle_microseconds: 5000000", "max_sequence_idle_microseconds: 100000"
        )
    )
    server = make_server(repo).start()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.infer("simple_sequence", [grpc_input(2)], sequence_id=77, sequence_start=True)
    time.sleep(0.5)  # past the 0.1 s idle limit: the server releases the sequence
    message = grpc_error(client, "simple_sequence", sequence_id=77)
    assert "sequence 77 to model 'simple_sequence'" in message and "idle" in message
    result = client.infer("simple_sequence", [grpc_input(3)], sequence_id=77, sequence_start=True)
    assert int(result.as_numpy("OUTPUT")[0, 0]) == 3
