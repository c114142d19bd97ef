"""``kiln serve --model ... --tensor-parallel-size 2`` on the CPU (gloo, one worker
process), answered through the real ``openai`` client; a killed worker fails the request
naming the model and the repository API reloads it; no worker outlives its server."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import psutil
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


def _ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    return ids


def _text(folder: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids)
    return text


def _serve(folder: Path, tmp_path: Path, *extra: str) -> KilnProcess:
    args = ["--model", str(folder), "--served-model-name", "tiny", "--tensor-parallel-size", "2"]
    args += ["--dtype", "float32", "--kv-cache-memory", "1M", "--block-size", "4", *extra]
    return KilnProcess(tmp_path / "repo", args=args, with_repository=False)


def _workers(proc: KilnProcess) -> list[psutil.Process]:
    assert proc.proc is not None
    found = []
    for child in psutil.Process(proc.proc.pid).children(recursive=True):
        try:  # a dead child not yet reaped is a zombie, without a command line
            if "kiln.llm.parallel.worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def _dead(p: psutil.Process) -> bool:
    try:  # a zombie has exited; its parent reaps it when it next looks
        return p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _gone(procs: list[psutil.Process], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while not all(_dead(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return all(_dead(p) for p in procs)


def test_two_ranks_answer_the_openai_client_and_a_dead_worker_is_reloaded(
    folder: Path, tmp_path: Path
) -> None:
    import requests

    proc = _serve(folder, tmp_path, "--model-control-mode", "explicit").start(timeout=180)
    try:
        base = f"http://{proc.http_url}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        expected = _text(folder, reference_generate(folder, _ids(folder, PROMPT), 8))
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
        # two prompts in one engine batch, each as transformers alone would answer it
        both = client.completions.create(
            model="tiny", prompt=[PROMPT, "hello world"], max_tokens=6, temperature=0
        )
        other = _text(folder, reference_generate(folder, _ids(folder, "hello world"), 6))
        assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == [
            _text(folder, reference_generate(folder, _ids(folder, PROMPT), 6)),
            other,
        ]
        (worker,) = _workers(proc)
        assert "tensor parallel over 2 ranks (gloo)" in proc.log()

        worker.send_signal(signal.SIGKILL)
        assert _gone([worker])
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4)
        assert "model 'tiny'" in info.value.message
        assert "tensor-parallel worker rank 1 of 2 was killed by signal 9" in info.value.message

        url = f"{base}/v2/repository/models/tiny"
        assert requests.post(f"{url}/unload", json={}, timeout=60).status_code == 200
        assert requests.post(f"{url}/load", json={}, timeout=180).status_code == 200
        (fresh,) = _workers(proc)
        assert fresh.pid != worker.pid
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == expected
    finally:
        workers = _workers(proc)
        proc.stop()
    assert _gone(workers)  # a graceful stop leaves no worker behind


def test_a_killed_server_leaves_no_worker(folder: Path, tmp_path: Path) -> None:
    proc = _serve(folder, tmp_path).start(timeout=180)
    workers = _workers(proc)
    assert len(workers) == 1
    proc.stop(signal.SIGKILL)  # no shutdown code runs: the worker reads end-of-file
    assert _gone(workers)


def test_heads_not_divisible_are_refused_at_load(folder: Path, tmp_path: Path) -> None:
    proc = _serve(folder, tmp_path, "-tp", "3").start(wait_ready=False)
    try:
        deadline = time.monotonic() + 120
        reason = "model 'tiny': tensor_parallel_size 3: num_attention_heads 4 is not divisible by 3"
        while reason not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert reason in proc.log()
        assert not _workers(proc)
        # kiln serve --model exits on a checkpoint that cannot load (--exit-on-error)
        assert proc.proc is not None and proc.proc.wait(timeout=60) == 1
        assert "failed to load all models: 'tiny'" in proc.log()
    finally:
        proc.stop()
