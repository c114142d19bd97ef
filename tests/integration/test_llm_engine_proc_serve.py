"""``kiln serve --model``, the engine in its own process, driven by the real ``openai``
client: a killed engine process fails the request in flight with 500 naming the model and
the next request is served by a new one; the server leaves no engine process behind
whether it is stopped or killed; ``--no-enable-multiprocessing`` keeps it on a thread."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402
from tests.procs import children, cmdline, engine_pid, gone  # noqa: E402

ARGS = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
        "--kv-cache-memory", "1M", "--block-size", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny")


IGNORE_EOS = {"ignore_eos": True}


def serve(folder: Path, home: Path, *extra: str) -> KilnProcess:
    args = ["--model", str(folder), *ARGS, *extra]
    return KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=180)


def decode(folder: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids)
    return text


def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def test_a_killed_engine_fails_its_request_with_500_and_the_model_reloads(
    folder: Path, tmp_path: Path
) -> None:
    server = serve(folder, tmp_path)
    try:
        api = client(server)
        pid = engine_pid(server)
        errors: list[Exception] = []

        def long_request() -> None:
            try:
                api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=200,
                                       temperature=0.0, extra_body=IGNORE_EOS)  # fmt: skip
            except Exception as exc:
                errors.append(exc)

        worker = threading.Thread(target=long_request)
        worker.start()
        while not any(b"tiny" in line for line in metrics_running(server)):
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        worker.join(timeout=120)
        [error] = errors
        assert isinstance(error, openai.InternalServerError)
        assert "model 'tiny': the engine process stopped (killed by signal 9)" in str(error)
        # the model stays loaded: the next request waits for the new engine process
        answer = api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=8,
                                        temperature=0.0, extra_body=IGNORE_EOS)  # fmt: skip
        assert answer.choices[0].finish_reason == "length"
        assert engine_pid(server) != pid and gone(pid)
        # streamed: the chunks in order make the whole answer's text
        whole = api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=10,
                                       temperature=0.0, extra_body=IGNORE_EOS)  # fmt: skip
        stream = api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=10,
                                        temperature=0.0, stream=True,
                                        extra_body=IGNORE_EOS)  # fmt: skip
        text = "".join(c.choices[0].text for c in stream if c.choices)
        assert text == whole.choices[0].text
        assert text == decode(folder, reference_generate(folder, [5, 6, 7], 10))
    finally:
        server.stop()


def metrics_running(server: KilnProcess) -> list[bytes]:
    """``vllm:num_requests_running`` lines with a request running."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        lines = r.read().splitlines()
    return [
        line
        for line in lines
        if line.startswith(b"vllm:num_requests_running{") and not line.endswith(b" 0.0")
    ]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_engine_process_outlives_the_server(
    folder: Path, tmp_path: Path, sig: signal.Signals
) -> None:
    server = serve(folder, tmp_path)
    pid = engine_pid(server)
    server.stop(sig)
    assert gone(pid)


def test_no_enable_multiprocessing_keeps_the_engine_on_a_thread(
    folder: Path, tmp_path: Path
) -> None:
    server = serve(folder, tmp_path, "--no-enable-multiprocessing")
    try:
        assert server.proc is not None
        assert not [c for c in children(server.proc.pid) if b"engine_core" in cmdline(c)]
        answer = client(server).completions.create(
            model="tiny", prompt=[1, 2, 3], max_tokens=6, temperature=0.0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert answer.choices[0].text == decode(folder, reference_generate(folder, [1, 2, 3], 6))
    finally:
        server.stop()
