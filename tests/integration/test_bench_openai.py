"""``kiln bench --openai`` as a user runs it, against a ``kiln serve`` with a tiny random
Llama. What it reports is checked against what it sent and against the server's own token
counters on ``/metrics``."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("httpx")

from kiln.bench import BenchError
from kiln.bench.llm_dataset import Endpoint, random_prompts
from kiln.bench.openai import run
from tests.conftest import KilnProcess, free_port
from tests.llm_models import VOCAB, tiny_llm_repository

CONFIG = """
name: "tiny"
backend: "llm"
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "max_num_seqs" value { string_value: "4" } }
parameters { key: "num_gpu_blocks" value { string_value: "128" } }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """A server only this module talks to, so counter deltas are ours alone."""
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm-bench"), CONFIG)
    proc = KilnProcess(repo, args=["--no-history"]).start(timeout=120)
    yield proc
    proc.stop()


def counters(server: KilnProcess) -> dict[str, float]:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            if line.startswith(name + "{") and 'model_name="tiny"' in line:
                out[name] = float(line.rsplit(" ", 1)[1])
    assert len(out) == 2, text
    return out


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln", "bench", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_cli_report_matches_requests_and_server_counters(
    server: KilnProcess, tmp_path: Path
) -> None:
    before = counters(server)
    out = tmp_path / "r"
    done = bench(
        "--openai", f"http://{server.http_url}/v1", "--model", "tiny", "--num-prompts", "6",
        "--input-len", "10", "--output-len", "6", "--range-ratio", "0.5", "--vocab-size",
        str(VOCAB), "--max-concurrency", "3", "--ignore-eos", "--seed", "7",
        "--json", f"{out}.json", "--csv", f"{out}.csv", "--plot", f"{out}.png",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "Output token throughput" in done.stdout and "Time to first token" in done.stdout
    doc = json.loads(Path(f"{out}.json").read_text())
    after = counters(server)
    planned = random_prompts(Endpoint.COMPLETIONS, 6, 10, 6, 0.5, VOCAB, 7)
    assert doc["model"] == "tiny" and doc["endpoint"] == "completions"
    assert (doc["completed"], doc["failed"]) == (6, 0)
    assert doc["settings"]["max_concurrency"] == 3 and doc["settings"]["request_rate"] == "inf"
    # ignore_eos: every request produced exactly the max_tokens it asked for, and the
    # prompts were the token ids sent
    reqs = sorted(doc["requests"], key=lambda r: r["index"])
    assert [r["output_tokens"] for r in reqs] == [p.max_tokens for p in planned]
    assert [r["prompt_tokens"] for r in reqs] == [p.prompt_len for p in planned]
    assert all(r["usage"] and r["finish_reason"] == "length" for r in reqs)
    assert doc["total_output_tokens"] == sum(p.max_tokens for p in planned)
    assert doc["total_input_tokens"] == sum(p.prompt_len for p in planned)
    # the server counted the same tokens, plus the one warm-up request
    warm = doc["warmup"]
    assert warm["output_tokens"] == 1
    gen = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    prompt = after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"]
    assert gen == doc["total_output_tokens"] + warm["output_tokens"]
    assert prompt == doc["total_input_tokens"] + warm["prompt_tokens"]
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        stats = doc[metric]
        assert set(stats) == {"mean", "p50", "p99"}
        assert 0 < stats["p50"] <= stats["p99"]
    assert doc["e2el_ms"]["mean"] >= doc["ttft_ms"]["mean"]
    assert doc["output_throughput"] > 0 and doc["request_throughput"] > 0
    assert doc["total_token_throughput"] > doc["output_throughput"]
    rows = list(csv.reader(Path(f"{out}.csv").read_text().splitlines()))
    assert rows[0][:3] == ["index", "prompt_tokens", "output_tokens"] and len(rows) == 7
    assert Path(f"{out}.png").read_bytes()[:4] == b"\x89PNG"


def test_chat_at_a_poisson_rate_from_python(server: KilnProcess) -> None:
    result = run(url=server.http_url, endpoint=Endpoint.CHAT, num_prompts=4, input_len=5,
                 output_len=4, request_rate=50.0, ignore_eos=True)  # fmt: skip
    assert result.model == "tiny"  # the first model the server lists
    assert (result.completed, result.failed) == (4, 0)
    assert result.total_output_tokens == 16
    assert all(r.usage and r.ttft > 0 for r in result.results)


def test_jsonl_dataset_and_a_failing_request(server: KilnProcess, tmp_path: Path) -> None:
    data = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello world", "max_tokens": 3}, {"prompt": [5, 6, 7]},
             {"prompt": "x " * 400, "max_tokens": 2}]  # fmt: skip
    data.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    out = tmp_path / "r.json"
    done = bench("--openai", server.http_url, "--dataset", str(data), "--output-len", "2",
                 "--ignore-eos", "--json", str(out))  # fmt: skip
    assert done.returncode == 1, done.stderr  # a failed request fails the command
    doc = json.loads(out.read_text())
    assert (doc["completed"], doc["failed"]) == (2, 1)
    assert doc["total_output_tokens"] == 3 + 2
    (message,) = doc["errors"]
    assert message.startswith("HTTP 400:") and "maximum context length" in message
    assert "1 failed" in done.stdout


