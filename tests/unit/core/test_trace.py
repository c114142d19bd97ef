"""The tracer: sampling (rate, count), trace files (log_frequency), settings changes, and
the ``--trace-config`` parser, without a server."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from kiln.core.errors import KilnError, Status
from kiln.core.settings import TraceSettings, parse_trace_config
from kiln.core.trace import CURRENT, FRONTEND, MAX_TENSOR_VALUES, FrontendSlot, Tracer
from kiln.core.trace_otel import OtelOptions


def _tracer(path: Path, **settings: str | list[str]) -> Tracer:
    values = {k: v if isinstance(v, list) else [v] for k, v in settings.items()}
    values.setdefault("trace_file", [str(path)])
    values.setdefault("trace_level", ["TIMESTAMPS"])
    trace_settings = TraceSettings()
    trace_settings.update("", values)
    return Tracer(trace_settings)


def _run(tracer: Tracer, model: str = "m", n: int = 1) -> list[int]:
    """``n`` requests reaching ``model``: the ids of those traced (each ended)."""
    ids = []
    for _ in range(n):
        trace = tracer.begin(model, "1", "", 100)
        if trace is not None:
            trace.stamp("REQUEST_END", 200)
            trace.end()
            ids.append(trace.id)
    return ids


def _read(path: Path) -> list[dict[str, object]]:
    entries = json.loads(path.read_text())
    assert isinstance(entries, list)
    return entries


def test_every_rate_th_request_is_traced_until_the_count_is_spent(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    tracer = _tracer(out, trace_rate="3", trace_count="2")
    assert tracer.enabled
    traced = _run(tracer, n=12)
    assert len(traced) == 2  # the 3rd and 6th; the count is spent after them
    assert tracer.get()["trace_count"] == ["0"]
    assert not out.exists()  # log_frequency 0: written when the setting ends
    tracer.close()
    entries = _read(out)
    heads = [e for e in entries if "model_name" in e]
    assert [h["id"] for h in heads] == traced
    assert heads[0] == {"id": traced[0], "model_name": "m", "model_version": 1}
    stamps = [
        e["timestamps"][0]["name"]
        for e in entries
        if e.get("id") == traced[0] and "timestamps" in e
    ]  # type: ignore[index]
    assert stamps == ["REQUEST_START", "REQUEST_END"]


def test_log_frequency_writes_numbered_files_and_the_rest_at_the_end(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out, trace_rate="1", log_frequency="2")
    _run(tracer, n=5)
    tracer.sync()  # the numbered files are written on the writer thread
    first, second = _read(tmp_path / "t.json.0"), _read(tmp_path / "t.json.1")
    assert len([e for e in first if "model_name" in e]) == 2
    assert len([e for e in second if "model_name" in e]) == 2
    assert not (tmp_path / "t.json.2").exists()
    tracer.close()  # the fifth goes to the next index, not to t.json
    assert len([e for e in _read(tmp_path / "t.json.2") if "model_name" in e]) == 1
    assert not out.exists()


def test_trace_files_are_written_off_the_calling_thread_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request ends on the event loop: the N-th one hands the file to the writer thread
    rather than serialising and writing it there."""
    import kiln.core.trace as trace_module

    writes: list[tuple[str, str]] = []
    dump = trace_module._dump

    def recorded(target: str, entries: list[dict[str, object]], append: bool) -> None:
        writes.append((threading.current_thread().name, Path(target).name))
        dump(target, entries, append)

    monkeypatch.setattr(trace_module, "_dump", recorded)
    tracer = _tracer(tmp_path / "t.json", trace_rate="1", log_frequency="1")
    ids = _run(tracer, n=6)
    tracer.close()
    assert [name for _, name in writes] == [f"t.json.{i}" for i in range(6)]
    assert all(thread.startswith("kiln-trace-writer") for thread, _ in writes), writes
    for i, trace_id in enumerate(ids):
        assert {e["id"] for e in _read(tmp_path / f"t.json.{i}")} == {trace_id}


