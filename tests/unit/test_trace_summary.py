"""``kiln trace summary`` on trace files in Triton's format."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from kiln.cli import main


def _trace(trace_id: int, model: str, stamps: dict[str, int], **head: object) -> list[dict]:
    entries: list[dict] = [{"id": trace_id, "model_name": model, "model_version": 1, **head}]
    entries += [{"id": trace_id, "timestamps": [{"name": n, "ns": ns}]} for n, ns in stamps.items()]
    return entries


def _http(trace_id: int, scale: int) -> list[dict]:
    """An HTTP trace whose phases last ``scale`` µs times a fixed pattern."""
    us = 1000 * scale
    names = ["HTTP_RECV_START", "HTTP_RECV_END", "REQUEST_START", "QUEUE_START",
             "COMPUTE_START", "COMPUTE_INPUT_END", "COMPUTE_OUTPUT_START", "COMPUTE_END",
             "REQUEST_END", "HTTP_SEND_START", "HTTP_SEND_END"]  # fmt: skip
    return _trace(trace_id, "simple", {n: i * us for i, n in enumerate(names)})


def test_phases_are_averaged_per_model_and_protocol(tmp_path: Path) -> None:
    first, second = tmp_path / "t.json.0", tmp_path / "t.json.1"
    first.write_text(json.dumps(_http(1, 1) + _http(2, 3)))
    child = {"REQUEST_START": 0, "QUEUE_START": 5_000, "COMPUTE_START": 9_000,
             "COMPUTE_END": 20_000, "REQUEST_END": 21_000}  # fmt: skip
    second.write_text(json.dumps(_trace(3, "cnn", child, parent_id=1)))
    result = CliRunner().invoke(main, ["trace", "summary", str(first), str(second), "--json"])
    assert result.exit_code == 0, result.output
    groups = {(g["model_name"], g["protocol"]): g for g in json.loads(result.output)}
    http = groups[("simple", "HTTP")]
    assert http["traces"] == 2
    # each phase is one step of the pattern: 1 µs and 3 µs, mean 2 µs
    mean = http["mean_us"]
    assert mean["receive"] == mean["queue"] == mean["compute input"] == mean["send"] == 2.0
    assert mean["compute"] == 6.0  # three steps
    assert mean["handler"] == 12.0  # REQUEST_START (2) to REQUEST_END (8): six steps
    assert mean["request"] == 20.0  # first to last stamp: ten steps
    cnn = groups[("cnn", "in-server")]["mean_us"]
    assert cnn == {"request": 21.0, "handler": 21.0, "queue": 4.0, "compute": 11.0}

    table = CliRunner().invoke(main, ["trace", "summary", str(first)])
    assert table.exit_code == 0 and "compute infer" in table.output and "HTTP" in table.output


def test_files_that_are_not_traces_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"id": 1}')
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    for path, message in [
        (bad, "bad.json: not a trace file"),
        (broken, "broken.json: not JSON (line 1"),
        (tmp_path / "missing.json", "missing.json: No such file"),
    ]:
        result = CliRunner().invoke(main, ["trace", "summary", str(path)])
        assert result.exit_code == 1
        assert message in result.output
    empty = tmp_path / "empty.json"
    empty.write_text("[]")
    result = CliRunner().invoke(main, ["trace", "summary", str(empty)])
    assert result.exit_code == 0 and "no traces in" in result.output
