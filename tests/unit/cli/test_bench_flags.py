"""``kiln bench``'s flags, as click parses them, become typed ``BenchOptions`` /
``OpenAIBenchOptions``; bad values exit 2 before anything is sent."""

from __future__ import annotations

import math
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kiln.bench.llm_dataset import Endpoint
from kiln.bench.options import BenchError, Distribution, Protocol, Reports
from kiln.cli import main
from kiln.cli.bench import BenchFlags, bench


def flags(*args: str) -> BenchFlags:
    # Under the kiln group, as the command line does (click caches the help option).
    parent = click.Context(main, info_name="kiln", **main.context_settings)
    with bench.make_context("bench", parent=parent, args=list(args)) as ctx:
        return BenchFlags(**ctx.params)


def test_kserve_flags_are_typed_options() -> None:
    parsed = flags(
        "-m", "simple", "-u", "h:9", "-i", "grpc", "--concurrency-range", "2:6:2",
        "--request-distribution", "poisson", "-b", "4", "--shape", "INPUT0:3,2",
        "-p", "500", "--max-trials", "3", "--percentile", "95", "--api-key", "k",
    )  # fmt: skip
    options = parsed.kserve_options(parsed.model_opt or "")
    assert options.model == "simple" and options.url == "h:9"
    assert options.protocol is Protocol.GRPC and options.distribution is Distribution.POISSON
    assert options.concurrency == [2, 4, 6] and options.request_rates == []
    assert options.batch_size == 4 and options.shapes == {"INPUT0": [3, 2]}
    assert options.measurement_interval_ms == 500 and options.max_trials == 3
    assert options.percentile == 95 and options.api_key == "k"


def test_defaults_and_reports(tmp_path: Path) -> None:
    parsed = flags("simple", "--request-rate", "10:30:10", "-f", str(tmp_path / "r.csv"))
    options = parsed.kserve_options("simple")
    assert options.concurrency == [1] and options.request_rates == [10.0, 20.0, 30.0]
    assert options.api_key is None and options.duration_s is None
    assert parsed.reports() == Reports(csv=tmp_path / "r.csv")


def test_concurrency_and_rate_together_are_refused() -> None:
    with pytest.raises(BenchError, match="not both"):
        flags("m", "--concurrency", "1", "--request-rate", "2").kserve_options("m")
    result = CliRunner().invoke(main, ["bench", "m", "--concurrency", "1", "--request-rate", "2"])
    assert result.exit_code == 2 and "error: give either --concurrency-range" in result.output


def test_a_bad_range_names_the_flag() -> None:
    with pytest.raises(click.BadParameter, match="--concurrency"):
        flags("m", "--concurrency", "x").kserve_options("m")


def test_openai_flags_are_typed_options() -> None:
    parsed = flags(
        "--openai", "http://h:8000", "--endpoint", "chat", "--num-prompts", "7",
        "--max-concurrency", "2", "--extra-body", '{"top_k": 5}', "--model", "tiny",
    )  # fmt: skip
    assert parsed.openai_url == "http://h:8000"
    options = parsed.openai_options(parsed.openai_url)
    assert options.model == "tiny" and options.endpoint is Endpoint.CHAT
    assert options.num_prompts == 7 and options.max_concurrency == 2
    assert options.request_rate == math.inf and options.extra_body == {"top_k": 5}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--request-rate", "abc"], "'abc' is not a number or 'inf'"),
        (["--extra-body", "[1]"], "must be a JSON object"),
        (["--extra-body", "{"], "not valid JSON"),
    ],
)
def test_bad_openai_values_name_the_flag(args: list[str], message: str) -> None:
    with pytest.raises(click.BadParameter, match=message):
        flags("--openai", "http://h:1", *args).openai_options("http://h:1")
    result = CliRunner().invoke(main, ["bench", "--openai", "http://127.0.0.1:9", *args])
    assert result.exit_code == 2 and message in result.output
