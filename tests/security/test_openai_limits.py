"""Issue #25, item 10: the OpenAI routes (and Triton's generate on an llm model) read bodies
through the HTTP frontend's limits, refuse prompts that cannot fit before tokenizing them,
and never tokenize on the event loop."""

from __future__ import annotations

import asyncio
import json
import random
import select
import socket
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.frontends.http import llm_generate  # noqa: E402
from kiln.frontends.http.app import HttpFrontend  # noqa: E402
from kiln.frontends.openai import preparation  # noqa: E402
from kiln.frontends.openai.routes import openai_routes  # noqa: E402
from kiln.llm.tokenizer import Tokenizer  # noqa: E402
from kiln.server.server import ControlMode, Server, ServerOptions  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402

CONFIG = llm_config(block_size="4", num_gpu_blocks="64", dtype="float32")
MAX_INPUT = 8 * 1024 * 1024
ROUTES = ("/v1/completions", "/v1/chat/completions")
# a reply slower than this is a stalled server (none of these takes a second when healthy)
STALL = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    args = ["--http-max-input-size", str(MAX_INPUT), "--http-read-timeout-secs", "1"]
    proc = KilnProcess(repo, args).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0, timeout=STALL
    )


def _head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def _response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of the one response on ``sock`` (a stall raises TimeoutError)."""
    sock.settimeout(STALL)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a response: {data!r}"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers["content-length"])
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk
        body += chunk
    return int(lines[0].split()[1]), json.loads(body[:length])


def _openai_error(body: dict[str, Any]) -> dict[str, Any]:
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    return dict(err)


@pytest.mark.parametrize("path", ROUTES)
def test_a_body_over_the_input_limit_is_413_before_it_is_read(
    server: KilnProcess, path: str
) -> None:
    # 300 MiB announced, 1 KiB sent: the answer must not wait for the rest
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        start = b'{"model": "tiny", "prompt": "' + b"a" * 1024
        sock.sendall(_head(path, 300 * 1024 * 1024) + start)
        status, body = _response(sock)
    assert status == 413
    assert "--http-max-input-size" in _openai_error(body)["message"]


@pytest.mark.parametrize("path", ROUTES)
def test_a_slow_body_is_408(server: KilnProcess, path: str) -> None:
    payload = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1}).encode()
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(_head(path, len(payload)))
        # one byte every half second: the whole body would take over a minute
        for byte in payload[:-1]:
            sock.sendall(bytes([byte]))
            if select.select([sock], [], [], 0.5)[0]:
                break
        status, body = _response(sock)
    assert status == 408
    assert "--http-read-timeout-secs" in _openai_error(body)["message"]


def test_a_head_without_its_body_is_408(server: KilnProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
        sock.sendall(_head("/v1/completions", 100))  # and not one body byte
        status, body = _response(sock)
    assert status == 408
    assert "--http-read-timeout-secs" in _openai_error(body)["message"]


def _huge_text(chars: int) -> str:
    # varied words: the slowest kind of text for a BPE tokenizer, byte for byte
    rng = random.Random(0)
    return "".join(rng.choice("abcdefghij é") for _ in range(chars))


HUGE = 5 * 1024 * 1024


class _LoopWatch:
    """Records which thread ran each tokenizer call and each wrapped step; a tokenizer call
    on the event loop fails at once. A wrapped step (``gate``) is held until the test has
    had another client answered."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop_thread = threading.get_ident()  # made on the test's event loop
        self.tokenized: list[int] = []
        self.gated: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        for name in ("encode", "apply_chat_template"):
            monkeypatch.setattr(Tokenizer, name, self._watched(getattr(Tokenizer, name)))

    def _watched(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.tokenized.append(threading.get_ident())
            if threading.get_ident() == self.loop_thread:
                raise AssertionError("the tokenizer ran on the event loop")
            return real(*args, **kwargs)

        return call

    def gate(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any) -> Any:
            self.gated.append(threading.get_ident())
            self.entered.set()
            if threading.get_ident() == self.loop_thread:
                raise AssertionError("the prompt was prepared on the event loop")
            assert self.release.wait(60), "the test never released the step"
            return real(*args)

        return held


@pytest.fixture
async def in_process(tmp_path: Path) -> AsyncIterator[Any]:
    server = Server(
        ServerOptions([tiny_llm_repository(tmp_path, CONFIG)], ControlMode.EXPLICIT, ["tiny"])
    )
    await server.start()
    frontend = HttpFrontend(server)
    yield frontend.app(openai_routes(server, frontend))
    await server.stop()


@pytest.mark.parametrize("route", ["completions", "chat", "generate"])
async def test_a_huge_prompt_is_400_and_never_tokenized_on_the_event_loop(
    in_process: Any, monkeypatch: pytest.MonkeyPatch, route: str
) -> None:
    """A 5 MB prompt is refused for the model's context from its size, before any
    tokenizing; no tokenizer call runs on the event loop. Chat's template step and
    generate's decode run on a worker thread: the test holds that step at a gate and has a
    health probe answered meanwhile. Which thread ran what is checked, never how long."""
    watch = _LoopWatch(monkeypatch)
    if route == "chat":
        monkeypatch.setattr(preparation, "chat_prompt", watch.gate(preparation.chat_prompt))
    elif route == "generate":
        monkeypatch.setattr(llm_generate, "decode", watch.gate(llm_generate.decode))
    text = _huge_text(HUGE)
    transport = httpx.ASGITransport(app=in_process)
    async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as http:
        if route == "generate":
            call = http.post("/v2/models/tiny/generate", json={"text_input": text})
        else:
            client = openai.AsyncOpenAI(
                base_url="http://kiln/v1", api_key="unused", max_retries=0, http_client=http
            )
            if route == "chat":
                messages = [{"role": "user", "content": text}]
                call = client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
            else:
                call = client.completions.create(model="tiny", prompt=text)
        task = asyncio.ensure_future(call)
        if route != "completions":  # completions refuse it on the loop, from len() alone
            assert await asyncio.to_thread(watch.entered.wait, 60), "the step never ran"
            assert (await http.get("/v2/health/ready")).status_code == 200
            watch.release.set()
        if route == "generate":
            response = await task
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert "characters" in error and "'text_input'" in error
        else:
            with pytest.raises(openai.BadRequestError) as info:
                await task
            err = info.value.body
            assert isinstance(err, dict)
            assert err["param"] == ("messages" if route == "chat" else "prompt")
            assert err["code"] == "context_length_exceeded"
    assert watch.loop_thread not in watch.tokenized
    assert watch.loop_thread not in watch.gated
    assert len(watch.gated) == (0 if route == "completions" else 1)


def test_too_many_messages_are_400(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": ""}] * 4097
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)  # type: ignore[arg-type]
    err = info.value.body
    assert isinstance(err, dict) and err["param"] == "messages"
    assert "4096" in err["message"]


def test_the_server_still_answers(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert reply.choices[0].finish_reason in ("length", "stop")
