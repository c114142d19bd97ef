"""``kiln serve --model ... --speculative-config`` with a random-weight LLM, driven by the
real ``openai`` client: the greedy text is the one served without speculation, and vLLM's
``vllm:spec_decode_*`` counters count the drafts verified and accepted."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

NGRAM = (
    '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,'
    ' "prompt_lookup_min": 1}'
)
PROMPT = "the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the"
BODY = {"ignore_eos": True}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, KilnProcess]]:
    home = tmp_path_factory.mktemp("spec")
    folder = build_tiny_llm(home / "tiny")
    args = ["--model", str(folder), "--dtype", "float32", "--kv-cache-memory", "1M"]
    procs = {
        "plain": KilnProcess(home / "plain", args=args, with_repository=False),
        "ngram": KilnProcess(
            home / "ngram", args=[*args, "--speculative-config", NGRAM], with_repository=False
        ),
    }
    try:
        for proc in procs.values():
            proc.start(timeout=120)
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _client(proc: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="unused", max_retries=0)


def _spec_families(proc: KilnProcess) -> dict[str, Any]:
    text = urllib.request.urlopen(proc.metrics_url, timeout=10).read().decode()
    return {
        f.name: f
        for f in text_string_to_metric_families(text)
        if f.name.startswith("vllm:spec_decode")
    }


def _total(families: dict[str, Any], family: str, **labels: str) -> float:
    samples = [
        s.value
        for s in families[family].samples
        if s.name == family + "_total" and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(samples) == 1, (family, labels, samples)
    return float(samples[0])


def test_greedy_text_is_the_same_and_the_counters_count(
    servers: dict[str, KilnProcess],
) -> None:
    texts = {}
    for name, proc in servers.items():
        done = _client(proc).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=48, temperature=0, extra_body=BODY
        )
        assert done.usage is not None and done.usage.completion_tokens == 48
        texts[name] = done.choices[0].text
    assert texts["ngram"] == texts["plain"]
    # vLLM shows no spec_decode family without speculative decoding
    assert _spec_families(servers["plain"]) == {}
    families = _spec_families(servers["ngram"])
    assert {f.type for f in families.values()} == {"counter"}
    assert set(families) == {
        "vllm:spec_decode_num_drafts",
        "vllm:spec_decode_num_draft_tokens",
        "vllm:spec_decode_num_accepted_tokens",
        "vllm:spec_decode_num_accepted_tokens_per_pos",
    }
    labels = {"model_name": "tiny", "engine": "0"}
    drafts = _total(families, "vllm:spec_decode_num_drafts", **labels)
    tokens = _total(families, "vllm:spec_decode_num_draft_tokens", **labels)
    accepted = _total(families, "vllm:spec_decode_num_accepted_tokens", **labels)
    per_pos = [
        _total(families, "vllm:spec_decode_num_accepted_tokens_per_pos", position=str(p))
        for p in range(3)
    ]
    assert drafts > 0 and 0 < accepted <= tokens <= 3 * drafts
    assert sum(per_pos) == accepted
    # each step that verified drafts emitted its accepted drafts and one more token, the
    # prefill step one: 48 tokens in all
    assert drafts + accepted <= 48 - 1
