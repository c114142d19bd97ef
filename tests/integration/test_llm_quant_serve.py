"""``kiln serve --model`` on an AWQ checkpoint with ``--quantization awq --kv-cache-dtype
fp8``, driven by the real ``openai`` client: the greedy completion is ``transformers``'
on the dequantized weights (a mismatched ``--quantization``: test_llm_quant_refusals.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import reference_generate  # noqa: E402
from tests.llm_quant import base_model, write_awq  # noqa: E402

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def awq(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("awq")
    return write_awq(base_model(root / "base"), root)


@pytest.fixture(scope="module")
def server(
    awq: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilnProcess]:
    home = tmp_path_factory.mktemp("home")
    args = ["--model", str(awq[0]), "--served-model-name", "tiny-awq"]
    args += ["--quantization", "awq", "--kv-cache-dtype", "fp8", "--kv-cache-memory", "1M"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=180)
    yield proc
    proc.stop()


def test_awq_with_fp8_cache_serves_the_reference_tokens(
    server: KilnProcess, awq: tuple[Path, Path]
) -> None:
    from tokenizers import Tokenizer

    qdir, rdir = awq
    tok = Tokenizer.from_file(str(qdir / "tokenizer.json"))
    expected = reference_generate(rdir, tok.encode(PROMPT).ids, 8)
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny-awq", prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.choices[0].text == tok.decode(expected)
