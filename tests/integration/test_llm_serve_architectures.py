"""``kiln serve --model`` with the newer architectures: a tiny random Gemma 2 (scores
soft-capped: the portable attention backend) and Qwen3-MoE served to the real ``openai``
client, greedy text identical with ``transformers``; a checkpoint of an architecture kiln
does not run fails its load with a message naming the ones it does."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.llm.config import SUPPORTED_ARCHITECTURES  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

PROMPT = "the quick brown fox"


def _tokens(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    return ids


def _text(folder: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids)
    return text


def test_new_architectures_served_match_transformers(tmp_path: Path) -> None:
    gemma = build_tiny_llm(
        tmp_path / "gemma2", "gemma2", head_dim=16, sliding_window=4, pad_token_id=0
    )
    moe = build_tiny_llm(
        tmp_path / "qwen3-moe", "qwen3_moe", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, head_dim=16,
    )  # fmt: skip
    args = ["--model", str(gemma), "--model", str(moe), "--kv-cache-memory", "1M"]
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=180)
    try:
        client = openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="x", max_retries=0)
        for folder in (gemma, moe):
            expected = reference_generate(folder, _tokens(folder, PROMPT), 8)
            out = client.completions.create(
                model=folder.name, prompt=PROMPT, max_tokens=8, temperature=0
            )
            assert out.choices[0].text == _text(folder, expected), folder.name
    finally:
        proc.stop()


def test_an_unknown_architecture_fails_its_load_naming_the_supported_ones(
    tmp_path: Path,
) -> None:
    folder = build_tiny_llm(tmp_path / "falcon")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    proc = KilnProcess(
        tmp_path / "repo",
        args=["--model", str(folder), "--exit-on-error=false"],
        with_repository=False,
    )
    proc.start(wait_ready=False)
    try:
        proc.wait_ready(timeout=120, path="/v2/health/live")
        deadline = time.monotonic() + 60
        while "failed to load" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        log = proc.log()
        assert "architecture 'FalconForCausalLM' is not supported" in log
        assert f"kiln runs {', '.join(SUPPORTED_ARCHITECTURES)}" in log
        with pytest.raises(urllib.error.HTTPError):  # never ready
            urllib.request.urlopen(f"http://{proc.http_url}/v2/models/falcon/ready", timeout=5)
    finally:
        proc.stop()


def test_serve_model_exits_when_its_checkpoint_fails_to_load(tmp_path: Path) -> None:
    """``kiln serve --model`` is ``vllm serve``: a checkpoint that cannot load ends the
    process with status 1 and the reason, instead of a server that is never ready."""
    folder = build_tiny_llm(tmp_path / "falcon")
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    proc = KilnProcess(tmp_path / "repo", args=["--model", str(folder)], with_repository=False)
    proc.start(wait_ready=False)
    try:
        assert proc.proc is not None
        assert proc.proc.wait(timeout=120) == 1
        log = proc.log()
        assert "failed to load all models: 'falcon'" in log
        assert "architecture 'FalconForCausalLM' is not supported" in log
    finally:
        proc.stop()
