"""``kiln chat`` and ``kiln complete`` (vLLM's ``vllm chat`` / ``vllm complete``) against a
real ``kiln serve --model``: the model found from /v1/models, answers streamed, the
conversation kept between messages, ``--stats``, and errors as one line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tests.conftest import KilnProcess, free_port
from tests.llm_models import build_tiny_llm

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    model = build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny")
    folder = tmp_path_factory.mktemp("serve")
    # random weights rarely sample the end token: answers held to 8 tokens, or two
    # exchanges would pass the 256-token context
    args = ["--model", str(model), "--num-gpu-blocks-override", "64", "--block-size", "4",
            "--override-generation-config", '{"max_new_tokens": 8}']  # fmt: skip
    proc = KilnProcess(folder, args, with_repository=False).start(timeout=120)
    yield proc
    proc.stop()


def _kiln(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kiln", *args]
    return subprocess.run(
        command, input=stdin, capture_output=True, text=True, timeout=120, env=ENV
    )


def _prompt_tokens(server: KilnProcess) -> float:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    [value] = re.findall(r"^vllm:request_prompt_tokens_sum\{[^}]*\} (\S+)$", text, re.M)
    return float(value)


def test_chat_finds_the_model_streams_and_keeps_the_conversation(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v1"
    before = _prompt_tokens(server)
    quick = _kiln("chat", "--url", url, "-q", "hello there", "--stats")
    assert quick.returncode == 0, quick.stderr
    lines = quick.stdout.splitlines()
    assert lines[0] == "Using model: tiny"
    assert lines[-2].startswith("TTFT: ") and lines[-2].endswith(" ms")
    assert re.fullmatch(r"TPS:  [\d.]+ tokens/s \(\d+ tokens in [\d.]+s\)", lines[-1])
    one = _prompt_tokens(server) - before
    # two messages, then end of input: the second request carries the first exchange
    session = _kiln(
        "chat", "--url", url, "--model-name", "tiny", stdin="hello there\nhello there\n"
    )
    assert session.returncode == 0, session.stderr
    assert "Please enter a message for the chat model:" in session.stdout
    two = _prompt_tokens(server) - before - one
    assert two > 2 * one


def test_complete_streams_each_prompt(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v1"
    done = _kiln("complete", "--url", url, "-q", "one two three", "--max-tokens", "5", "--stats")
    assert done.returncode == 0, done.stderr
    [tokens] = re.findall(r"\((\d+) tokens in", done.stdout)
    assert 1 <= int(tokens) <= 5
    lines = _kiln("complete", "--url", url, stdin="one\ntwo\n")
    assert lines.returncode == 0, lines.stderr
    assert lines.stdout.startswith("Using model: tiny\nPlease enter prompt to complete:\n")


def test_a_refused_message_leaves_the_conversation_going(server: KilnProcess) -> None:
    """A message the server refuses (here: past the context) is an error line; the
    conversation goes on without it, and the next message is answered."""
    url = f"http://{server.http_url}/v1"
    session = _kiln("chat", "--url", url, stdin="word " * 400 + "\nhello\n")
    assert session.returncode == 0, session.stderr
    assert "Error: " in session.stderr and "maximum context length" in session.stderr
    assert session.stdout.count("\n") >= 3  # the model line, the invitation, an answer


def test_errors_are_one_line(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v1"
    unknown = _kiln("chat", "--url", url, "--model-name", "nope", "-q", "hi")
    assert unknown.returncode == 1
    assert "404" in unknown.stderr and "nope" in unknown.stderr
    assert "Traceback" not in unknown.stderr
    away = _kiln("complete", "--url", f"http://127.0.0.1:{free_port()}/v1", "-q", "hi")
    assert away.returncode == 1 and "cannot reach" in away.stderr
    assert "Traceback" not in away.stderr