def test_unreachable_server_is_a_clear_error() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = bench("--openai", url, "--num-prompts", "1")
    assert done.returncode == 2
    assert f"cannot reach the OpenAI-compatible server at {url}" in done.stderr
    with pytest.raises(BenchError, match="cannot reach"):
        run(url=url, num_prompts=1)


def test_unknown_model_is_a_clear_error(server: KilnProcess) -> None:
    done = bench("--openai", server.http_url, "--model", "nope", "--num-prompts", "1")
    assert done.returncode == 2
    assert "model 'nope' is not served" in done.stderr and "it serves: tiny" in done.stderr


def test_a_prompt_the_server_refuses_fails_the_warm_up(server: KilnProcess) -> None:
    done = bench("--openai", server.http_url, "--input-len", "400", "--num-prompts", "2",
                 "--vocab-size", str(VOCAB))  # fmt: skip
    assert done.returncode == 2
    assert "warm-up request" in done.stderr and "maximum context length" in done.stderr


def test_extra_body_reaches_the_server(server: KilnProcess, tmp_path: Path) -> None:
    """A structured-output benchmark: the schema in --extra-body is what the server applies
    (a schema it cannot compile fails the warm-up with the server's own message)."""
    base = ["--openai", server.http_url, "--endpoint", "chat", "--num-prompts", "3",
            "--output-len", "24", "--input-len", "4"]  # fmt: skip
    bad = {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
        }
    }
    done = bench(*base, "--extra-body", json.dumps(bad))
    assert done.returncode == 2 and "warm-up request" in done.stderr, done.stderr
    assert "HTTP 400" in done.stderr and "response_format" in done.stderr
    good = {"response_format": {"type": "json_object"}}
    out = tmp_path / "r.json"
    done = bench(*base, "--extra-body", json.dumps(good), "--json", str(out))
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert doc["settings"]["extra_body"] == good and doc["completed"] == 3


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--openai", "localhost:1", "--concurrency", "4"],
            "--concurrency: not used with --openai",
        ),
        (["mlp", "--max-concurrency", "4"], "--max-concurrency: not used without --openai"),
        (["--openai", "localhost:1", "--request-rate", "fast"], "not a number or 'inf'"),
        (["--openai", "localhost:1", "--range-ratio", "1.5"], "--range-ratio"),
        (["--openai", "localhost:1", "--extra-body", "{nope"], "--extra-body"),
        (["--openai", "localhost:1", "--extra-body", "[1]"], "must be a JSON object"),
        (["mlp", "--extra-body", "{}"], "--extra-body: not used without --openai"),
    ],
)
def test_misused_flags_are_usage_errors(args: list[str], message: str) -> None:
    done = bench(*args)
    assert done.returncode == 2
    assert message in done.stderr