def test_tensors_level_records_inputs_and_outputs_without_timestamps(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out, trace_rate="1", trace_level="TENSORS")
    trace = tracer.begin("m", "2", "req-7", 1)
    assert trace is not None
    trace.tensor("TENSOR_QUEUE_INPUT", "IN", "FP32", np.array([[0.5, 1.0]], np.float32))
    big = np.arange(MAX_TENSOR_VALUES + 5, dtype=np.int64)
    trace.tensor("TENSOR_BACKEND_OUTPUT", "OUT", "INT64", big)
    trace.tensor("TENSOR_BACKEND_OUTPUT", "TEXT", "BYTES", np.array([b"hi", "there"], object))
    trace.end()
    tracer.close()
    entries = _read(out)
    assert entries[0] == {
        "id": trace.id,
        "model_name": "m",
        "model_version": 2,
        "request_id": "req-7",
    }
    assert not any("timestamps" in e for e in entries)
    tensors = {e["tensor"]["name"]: e for e in entries if "tensor" in e}  # type: ignore[index]
    assert tensors["IN"]["activity"] == "TENSOR_QUEUE_INPUT"
    assert tensors["IN"]["tensor"] == {
        "name": "IN",
        "data": "0.5,1.0",
        "shape": "1,2",
        "dtype": "FP32",
    }  # type: ignore[index]
    data = tensors["OUT"]["tensor"]["data"].split(",")  # type: ignore[index]
    assert len(data) == MAX_TENSOR_VALUES + 1 and data[-1] == "..." and data[:3] == ["0", "1", "2"]
    assert tensors["TEXT"]["tensor"]["data"] == "hi,there"  # type: ignore[index]


def test_a_model_override_samples_on_its_own(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out, trace_rate="1")
    tracer.update("quiet", {"trace_level": ["OFF"]})
    assert _run(tracer, "quiet", 3) == []
    assert len(_run(tracer, "loud", 3)) == 3
    tracer.update("quiet", {"trace_level": []})  # cleared: back to the global setting
    assert len(_run(tracer, "quiet", 2)) == 2


def test_changing_a_setting_writes_the_traces_of_the_setting_it_replaces(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out, trace_rate="1", trace_count="5")
    first = _run(tracer, n=2)
    tracer.update("", {"trace_rate": ["2"]})
    assert {e["id"] for e in _read(out)} == set(first)  # written by the change
    assert tracer.get()["trace_count"] == ["3"]  # the count left carries over
    later = _run(tracer, n=4)
    assert len(later) == 2
    tracer.close()
    assert {e["id"] for e in _read(out)} == set(first + later)  # earlier entries kept


def test_level_off_or_no_file_traces_nothing(tmp_path: Path) -> None:
    assert not Tracer().enabled  # the defaults: level OFF
    settings = TraceSettings()
    settings.update("", {"trace_level": ["TIMESTAMPS"], "trace_rate": ["1"]})
    tracer = Tracer(settings)  # no file: nowhere to write, so nothing is sampled
    assert not tracer.enabled
    assert _run(tracer, n=3) == []


def test_a_traced_parent_makes_its_children_traced_under_its_id(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out, trace_rate="2")
    assert tracer.begin("ensemble", "1", "", 1) is None  # the 1st of every 2 is not traced
    parent = tracer.begin("ensemble", "1", "", 1)
    assert parent is not None
    token = CURRENT.set(parent)
    try:
        child = tracer.begin("step", "1", "", 2)  # sampled or not, a child is traced
    finally:
        CURRENT.reset(token)
    assert child is not None and child.parent_id == parent.id
    by_id = tracer.begin("callee", "1", "", 3, parent_id=parent.id)  # a BLS call's way
    assert by_id is not None and by_id.parent_id == parent.id
    for t in (child, by_id, parent):
        t.end()
    assert tracer.begin("callee", "1", "", 4, parent_id=parent.id) is None  # parent over
    tracer.close()
    heads = {e["model_name"]: e for e in _read(out) if "model_name" in e}
    assert heads["step"]["parent_id"] == heads["callee"]["parent_id"] == parent.id
    assert "parent_id" not in heads["ensemble"]


def test_a_frontend_slot_takes_the_trace_and_its_receive_stamps(tmp_path: Path) -> None:
    tracer = _tracer(tmp_path / "t.json", trace_rate="1")
    slot = FrontendSlot("HTTP", recv_start=10, recv_end=20)
    token = FRONTEND.set(slot)
    try:
        trace = tracer.begin("m", "1", "", 30)
        child = None
        if trace is not None:
            inner = CURRENT.set(trace)
            child = tracer.begin("step", "1", "", 40)
            CURRENT.reset(inner)
    finally:
        FRONTEND.reset(token)
    assert trace is not None and slot.trace is trace
    assert child is not None and slot.trace is not child  # a child never takes the slot
    assert [s[0] for s in trace.stamps] == ["REQUEST_START", "HTTP_RECV_START", "HTTP_RECV_END"]


