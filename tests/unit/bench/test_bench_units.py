"""``kiln bench`` pieces that need no server: ranges, inputs, percentiles, stability, reports."""

from __future__ import annotations

import csv
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from kiln.bench.bodies import json_data, raw_bytes
from kiln.bench.control import StatsSnapshot
from kiln.bench.inputs import (
    DTYPES,
    ModelSpec,
    TensorSpec,
    generate,
    load_file,
    random_tensor,
    request_shapes,
    zero_tensor,
)
from kiln.bench.options import BenchError, BenchOptions, parse_range, parse_shape
from kiln.bench.report import CSV_COLUMNS, csv_rows, write_csv, write_json
from kiln.bench.runner import BenchResult
from kiln.bench.stats import Window, is_stable, percentile, summarize, within


@pytest.mark.parametrize(
    ("text", "levels"),
    [("8", [8]), ("1:4", [1, 2, 3, 4]), ("1:64:16", [1, 17, 33, 49]), ("2:6:2", [2, 4, 6])],
)
def test_parse_range(text: str, levels: list[int]) -> None:
    assert parse_range(text, "--concurrency") == levels


def test_parse_float_range_includes_end() -> None:
    assert parse_range("0.5:1.5:0.5", "--request-rate", integer=False) == [0.5, 1.0, 1.5]


@pytest.mark.parametrize(
    ("text", "message"),
    [("", "start"), ("a:4", "integers"), ("4:1", "below start"), ("0:4", "> 0"),
     ("1:4:0", "step"), ("1:2:3:4", "start")],
)  # fmt: skip
def test_parse_range_rejects(text: str, message: str) -> None:
    with pytest.raises(BenchError, match=message):
        parse_range(text, "--concurrency")


def test_parse_shape() -> None:
    assert parse_shape("INPUT:3,224,224") == ("INPUT", [3, 224, 224])
    assert parse_shape("ns:x:4") == ("ns:x", [4])
    with pytest.raises(BenchError, match="NAME:d1"):
        parse_shape("INPUT")
    with pytest.raises(BenchError, match="integers"):
        parse_shape("INPUT:a,b")


@pytest.mark.parametrize("datatype", sorted(DTYPES))
def test_random_and_zero_per_datatype(datatype: str) -> None:
    rng = np.random.default_rng(1)
    arr = random_tensor(datatype, [2, 3], rng)
    assert arr.shape == (2, 3)
    assert arr.dtype == np.dtype(DTYPES[datatype])
    blob = raw_bytes(datatype, arr)
    values = json_data(datatype, arr)
    assert len(values) == 6
    if datatype == "BYTES":
        assert all(isinstance(v, bytes) and 1 <= len(v) <= 16 for v in arr.ravel())
        # 4-byte little-endian length before each element
        first = struct.unpack("<I", blob[:4])[0]
        assert blob[4 : 4 + first] == arr.ravel()[0]
    elif datatype == "BOOL":
        assert set(np.unique(arr)) <= {False, True}
        assert all(isinstance(v, bool) for v in values)
    else:
        assert len(blob) == arr.nbytes
    zero = zero_tensor(datatype, [4])
    assert zero.shape == (4,)
    if datatype == "BYTES":
        assert list(zero) == [b"0"] * 4
    else:
        assert not zero.any()


