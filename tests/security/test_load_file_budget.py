"""Concurrent loads with ``file:`` parameters share one budget of decoded bytes
(--max-load-file-bytes). Each load was bounded by the request size alone, so many loads at
once held unbounded decoded contents in memory until they were written. A load that would
pass the budget is refused at once, before anything is decoded: 503 (gRPC UNAVAILABLE),
try again, with the numbers; one larger than the whole budget is a 413."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from kiln.frontends.http.app import HttpFrontend
from kiln.repository import load_files
from kiln.server.server import ControlMode, Server, ServerOptions

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.array([7], np.int64))])
                for _ in requests]
"""
BUDGET = 3 << 20


def _load_body(name: str, size: int) -> bytes:
    source = "#" + "x" * size + "\n" + MODEL
    config = {
        "name": name,
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "X", "data_type": "TYPE_INT64", "dims": [1]}],
        "output": [{"name": "Y", "data_type": "TYPE_INT64", "dims": [1]}],
    }
    parameters = {
        "config": orjson.dumps(config).decode(),
        "file:1/model.py": base64.b64encode(source.encode()).decode(),
    }
    return orjson.dumps({"parameters": parameters})


@pytest.fixture
async def client(tmp_path: Path) -> AsyncIterator[tuple[httpx.AsyncClient, Server]]:
    options = ServerOptions([tmp_path], ControlMode.EXPLICIT)
    options.max_load_file_bytes = BUDGET  # --max-load-file-bytes
    server = Server(options)
    await server.start()
    transport = httpx.ASGITransport(app=HttpFrontend(server).app())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as c:
        yield c, server
    await server.stop()


async def test_concurrent_file_loads_share_one_budget(
    client: tuple[httpx.AsyncClient, Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    http, server = client
    entered, release = threading.Event(), threading.Event()
    real = load_files._decode_and_write

    def held(name: str, files: dict[str, Any]) -> Path:
        if name == "first":  # the first load's contents stay decoded until released
            entered.set()
            assert release.wait(60), "the test never released the first load"
        return real(name, files)

    monkeypatch.setattr(load_files, "_decode_and_write", held)
    first = asyncio.create_task(
        http.post("/v2/repository/models/first/load", content=_load_body("first", 2 << 20))
    )
    try:
        assert await asyncio.to_thread(entered.wait, 60)
        second_body = _load_body("second", 2 << 20)
        refused = await http.post("/v2/repository/models/second/load", content=second_body)
        assert refused.status_code == 503, refused.text
        message = refused.json()["error"]
        held_bytes = server.repository.file_budget.held
        assert held_bytes >= 2 << 20
        assert f"other loads are writing {held_bytes} bytes" in message
        assert f"the limit of {BUDGET} bytes (--max-load-file-bytes)" in message
        assert "failed to load 'second'" in message and "Try again later" in message
    finally:
        release.set()
    assert (await first).status_code == 200
    assert server.repository.file_budget.held == 0  # released once written
    again = await http.post("/v2/repository/models/second/load", content=second_body)
    assert again.status_code == 200, again.text
    infer = {"inputs": [{"name": "X", "datatype": "INT64", "shape": [1], "data": [1]}]}
    answer = await http.post("/v2/models/second/infer", content=orjson.dumps(infer))
    assert answer.json()["outputs"][0]["data"] == [7]


async def test_a_load_larger_than_the_whole_budget_is_a_413(
    client: tuple[httpx.AsyncClient, Server],
) -> None:
    http, server = client
    answer = await http.post("/v2/repository/models/huge/load", content=_load_body("huge", 4 << 20))
    assert answer.status_code == 413, answer.text
    message = answer.json()["error"]
    assert message.startswith("failed to load 'huge': its 'file:' parameters hold ")
    assert f"more than the limit of {BUDGET} bytes (--max-load-file-bytes)" in message
    assert server.repository.file_budget.held == 0
