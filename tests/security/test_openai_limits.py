"""Issue #25, item 10: the OpenAI routes (and Triton's generate on an llm model) read bodies
through the HTTP frontend's limits, refuse prompts that cannot fit before tokenizing them,
and never tokenize on the event loop."""

from __future__ import annotations

import json
import random
import select
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

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


class _Probes:
    """Another client asking /v2/health/ready again and again while a request is handled:
    each answer must come (a stalled event loop answers none)."""

    def __init__(self, server: KilnProcess) -> None:
        self.url = f"http://{server.http_url}/v2/health/ready"
        self.answered = 0
        self.stalled: list[str] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=STALL / 4) as reply:
                    assert reply.status == 200
                self.answered += 1
                self.first.set()
            except (urllib.error.URLError, TimeoutError) as exc:
                self.stalled.append(repr(exc))

    def __enter__(self) -> _Probes:
        self.first = threading.Event()
        self._thread.start()
        assert self.first.wait(STALL), "the probes never got an answer"
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def _huge_text(chars: int) -> str:
    # varied words: the slowest kind of text for a BPE tokenizer, byte for byte
    rng = random.Random(0)
    return "".join(rng.choice("abcdefghij é") for _ in range(chars))


HUGE = 5 * 1024 * 1024


@pytest.mark.parametrize("route", ["completions", "chat", "generate"])
def test_a_huge_prompt_is_400_and_other_clients_are_served(
    server: KilnProcess, client: openai.OpenAI, route: str
) -> None:
    text = _huge_text(HUGE)
    with _Probes(server) as probes:
        if route == "generate":
            with socket.create_connection(("127.0.0.1", server.http_port)) as sock:
                payload = json.dumps({"text_input": text}).encode()
                sock.sendall(_head("/v2/models/tiny/generate", len(payload)) + payload)
                status, body = _response(sock)
            assert status == 400
            assert "characters" in body["error"] and "'text_input'" in body["error"]
        else:
            with pytest.raises(openai.BadRequestError) as info:
                if route == "chat":
                    messages = [{"role": "user", "content": text}]
                    client.chat.completions.create(model="tiny", messages=messages)  # type: ignore[arg-type]
                else:
                    client.completions.create(model="tiny", prompt=text)
            err = info.value.body
            assert isinstance(err, dict)
            assert err["param"] == ("messages" if route == "chat" else "prompt")
            assert err["code"] == "context_length_exceeded"
    # the other client was answered every time, while the huge prompt was handled too
    assert probes.stalled == []


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
