"""``kiln serve --model PATH``: a Hugging Face folder served without a config.pbtxt, with
vLLM's engine flags, driven by the real ``openai`` client."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """No --model-repository at all: the folder alone, under two names, with the flags."""
    home = tmp_path_factory.mktemp("home")
    args = ["--model", str(folder), "--model", str(folder), "--served-model-name", "tiny"]
    args += ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4"]
    args += ["--max-num-batched-tokens", "64", "--kv-cache-memory", "1M", "--block-size", "4"]
    args += ["--no-enable-prefix-caching", "--chat-template", "{{ messages[0]['content'] }}!"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    return ids


def _text(folder: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids)
    return text


def test_each_model_is_served_under_its_name(client: openai.OpenAI) -> None:
    # the first --model takes --served-model-name, the second its folder's name
    assert sorted(m.id for m in client.models.list()) == ["tiny", "tiny-llama"]


def test_greedy_completion_matches_transformers(client: openai.OpenAI, folder: Path) -> None:
    expected = reference_generate(folder, _ids(folder, PROMPT), 8)
    for name in ("tiny", "tiny-llama"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == _text(folder, expected)


def test_flags_reach_the_engine(client: openai.OpenAI, folder: Path) -> None:
    # --max-model-len 128: a request past it is refused naming the limit
    with pytest.raises(openai.BadRequestError, match="128"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200)
    # --chat-template (inline) replaced the tokenizer's: the prompt is the content and "!"
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(_ids(folder, PROMPT + "!"))


def test_default_kv_cache_is_logged(folder: Path, tmp_path: Path) -> None:
    proc = KilnProcess(tmp_path / "repo", args=["--model", str(folder)], with_repository=False)
    proc.start(timeout=120)
    try:
        assert "KV cache of" in proc.log() and "CPU default" in proc.log()
    finally:
        proc.stop()


def _serve_fails(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", *args], capture_output=True, timeout=60
    )
    assert done.returncode != 0
    return done.stderr.decode()


def test_bad_command_lines_are_refused(folder: Path, tmp_path: Path) -> None:
    assert "--model-repository, or --model" in _serve_fails([])
    # engine flags without a --model: they would silently do nothing
    assert "--max-num-seqs" in _serve_fails(
        ["--model-repository", str(tmp_path), "--max-num-seqs", "2"]
    )
    assert "two models named" in _serve_fails(["--model", str(folder), "--model", str(folder)])
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    assert "not a .gguf file" in _serve_fails(["--model", str(text)])
    (tmp_path / "tiny-llama").mkdir()
    assert "also a model of" in _serve_fails(
        ["--model-repository", str(tmp_path), "--model", str(folder)]
    )