def test_the_trace_file_cannot_be_changed_at_run_time(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    tracer = _tracer(out)
    with pytest.raises(KilnError) as err:
        tracer.update("", {"trace_file": ["/etc/cron.d/x"]})
    assert err.value.status is Status.UNSUPPORTED
    assert "trace_file" in err.value.message
    with pytest.raises(KilnError, match="trace_file"):
        tracer.update("m", {"trace_file": [str(tmp_path / "other.json")]})
    # the same path (what a client read back and sends again) is accepted
    assert tracer.update("", {"trace_file": [str(out)]})["trace_file"] == [str(out)]


def test_the_trace_mode_cannot_be_changed_at_run_time(tmp_path: Path) -> None:
    tracer = _tracer(tmp_path / "t.json")
    with pytest.raises(KilnError, match=r"trace_mode cannot be changed at run time") as err:
        tracer.update("", {"trace_mode": ["opentelemetry"]})
    assert err.value.status is Status.UNSUPPORTED


def test_parse_trace_config_reads_triton_flags() -> None:
    settings, otel = parse_trace_config(
        [
            "triton,file=/tmp/t.json",
            "level=TIMESTAMPS",
            "level=TENSORS",
            "rate=10",
            "count=5",
            "triton,log-frequency=50",
            "mode=triton",
        ]
    )
    assert otel is None  # triton mode
    settings = settings.get()
    assert settings["trace_file"] == ["/tmp/t.json"]
    assert settings["trace_level"] == ["TIMESTAMPS", "TENSORS"]
    assert settings["trace_rate"] == ["10"] and settings["trace_count"] == ["5"]
    assert settings["log_frequency"] == ["50"]
    old, _ = parse_trace_config([], {"trace_file": ["/tmp/x"], "trace_level": ["TIMESTAMPS"]})
    assert old.get()["trace_file"] == ["/tmp/x"]


def test_parse_trace_config_reads_opentelemetry_flags() -> None:
    settings, otel = parse_trace_config(
        [
            "mode=opentelemetry",
            "level=TIMESTAMPS",
            "rate=0",
            "opentelemetry,url=collector:4318",
            "opentelemetry,resource=service.name=edge",
            "opentelemetry,resource=deployment.environment=test",
            "opentelemetry,bsp_schedule_delay=100",
            "opentelemetry,bsp_max_queue_size=64",
            "opentelemetry,bsp_max_export_batch_size=8",
        ]
    )
    assert settings.get()["trace_mode"] == ["opentelemetry"]
    assert otel is not None
    assert OtelOptions.endpoint(otel.url) == "http://collector:4318/v1/traces"
    assert OtelOptions.endpoint("https://c:1/custom") == "https://c:1/custom"
    assert otel.resource == {"service.name": "edge", "deployment.environment": "test"}
    assert (otel.bsp_schedule_delay, otel.bsp_max_queue_size, otel.bsp_max_export_batch_size) == (
        100, 64, 8)  # fmt: skip


def test_otlp_over_grpc_exports_to_the_host_and_port_given() -> None:
    from kiln.core.trace_otel import OtelSink

    _settings, otel = parse_trace_config(
        ["mode=opentelemetry", "opentelemetry,url=collector:4317", "opentelemetry,protocol=grpc"]
    )
    assert otel is not None and otel.protocol == "grpc"
    sink = OtelSink(otel)
    try:
        assert sink.url == "http://collector:4317"  # no /v1/traces: gRPC has no path
    finally:
        sink.close()


def test_opentelemetry_settings_do_not_change_at_run_time() -> None:
    settings, otel = parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS"])
    tracer = Tracer(settings, otel)
    try:
        assert tracer.enabled and tracer.get()["trace_mode"] == ["opentelemetry"]
        with pytest.raises(KilnError, match="cannot be changed at run time in opentelemetry"):
            tracer.update("", {"trace_rate": ["1"]})
    finally:
        tracer.close()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["rate"], "expected \\[MODE,\\]SETTING=VALUE"),
        (["colour=red"], "'colour=red': unknown trace setting; known: rate, level"),
        (["triton,rate=3"], "unknown trace setting"),
        (["rate=often"], "'trace_rate' must be an integer from 0 to 4294967295, got 'often'"),
        (["level=LOUD"], "trace_level must be one of"),
        (["level=TIMESTAMPS"], "needs a file to write the traces to"),
        (["opentelemetry,url=localhost:4318"], "applies to mode=opentelemetry only"),
        (["mode=opentelemetry", "level=TENSORS"], "traces timestamps only"),
        (["mode=jaeger"], "trace_mode must be 'triton' or 'opentelemetry'"),
        (["mode=opentelemetry", "opentelemetry,bsp_schedule_delay=soon"], "positive integer"),
        (["mode=opentelemetry", "opentelemetry,resource=edge"], "resource=KEY=VALUE"),
        (["mode=opentelemetry", "opentelemetry,protocol=udp"], "one of http/protobuf, grpc"),
    ],
)
def test_parse_trace_config_names_what_is_wrong(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_trace_config(flags)


def test_opentelemetry_mode_without_the_sdk_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("opentelemetry") else real(name, *a),
    )
    with pytest.raises(ValueError, match=r"pip install 'kiln-serve\[otel\]'"):
        parse_trace_config(["mode=opentelemetry", "level=TIMESTAMPS"])
