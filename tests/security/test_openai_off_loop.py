"""An OpenAI route's body of 62 MB (token ids) took half a second to parse and `/detokenize`
three more to check, on the event loop: every other client waited. A body over 1 MiB is
parsed on a worker thread (as the KServe routes decode theirs), and /detokenize checks and
decodes its ids on one; a small body stays on the loop."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("transformers")

from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.openai import endpoint, preparation, routes
from kiln.run_batch import call
from kiln.server.server import ControlMode, Server, ServerOptions
from tests.llm_models import llm_config, tiny_llm_repository


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    repo = tiny_llm_repository(tmp_path, llm_config(block_size="4", num_gpu_blocks="32"))
    srv = Server(ServerOptions([repo], ControlMode.EXPLICIT, ["tiny"]))
    await srv.start()
    yield srv
    await srv.stop()


class _Recording:
    """orjson, with ``loads`` noting the thread it ran on."""

    def __init__(self, threads: list[int]) -> None:
        self.threads = threads

    def loads(self, raw: bytes) -> Any:
        self.threads.append(threading.get_ident())
        return orjson.loads(raw)

    def __getattr__(self, name: str) -> Any:
        return getattr(orjson, name)


async def test_large_bodies_are_parsed_and_detokenized_off_the_event_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    parsed: list[int] = []
    checked: list[int] = []
    real_check = preparation.detokenize_ids

    def check(body: dict[str, Any], vocab: int) -> list[int]:
        checked.append(threading.get_ident())
        return real_check(body, vocab)

    monkeypatch.setattr(endpoint, "orjson", _Recording(parsed))
    monkeypatch.setattr(preparation, "detokenize_ids", check)
    frontend = HttpFrontend(server)
    app = frontend.app(routes.openai_routes(server, frontend))
    loop = threading.get_ident()
    for count in (3, 600_000):  # 9 bytes of ids, then 1.2 MB
        body = orjson.dumps({"model": "tiny", "tokens": [5] * count})
        status, raw = await call(app, "/detokenize", body)
        assert status == 200, raw
        want = server.llm_engines()["tiny"].tokenizer.decode([5] * count, False)
        assert orjson.loads(raw)["prompt"] == want
    assert parsed[0] == loop and checked[0] != loop  # a small body: parsed in place
    assert parsed[1] != loop and checked[1] != loop
    # a large body that is not JSON is still the client's 400
    status, raw = await call(app, "/detokenize", b"[" * (2 << 20))
    assert status == 400 and b"not valid JSON" in raw