def test_bf16_json_is_the_float_it_encodes() -> None:
    bits = (np.array([1.5, -2.0], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    assert json_data("BF16", bits) == [1.5, -2.0]


def _spec(max_batch: int = 8) -> ModelSpec:
    dims = [-1, 16] if max_batch else [16]
    return ModelSpec(
        "m", "", [TensorSpec("A", "INT32", dims), TensorSpec("B", "FP32", [-1, -1][: len(dims)])],
        [TensorSpec("OUT", "FP32", dims)], max_batch,
    )  # fmt: skip


def test_request_shapes_batch_and_override() -> None:
    spec = _spec()
    assert request_shapes(spec, 4, {"B": [5]}) == {"A": [4, 16], "B": [4, 5]}


@pytest.mark.parametrize(
    ("batch", "shapes", "message"),
    [(1, {}, "variable dims .* --shape B:N"), (9, {"B": [2]}, "exceeds .* max_batch_size 8"),
     (1, {"C": [1]}, "not an input"), (1, {"A": [8], "B": [1]}, "does not fit")],
)  # fmt: skip
def test_request_shapes_errors(batch: int, shapes: dict[str, list[int]], message: str) -> None:
    with pytest.raises(BenchError, match=message):
        request_shapes(_spec(), batch, shapes)


def test_request_shapes_no_batching() -> None:
    with pytest.raises(BenchError, match="does not support batching"):
        request_shapes(_spec(0), 2, {"B": [3]})
    assert request_shapes(_spec(0), 1, {"B": [3]}) == {"A": [16], "B": [3]}


def test_generate_is_seeded() -> None:
    shapes = {"A": [2, 16], "B": [2, 3]}
    a, b = generate(_spec(), shapes, "random", 7), generate(_spec(), shapes, "random", 7)
    assert np.array_equal(a[0]["A"], b[0]["A"])
    assert not generate(_spec(), shapes, "zero")[0]["B"].any()


def test_load_json_file(tmp_path: Path) -> None:
    shapes = {"A": [2, 16], "B": [2, 3]}
    path = tmp_path / "data.json"
    path.write_text(json.dumps({"data": [
        {"A": list(range(16)), "B": {"content": [1, 2, 3], "shape": [3]}},
        {"A": list(range(32)), "B": [0] * 6},
    ]}))  # fmt: skip
    entries = load_file(path, _spec(), shapes)
    assert len(entries) == 2
    assert entries[0]["A"].shape == (2, 16)  # one sample repeated over the batch
    assert np.array_equal(entries[0]["A"][1], np.arange(16))
    assert entries[1]["A"][1, 0] == 16
    assert entries[0]["B"].dtype == np.float32


def test_load_file_errors(tmp_path: Path) -> None:
    shapes = {"A": [1, 16], "B": [1, 3]}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"data": [{"A": [1, 2]}]}))
    with pytest.raises(BenchError, match="input 'A' has 2 values"):
        load_file(bad, _spec(), shapes)
    bad.write_text(json.dumps({"data": [{"A": list(range(16))}]}))
    with pytest.raises(BenchError, match="input 'B' is missing"):
        load_file(bad, _spec(), shapes)
    with pytest.raises(BenchError, match="not a file"):
        load_file(tmp_path / "missing.json", _spec(), shapes)


def test_load_npz_keeps_shape(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, A=np.ones((3, 16), np.int64), B=np.zeros((3, 2), np.float64))
    entry = load_file(path, _spec(), {"A": [1, 16], "B": [1, 2]})[0]
    assert entry["A"].shape == (3, 16) and entry["A"].dtype == np.int32


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 90) == 3.0
    assert percentile([], 50) == 0.0


def test_sequence_requests_mark_start_and_end_and_cycle_the_data() -> None:
    """perf_analyzer's sequences: one id per client, START on the first request and END
    on the last (both on a sequence of one), the data entries in turn; identical requests
    are encoded once."""
    from kiln.bench.bodies import Placement, grpc_request, http_body
    from kiln.bench.runner import sequence_requests
    from kiln.frontends.grpc import grpc_service_pb2 as pb

    calls: list[tuple[object, object]] = []  # (entry's x, parameters) per encoding

    def encode(entry: dict[str, object], placement: Placement, params: object) -> bytes:
        calls.append((entry["x"], params))
        return str(len(calls) - 1).encode()  # the request names its encoding

    entries: list[dict[str, object]] = [{"x": 0}, {"x": 1}]
    placements = [Placement(), Placement()]
    out = [calls[int(o)] for o in sequence_requests(encode, entries, placements, 5, 42)]
    assert [x for x, _ in out] == [0, 1, 0, 1, 0]
    assert [params for _, params in out] == [
        {"sequence_id": 42, "sequence_start": True},
        {"sequence_id": 42}, {"sequence_id": 42}, {"sequence_id": 42},
        {"sequence_id": 42, "sequence_end": True},
    ]  # fmt: skip
    assert len(calls) == 4  # the middle requests of entry 0 are encoded once
    (one,) = sequence_requests(encode, entries, placements, 1, 7)
    assert calls[int(one)][1] == {"sequence_id": 7, "sequence_start": True, "sequence_end": True}

    # the parameters reach both wire formats
    spec = ModelSpec("m", "", [TensorSpec("IN", "INT32", [1])])
    feed = {"IN": np.array([3], np.int32)}
    params = {"sequence_id": 9, "sequence_start": True}
    body = http_body(spec, feed, False, Placement(), params)
    assert json.loads(body.body)["parameters"] == params
    request = pb.ModelInferRequest.FromString(grpc_request(spec, feed, Placement(), params))
    assert request.parameters["sequence_id"].int64_param == 9
    assert request.parameters["sequence_start"].bool_param is True


