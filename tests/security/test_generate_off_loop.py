"""Triton's generate extension: a large response is encoded off the event loop, a slice
at a time, into the same bytes as one call.

Before, ``generate`` and ``generate_stream`` built each response with ``tolist`` and one
``orjson.dumps`` on the loop: a model answering 32 M elements held every other client for
1.1 s. The checks are which thread ran each orjson call and how much one call handled,
and that the loop answers another client while a worker holds the encode; never how long
anything took.
"""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import orjson
import pytest

from kiln.frontends.tensors import OFF_LOOP_ENCODE_ELEMENTS
from tests.security.test_json_off_loop import PIECE_LIMIT, _Recorder, client, recorder

__all__ = ["client", "recorder"]  # the fixtures this module uses

COUNT = 300_000  # ~5 MB of JSON output, > OFF_LOOP_ENCODE_ELEMENTS


def _expected(count: int) -> bytes:
    """What one ``orjson.dumps`` of the whole response gave (the bytes before the fix)."""
    y = np.arange(count, dtype=np.float32) / 3  # the echo model: (arange + X) / 3, X = 0
    return orjson.dumps({"model_name": "echo", "model_version": "1", "Y": y.tolist()})


@pytest.mark.parametrize("route", ["generate", "generate_stream"])
async def test_a_large_generate_response_is_encoded_off_the_loop(
    client: httpx.AsyncClient, recorder: _Recorder, route: str
) -> None:
    body = orjson.dumps({"X": [0] * COUNT})
    recorder.release.clear()
    recorder.calls.clear()
    call = asyncio.create_task(client.post(f"/v2/models/echo/{route}", content=body))
    assert await asyncio.to_thread(recorder.entered.wait, 60)
    # a worker holds the big request's JSON: the loop answers another client meanwhile
    ready = await client.get("/v2/health/ready")
    assert ready.status_code == 200
    recorder.release.set()
    answer = await call
    recorder.recording = False
    assert answer.status_code == 200, answer.text
    content = answer.content
    if route == "generate_stream":
        assert content.startswith(b"data: ") and content.endswith(b"\n\n")
        content = content[len(b"data: ") : -2]
    assert content == _expected(COUNT)  # the same bytes as one call
    assert recorder.on_loop() == []  # neither the parse nor the encode ran on the loop
    assert recorder.largest() <= PIECE_LIMIT


async def test_a_small_generate_response_stays_on_the_loop(
    client: httpx.AsyncClient, recorder: _Recorder
) -> None:
    count = OFF_LOOP_ENCODE_ELEMENTS // 4
    recorder.calls.clear()
    answer = await client.post("/v2/models/echo/generate", content=orjson.dumps({"X": [0] * count}))
    recorder.recording = False
    assert answer.status_code == 200, answer.text
    assert answer.content == _expected(count)
    # the small path takes no thread hop: its parse and encode ran on the loop
    assert {t for t, _ in recorder.calls} == {recorder.loop_thread}
