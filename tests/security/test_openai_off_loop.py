"""`/detokenize` checked each of a body's ids on the event loop: 62 MB of token ids held
every other client for three seconds. It checks and decodes them on a worker thread, where
the interpreter still hands the loop its turns (the parse itself cannot move: orjson holds
the GIL throughout; --http-max-input-size bounds it)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

pytest.importorskip("transformers")

from kiln.frontends.http.app import HttpFrontend
from kiln.frontends.openai import preparation, routes
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


async def test_detokenize_checks_and_decodes_its_ids_off_the_event_loop(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    checked: list[int] = []
    real_check = preparation.detokenize_ids

    def check(body: dict[str, Any], vocab: int) -> list[int]:
        checked.append(threading.get_ident())
        return real_check(body, vocab)

    monkeypatch.setattr(preparation, "detokenize_ids", check)
    frontend = HttpFrontend(server)
    app = frontend.app(routes.openai_routes(server, frontend))
    loop = threading.get_ident()
    for count in (3, 600_000):
        body = orjson.dumps({"model": "tiny", "tokens": [5] * count})
        status, raw = await call(app, "/detokenize", body)
        assert status == 200, raw
        want = server.llm_engines()["tiny"].tokenizer.decode([5] * count, False)
        assert orjson.loads(raw)["prompt"] == want
    assert len(checked) == 2 and loop not in checked
    # an id outside the vocabulary is still the client's 400, found on the worker
    status, raw = await call(app, "/detokenize", orjson.dumps({"model": "tiny", "tokens": [-1]}))
    assert status == 400 and b"token ids must be in" in raw


async def test_a_large_body_is_parsed_off_the_event_loop_a_piece_at_a_time(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One orjson call holds the GIL throughout, even on a thread: a large body's JSON is
    parsed on a worker, 64 KiB a call (kiln.frontends.json_pieces)."""
    body = orjson.dumps({"model": "tiny", "tokens": [5] * 600_000})  # 1.8 MB
    calls: list[tuple[int, int]] = []
    real_loads = orjson.loads

    def loads(raw: Any) -> Any:
        calls.append((threading.get_ident(), len(raw)))
        return real_loads(raw)

    frontend = HttpFrontend(server)
    app = frontend.app(routes.openai_routes(server, frontend))
    monkeypatch.setattr(orjson, "loads", loads)
    status, raw = await call(app, "/detokenize", body)
    monkeypatch.undo()
    assert status == 200, raw
    want = server.llm_engines()["tiny"].tokenizer.decode([5] * 600_000, False)
    assert orjson.loads(raw)["prompt"] == want
    loop = threading.get_ident()
    assert [n for t, n in calls if t == loop and n > 1 << 16] == []
    assert max(n for _, n in calls) <= 1 << 20
