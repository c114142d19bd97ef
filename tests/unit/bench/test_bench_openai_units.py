"""``kiln bench --openai`` without a server: prompts, arrivals, URL handling, the summary."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kiln.bench.llm_dataset import Endpoint, load_jsonl, random_prompts
from kiln.bench.llm_stats import LLMBenchResult, RequestResult
from kiln.bench.openai import OpenAIBenchOptions, arrival_gaps, base_url, request_body
from kiln.bench.options import BenchError


def test_random_prompts_are_seeded_token_ids_within_the_spread() -> None:
    a = random_prompts(Endpoint.COMPLETIONS, 200, 100, 50, 0.5, 300, seed=3)
    assert a == random_prompts(Endpoint.COMPLETIONS, 200, 100, 50, 0.5, 300, seed=3)
    assert a != random_prompts(Endpoint.COMPLETIONS, 200, 100, 50, 0.5, 300, seed=4)
    for p in a:
        assert isinstance(p.prompt, list) and len(p.prompt) == p.prompt_len
        assert 50 <= p.prompt_len <= 150 and 25 <= p.max_tokens <= 75
        assert all(0 <= t < 300 for t in p.prompt)
    # the spread is used, not just its middle
    assert min(p.prompt_len for p in a) < 70 and max(p.prompt_len for p in a) > 130


def test_range_ratio_zero_gives_exact_lengths_and_chat_gives_words() -> None:
    exact = random_prompts(Endpoint.COMPLETIONS, 5, 7, 3, 0.0, 256, seed=0)
    assert {(p.prompt_len, p.max_tokens) for p in exact} == {(7, 3)}
    chat = random_prompts(Endpoint.CHAT, 3, 12, 4, 0.0, 256, seed=0)
    assert all(isinstance(p.prompt, str) and len(p.prompt.split()) == 12 for p in chat)


@pytest.mark.parametrize(
    ("args", "message"),
    [((0, 5, 0.0, 256), "--input-len"), ((5, 5, 1.0, 256), "--range-ratio"),
     ((5, 5, 0.0, 0), "--vocab-size")],
)  # fmt: skip
def test_random_prompt_settings_are_checked(
    args: tuple[int, int, float, int], message: str
) -> None:
    with pytest.raises(BenchError, match=message):
        random_prompts(Endpoint.COMPLETIONS, 1, *args, seed=0)


def test_jsonl_lines_become_prompts(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "hi there", "max_tokens": 9}\n\n{"prompt": [1, 2, 3]}\n'
                    '{"prompt": "third"}\n')  # fmt: skip
    prompts = load_jsonl(path, Endpoint.COMPLETIONS, 2, output_len=4)
    assert [(p.prompt, p.max_tokens, p.prompt_len) for p in prompts] == [
        ("hi there", 9, 0),
        ([1, 2, 3], 4, 3),
    ]
    assert len(load_jsonl(path, Endpoint.COMPLETIONS, 100, output_len=4)) == 3


@pytest.mark.parametrize(
    ("text", "endpoint", "message"),
    [
        ('{"prompt": "a"}\nnot json\n', Endpoint.COMPLETIONS, r"p.jsonl:2: not valid JSON"),
        ('{"max_tokens": 3}\n', Endpoint.COMPLETIONS, r"p.jsonl:1: 'prompt' must be"),
        ('{"prompt": "a", "max_tokens": 0}\n', Endpoint.COMPLETIONS, r":1: 'max_tokens' must"),
        ('{"prompt": [1, 2]}\n', Endpoint.CHAT, r":1: token-id prompts need --endpoint"),
        ("[1, 2]\n", Endpoint.COMPLETIONS, r":1: expected an object"),
        ("\n", Endpoint.COMPLETIONS, r"no prompts in the file"),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path: Path, text: str, endpoint: Endpoint,
                                  message: str) -> None:  # fmt: skip
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(BenchError, match=message):
        load_jsonl(path, endpoint, 10, output_len=4)


def test_missing_dataset_file(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="No such file"):
        load_jsonl(tmp_path / "absent.jsonl", Endpoint.COMPLETIONS, 1, 1)


@pytest.mark.parametrize(
    ("given", "expected"),
    [("localhost:8000", "http://localhost:8000"), ("http://h:1/v1/", "http://h:1"),
     ("https://h/v1", "https://h")],
)  # fmt: skip
def test_base_url(given: str, expected: str) -> None:
    assert base_url(given) == expected


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_prompts": 0}, "--num-prompts"), ({"request_rate": 0.0}, "--request-rate"),
     ({"burstiness": 0.0}, "--burstiness"), ({"max_concurrency": 0}, "--max-concurrency"),
     ({"url": " "}, "base URL"),
     ({"extra_body": {"stream": False, "model": "x"}}, "--extra-body: model, stream")],
)  # fmt: skip
def test_options_are_checked(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(BenchError, match=message):
        OpenAIBenchOptions(**{"url": "localhost:8000", **kwargs})  # type: ignore[arg-type]


def test_request_bodies_stream_with_usage() -> None:
    opts = OpenAIBenchOptions("h:1", ignore_eos=True, endpoint=Endpoint.CHAT)
    (p,) = random_prompts(Endpoint.CHAT, 1, 3, 2, 0.0, 256, seed=0)
    body = request_body(opts, "m", p)
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 2
    assert body["messages"] == [{"role": "user", "content": p.prompt}]
    plain = request_body(OpenAIBenchOptions("h:1"), "m", p)
    assert "ignore_eos" not in plain and plain["prompt"] == p.prompt


def test_extra_body_is_merged_into_every_request() -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    opts = OpenAIBenchOptions("h:1", endpoint=Endpoint.CHAT, extra_body={"response_format": schema,
                              "max_tokens": 7})  # fmt: skip
    (p,) = random_prompts(Endpoint.CHAT, 1, 3, 2, 0.0, 256, seed=0)
    body = request_body(opts, "m", p)
    assert body["response_format"] == schema and body["max_tokens"] == 7
    assert opts.settings()["extra_body"] == {"response_format": schema, "max_tokens": 7}


def test_arrivals() -> None:
    assert arrival_gaps(4, math.inf, 1.0, 0) == [0.0] * 4
    gaps = arrival_gaps(20_000, 50.0, 1.0, seed=1)
    assert gaps == arrival_gaps(20_000, 50.0, 1.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 50, rel=0.05)
    # a Poisson process: exponential gaps, whose standard deviation equals their mean
    mean = sum(gaps) / len(gaps)
    std = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert std == pytest.approx(mean, rel=0.05)
    bursty = arrival_gaps(20_000, 50.0, 0.25, seed=1)
    assert sum(bursty) / len(bursty) == pytest.approx(1 / 50, rel=0.1)


def _req(index: int, ttft: float, latency: float, out: int, itl: list[float],
         error: str | None = None) -> RequestResult:  # fmt: skip
    return RequestResult(index, 0.0, ttft=ttft, latency=latency, itl=itl, prompt_tokens=10,
                         output_tokens=out, usage=True, error=error)  # fmt: skip


def test_summary_follows_vllms_definitions() -> None:
    results = [
        _req(0, 0.1, 1.1, 11, [0.1] * 10),  # tpot (1.1 - 0.1) / 10 = 0.1
        _req(1, 0.3, 0.7, 5, [0.1] * 4),  # tpot 0.1
        _req(2, 0.2, 0.2, 1, []),  # one token: no tpot
        _req(3, 0.0, 0.0, 0, [], error="HTTP 400: no"),
        _req(4, 0.0, 0.0, 0, [], error="HTTP 400: no"),
    ]
    r = LLMBenchResult("u", "m", "completions", "t", 2.0, {}, results)
    assert (r.completed, r.failed) == (3, 2)
    assert (r.total_input_tokens, r.total_output_tokens) == (30, 17)
    assert r.request_throughput == pytest.approx(1.5)
    assert r.output_throughput == pytest.approx(8.5)
    assert r.total_token_throughput == pytest.approx(23.5)
    assert r.latency_ms["ttft"]["mean"] == pytest.approx(200.0)
    assert r.latency_ms["ttft"]["p50"] == pytest.approx(200.0)
    assert r.latency_ms["tpot"] == pytest.approx({"mean": 100.0, "p50": 100.0, "p99": 100.0})
    assert r.latency_ms["itl"]["mean"] == pytest.approx(100.0)
    # linear between ranks, as numpy: 700 + 0.98 * (1100 - 700)
    assert r.latency_ms["e2el"]["p99"] == pytest.approx(1092.0)
    assert r.errors == {"HTTP 400: no": 2}
    doc = r.to_json()
    assert doc["failed"] == 2 and len(doc["requests"]) == 5
    assert doc["requests"][2]["tpot_ms"] is None


def test_summary_of_nothing_is_zeros() -> None:
    r = LLMBenchResult("u", "m", "chat", "t", 0.0, {}, [_req(0, 0, 0, 0, [], error="x")])
    assert r.completed == 0 and r.output_throughput == 0.0
    assert r.latency_ms["ttft"] == {"mean": 0.0, "p50": 0.0, "p99": 0.0}
