"""``kiln run-batch`` (vLLM's ``vllm run-batch``): a real OpenAI batch file answered by a
random-weight Llama in the real command, each answer equal to what ``kiln serve`` answers
over HTTP to the real ``openai`` client; failures as output lines; the input read from
and the output written to a real HTTP server; a malformed file refused naming its line
before any model loads; /metrics while the batch runs."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess, free_port  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
GREEDY = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], **GREEDY}
TEXT = {"model": "tiny", "prompt": "one two three", **GREEDY}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny")


def _line(custom_id: str, url: str, body: dict[str, Any], method: str = "POST") -> str:
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def _command(model: Path, source: str, target: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kiln", "run-batch", "-i", source, "-o", target,
            str(model), "--num-gpu-blocks-override", "64", "--block-size", "4", *extra]  # fmt: skip


ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


def _run_batch(
    model: Path, source: str, target: str, *extra: str, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    command = _command(model, source, target, *extra)
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=ENV)


def _outputs(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    folder = tmp_path_factory.mktemp("serve")
    args = ["--model", str(model), "--num-gpu-blocks-override", "64", "--block-size", "4"]
    proc = KilnProcess(folder, args, with_repository=False).start(timeout=120)
    yield proc
    proc.stop()


def test_each_line_is_answered_as_the_server_answers_it(
    model: Path, server: KilnProcess, tmp_path: Path
) -> None:
    lines = [
        _line("chat", "/v1/chat/completions", CHAT),
        _line("text", "/v1/completions", TEXT),
        _line("two", "/v1/chat/completions", {**CHAT, "n": 2, "temperature": 0.8, "seed": 3}),
        _line("unknown-model", "/v1/chat/completions", {**CHAT, "model": "nope"}),
        _line("bad-field", "/v1/completions", {**TEXT, "max_tokens": -3}),
        _line("streamed", "/v1/completions", {**TEXT, "stream": True}),
        _line("no-such-url", "/v1/audio/transcriptions", {"model": "tiny"}),
        _line("get", "/v1/completions", TEXT, method="GET"),
        _line("pools-not", "/v1/embeddings", {"model": "tiny", "input": "x"}),
    ]
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines[:3]) + "\n\n" + "\n".join(lines[3:]) + "\n")
    done = _run_batch(model, str(source), str(target))
    assert done.returncode == 0, done.stderr
    # the engine process leaves without the interpreter's finalization, where triton's
    # bindings (imported by torch) print pages of "leaked" warnings
    assert "leaked" not in done.stderr, done.stderr
    outputs = _outputs(target)
    # one answer per request, in the input's order, each with its own ids
    assert [o["custom_id"] for o in outputs] == [json.loads(x)["custom_id"] for x in lines]
    assert len({o["id"] for o in outputs}) == len({o["response"]["request_id"] for o in outputs})
    by_id = {o["custom_id"]: o for o in outputs}
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="-", max_retries=0)
    # the same greedy tokens as the server's answer to the same body
    extra = {"ignore_eos": True}
    want_chat = client.chat.completions.create(
        model="tiny", messages=CHAT["messages"], temperature=0, max_tokens=6, extra_body=extra
    )
    chat = by_id["chat"]
    assert (chat["response"]["status_code"], chat["error"]) == (200, None)
    body = chat["response"]["body"]
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"] == want_chat.choices[0].message.content
    assert body["usage"]["completion_tokens"] == 6
    want_text = client.completions.create(
        model="tiny", prompt=TEXT["prompt"], temperature=0, max_tokens=6, extra_body=extra
    )
    assert by_id["text"]["response"]["body"]["choices"][0]["text"] == want_text.choices[0].text
    assert len(by_id["two"]["response"]["body"]["choices"]) == 2
    # failures are answers too, with the server's status and OpenAI's error object
    for custom_id, status, words in [
        ("unknown-model", 404, "nope"),
        ("bad-field", 400, "max_tokens"),
        ("streamed", 400, "stream mode"),
        ("no-such-url", 400, "/v1/audio/transcriptions"),
        ("get", 400, "POST"),
        ("pools-not", 400, "embed"),
    ]:
        failed = by_id[custom_id]
        assert failed["response"]["status_code"] == status, failed
        assert failed["response"]["body"] is None
        assert words in failed["error"]["error"]["message"], failed


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"custom_id": "a", "method": "POST", "url": "/v1/completions"', "line 2: not JSON"),
        ("[1, 2]", "line 2: a JSON object is expected, not an array"),
        ('{"method": "POST", "url": "/v1/completions", "body": {}}',
         "line 2: field 'custom_id' is missing"),
        ('{"custom_id": 7, "method": "POST", "url": "/v1/completions", "body": {}}',
         "line 2: field 'custom_id' is a number, not a string"),
        ('{"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": "x"}',
         "line 2: field 'body' is a string, not an object"),
        ('{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}',
         "line 2: custom_id 'a' is also the id of line 1"),
    ],
)  # fmt: skip
def test_a_malformed_file_is_refused_naming_its_line_before_any_model_loads(
    tmp_path: Path, text: str, message: str
) -> None:
    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("a", "/v1/completions", TEXT) + "\n" + text + "\n")
    # no such checkpoint is needed: the file is refused before the model is read
    done = _run_batch(tmp_path, str(source), str(target), timeout=60)
    assert done.returncode == 1
    assert f"--input-file: {source} {message}" in done.stderr, done.stderr
    assert "loaded model" not in done.stderr
    assert not target.exists()


class _Files(http.server.BaseHTTPRequestHandler):
    """GET serves ``files``; PUT stores the body in ``files``."""

    files: dict[str, bytes] = {}

    def do_GET(self) -> None:
        data = self.files.get(self.path)
        self.send_response(200 if data is not None else 404)
        self.send_header("Content-Length", str(len(data or b"")))
        self.end_headers()
        self.wfile.write(data or b"")

    def do_PUT(self) -> None:
        self.files[self.path] = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_input_and_output_over_http_and_metrics_while_running(model: Path, tmp_path: Path) -> None:
    """An http(s) URL is read with GET and written with PUT (vLLM's); ``--enable-metrics``
    serves /metrics on ``--port`` until the batch is done."""
    _Files.files = {"/in.jsonl": (_line("chat", "/v1/chat/completions", CHAT) + "\n").encode()}
    files = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Files)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_address[1]}"
    port = free_port()
    command = _command(
        model, f"{base}/in.jsonl", f"{base}/out.jsonl", "--output-tmp-dir", str(tmp_path),
        "--enable-metrics", "--port", str(port),
    )  # fmt: skip
    scraped = b""
    try:
        proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=ENV)
        while proc.poll() is None and not scraped:
            try:  # /metrics listens from before the model loads until the batch is done
                scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read()
            except OSError:
                time.sleep(0.05)
        _, stderr = proc.communicate(timeout=300)
    finally:
        files.shutdown()
    assert proc.returncode == 0, stderr
    assert b"# TYPE nv_" in scraped, scraped  # kiln's (Triton's) families
    [output] = [json.loads(x) for x in _Files.files["/out.jsonl"].decode().splitlines()]
    assert output["custom_id"] == "chat" and output["response"]["status_code"] == 200
    assert list(tmp_path.iterdir()) == []  # the file uploaded is gone
    with pytest.raises(OSError):  # the metrics server stopped with the batch
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)
