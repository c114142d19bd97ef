"""KServe v2 JSON on the HTTP frontend: a large infer response is encoded, and a large
request body (an infer request's, a model load's with ``file:`` contents) is parsed, off
the event loop and a piece at a time.

Before, both ran as one orjson call on the loop: 40 MB of FP32 output held every other
client for 0.2 s, and 60 MB of nested input arrays for 4.6 s. A single call moved to a
thread would not help (orjson holds the GIL throughout), so the checks here are which
thread ran each orjson call and how much one call handled, and that the loop answers
another client while the encode is held on its worker; never how long anything took.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

from kiln.frontends.http.app import HttpFrontend
from kiln.server.server import ControlMode, Server, ServerOptions

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            y = (np.arange(int(x.size), dtype=np.float32) + x.astype(np.float32)) / 3
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", y)]))
        return out
"""
CONFIG = """
name: "%s"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
CONFIG_JSON = {
    "name": "big",
    "backend": "python",
    "max_batch_size": 0,
    "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}],
}
#: no orjson call on the event loop handles more than this (json_pieces.OFF_LOOP_PARSE_BYTES)
LOOP_LIMIT = 1 << 16
#: nor does any call anywhere for a large body: it goes a piece at a time
PIECE_LIMIT = 1 << 20


class _Recorder:
    """Wraps ``orjson.loads``/``dumps``: the thread and size of each call, and a gate that
    holds the first large call made off the loop until the test releases it."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.calls: list[tuple[int, int]] = []  # (thread, bytes of JSON)
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()
        self.recording = True

    def wrap(self, real: Callable[..., Any], size: Callable[[Any, Any], int]) -> Any:
        def recording(obj: Any, *args: Any, **kwargs: Any) -> Any:
            result = real(obj, *args, **kwargs)
            if not self.recording:  # the test's own checks
                return result
            n = size(obj, result)
            self.calls.append((threading.get_ident(), n))
            if n > 1024 and threading.get_ident() != self.loop_thread:
                self.entered.set()
                assert self.release.wait(60), "the test never released the worker"
            return result

        return recording

    def on_loop(self) -> list[int]:
        return [n for t, n in self.calls if t == self.loop_thread and n > LOOP_LIMIT]

    def largest(self) -> int:
        return max(n for _, n in self.calls)


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    rec = _Recorder()
    monkeypatch.setattr(orjson, "loads", rec.wrap(orjson.loads, lambda obj, _: len(obj)))
    monkeypatch.setattr(orjson, "dumps", rec.wrap(orjson.dumps, lambda _, out: len(out)))
    return rec


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[httpx.AsyncClient]:
    (tmp_path / "echo" / "1").mkdir(parents=True)
    (tmp_path / "echo" / "1" / "model.py").write_text(MODEL)
    (tmp_path / "echo" / "config.pbtxt").write_text(CONFIG % "echo")
    server = Server(ServerOptions([tmp_path], ControlMode.EXPLICIT, ["echo"]))
    await server.start()
    app = HttpFrontend(server).app()
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as c:
        yield c
    await server.stop()


def _infer_body(values: np.ndarray) -> bytes:
    x = {"name": "X", "datatype": "FP32", "shape": [values.size], "data": values}
    return orjson.dumps({"inputs": [x]}, option=orjson.OPT_SERIALIZE_NUMPY)


async def test_a_large_json_response_is_encoded_off_the_loop_a_slice_at_a_time(
    client: httpx.AsyncClient, recorder: _Recorder
) -> None:
    count = 300_000  # ~3 MB of JSON output
    body = _infer_body(np.zeros(count, dtype=np.float32))
    recorder.release.clear()
    recorder.calls.clear()
    infer = asyncio.create_task(client.post("/v2/models/echo/infer", content=body))
    assert await asyncio.to_thread(recorder.entered.wait, 60)
    # a worker holds the big request's JSON: the loop answers another client meanwhile
    ready = await client.get("/v2/health/ready")
    assert ready.status_code == 200
    recorder.release.set()
    answer = await infer
    recorder.recording = False
    assert answer.status_code == 200, answer.text
    out = orjson.loads(answer.content)["outputs"][0]
    want = np.arange(count, dtype=np.float32) / 3
    assert out["shape"] == [count] and np.array_equal(np.array(out["data"], np.float32), want)
    assert len(answer.content) > PIECE_LIMIT
    assert recorder.on_loop() == []  # neither the parse nor the encode ran on the loop
    assert recorder.largest() <= PIECE_LIMIT


async def test_a_small_infer_stays_on_the_loop(
    client: httpx.AsyncClient, recorder: _Recorder
) -> None:
    answer = await client.post("/v2/models/echo/infer", content=_infer_body(np.ones(4, "f4")))
    recorder.recording = False
    assert answer.status_code == 200, answer.text
    assert orjson.loads(answer.content)["outputs"][0]["data"] == pytest.approx(
        [(i + 1) / 3 for i in range(4)]
    )
    # the small path takes no thread hop: its parse and encode ran on the loop
    assert {t for t, _ in recorder.calls} == {recorder.loop_thread}


async def test_a_large_load_body_is_parsed_off_the_loop(
    client: httpx.AsyncClient, recorder: _Recorder
) -> None:
    padding = "#" + "x" * 2_000_000 + "\n"  # a 2 MB model.py: ~2.7 MB of base64
    parameters = {
        "config": orjson.dumps(CONFIG_JSON).decode(),
        "file:1/model.py": base64.b64encode((padding + MODEL).encode()).decode(),
    }
    content = orjson.dumps({"parameters": parameters})
    recorder.calls.clear()
    load = await client.post("/v2/repository/models/big/load", content=content)
    recorder.recording = False
    assert load.status_code == 200, load.text
    assert recorder.on_loop() == []
    answer = await client.post(
        "/v2/models/big/infer",
        content=orjson.dumps(
            {"inputs": [{"name": "X", "datatype": "FP32", "shape": [2], "data": [3, 3]}]}
        ),
    )
    assert answer.status_code == 200, answer.text
    assert orjson.loads(answer.content)["outputs"][0]["data"] == [1.0, pytest.approx(4 / 3)]


async def test_a_large_malformed_body_is_still_a_precise_400(
    client: httpx.AsyncClient, recorder: _Recorder
) -> None:
    good = _infer_body(np.zeros(200_000, dtype=np.float32))
    bad = good.replace(b"0.0,0.0", b"0.0,,0.0", 1)
    recorder.calls.clear()
    answer = await client.post("/v2/models/echo/infer", content=bad)
    recorder.recording = False
    assert answer.status_code == 400
    assert "failed to parse the request JSON buffer" in answer.json()["error"]
    assert recorder.on_loop() == []
    assert recorder.largest() <= PIECE_LIMIT
