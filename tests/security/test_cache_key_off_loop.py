"""A response cache key digests every input byte, and each element of a BYTES tensor in
Python: a 64 MiB request of millions of short strings took seconds. That ran on the event
loop, before the request was queued, so every other client waited. A large request's key
is now computed on a worker thread, as a large body is decoded; a small one stays put."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.cache.config import CacheConfig
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.server import runtime as runtime_module
from kiln.server.server import ControlMode, Server, ServerOptions

MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            size = pb_utils.get_input_tensor_by_name(r, "S").as_numpy().size
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("N", np.array([size], dtype=np.int64))]))
        return out
"""
CONFIG = """
name: "count"
backend: "python"
max_batch_size: 0
input [ { name: "S" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "N" data_type: TYPE_INT64 dims: [ 1 ] } ]
response_cache { enable: true }
"""


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    (tmp_path / "count" / "1").mkdir(parents=True)
    (tmp_path / "count" / "1" / "model.py").write_text(MODEL)
    (tmp_path / "count" / "config.pbtxt").write_text(CONFIG)
    cache = CacheConfig.parse(["local,size=1048576"])
    srv = Server(ServerOptions([tmp_path], ControlMode.EXPLICIT, ["count"], cache=cache))
    await srv.start()
    yield srv
    await srv.stop()


def _request(count: int) -> InferenceRequest:
    data = np.empty(count, dtype=object)
    data[:] = [b"x"] * count
    return InferenceRequest("count", inputs=[InferInput("S", DataType.BYTES, (count,), data)])


async def test_a_large_request_s_key_is_computed_off_the_event_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[int] = []
    real = runtime_module.request_key

    def recording(*args: Any, **kwargs: Any) -> bytes:
        threads.append(threading.get_ident())
        return real(*args, **kwargs)

    monkeypatch.setattr(runtime_module, "request_key", recording)
    loop_thread = threading.get_ident()
    for count in (4, 500_000):
        response = await server.infer(_request(count))
        assert int(response.outputs[0].data[0]) == count
    assert threads[0] == loop_thread  # four strings: not worth a thread
    assert threads[1] != loop_thread
    again = await server.infer(_request(500_000))  # and the key finds the same entry
    assert int(again.outputs[0].data[0]) == 500_000
    assert server.model("count").stats.cache_hit.count == 1