def _window(n: int, latency: float) -> Window:
    return Window(1.0, [latency] * n)


def test_stability() -> None:
    assert within([100, 105, 95], 10)
    assert not within([100, 130, 95], 10)
    assert not within([0, 0, 0], 10)
    steady = [_window(100, 0.01), _window(104, 0.0102), _window(97, 0.0099)]
    assert is_stable(steady, 10)
    assert not is_stable(steady[:2], 10)  # three windows are needed
    assert not is_stable([*steady[:2], _window(150, 0.01)], 10)  # throughput moved
    assert not is_stable([*steady[:2], _window(100, 0.02)], 10)  # latency moved
    assert is_stable([_window(1, 0.5), *steady], 10)  # only the last three count


def test_summarize_uses_last_three_windows_and_server_delta() -> None:
    windows = [_window(10, 1.0)] + [
        Window(0.5, [0.001, 0.002], 1, 0.001, StatsSnapshot(success_count=2, queue_ns=4000))
        for _ in range(3)
    ]
    level = summarize(windows, True, batch_size=4, concurrency=2)
    assert level.requests == 6 and level.errors == 3 and level.windows == 4
    assert level.seconds == pytest.approx(1.5)
    assert level.throughput == pytest.approx(6 / 1.5 * 4)
    assert level.server_requests == 6
    assert level.server_us["queue"] == pytest.approx(2.0)
    assert level.latency_us["p50"] == pytest.approx(1000.0)
    assert level.latency_us["p99"] == pytest.approx(2000.0)
    assert level.client_cpu_us_per_request == pytest.approx(0.003 / 9 * 1e6)


def test_csv_and_json_shape(tmp_path: Path) -> None:
    spec = _spec()
    windows = [Window(1.0, [0.001] * 5, 0, 0.0, StatsSnapshot(success_count=5))] * 3
    result = BenchResult(BenchOptions(model="m"), spec, total_requests=15)
    result.levels = [summarize(windows, True, 1, concurrency=c) for c in (1, 2)]
    write_csv(result, tmp_path / "r.csv")
    rows = list(csv.reader((tmp_path / "r.csv").open()))
    assert rows[0] == CSV_COLUMNS and len(rows) == 3
    assert [r[0] for r in rows[1:]] == ["1", "2"]
    assert rows[1][CSV_COLUMNS.index("Inferences/Second")] == "5.00"
    assert csv_rows(result) == rows
    write_json(result, tmp_path / "r.json")
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["mode"] == "concurrency" and doc["encoding"] == "http-binary"
    assert doc["total"] == {"requests": 15, "errors": 0, "dropped": 0, "first_error": None}
    level = doc["levels"][1]
    assert level["concurrency"] == 2 and level["requests"] == 15
    assert set(level["latency_us"]) == {"avg", "p50", "p90", "p95", "p99"}
    assert set(level["server_us"]) == {"queue", "compute_input", "compute_infer", "compute_output"}


def test_options_defaults_and_errors() -> None:
    assert BenchOptions(model="m").url == "localhost:8000"
    from kiln.bench.options import Protocol

    assert BenchOptions(model="m", protocol=Protocol.GRPC).url == "localhost:8001"
    with pytest.raises(BenchError, match="shared-memory"):
        BenchOptions(model="m", shared_memory="cuda")
    with pytest.raises(BenchError, match="batch-size"):
        BenchOptions(model="m", batch_size=0)
