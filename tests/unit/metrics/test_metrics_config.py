"""``--metrics-config``: Triton's keys and defaults, and a precise error for each bad entry."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main
from kiln.metrics.config import DEFAULT_QUANTILES, MetricsConfig, MetricsConfigError


def test_defaults_match_triton() -> None:
    config = MetricsConfig.parse([])
    assert config.counter_latencies is True
    assert config.summary_latencies is False
    assert config.histogram_latencies is False
    assert config.summary_quantiles == DEFAULT_QUANTILES
    assert [q for q, _ in DEFAULT_QUANTILES] == [0.5, 0.9, 0.95, 0.99, 0.999]


def test_entries_are_parsed() -> None:
    config = MetricsConfig.parse(
        [
            "summary_latencies=true",
            "counter_latencies=False",
            'summary_quantiles="0.99:0.001,0.5:0.05"',
            "histogram_latencies=1",
            "latency_buckets=0.01,0.1,1",
        ]
    )
    assert config.summary_latencies and config.histogram_latencies
    assert not config.counter_latencies
    assert config.summary_quantiles == ((0.5, 0.05), (0.99, 0.001))
    assert config.latency_buckets == (0.01, 0.1, 1.0)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("summary_latencies", "expected KEY=VALUE"),
        ("=true", "expected KEY=VALUE"),
        ("summary_latency=true", "unknown key 'summary_latency' (known keys: counter_latencies"),
        ("summary_latencies=maybe", "summary_latencies=maybe: expected true or false"),
        ("summary_quantiles=0.5", "'0.5' is not <quantile>:<error>"),
        ("summary_quantiles=1.5:0.01", "'1.5:0.01' is not <quantile>:<error>"),
        ("summary_quantiles=0.5:x", "'0.5:x' is not <quantile>:<error>"),
        ("latency_buckets=0.1,0.01", "expected increasing positive numbers"),
        ("latency_buckets=-1,2", "expected increasing positive numbers"),
        ("latency_buckets=a", "expected increasing positive numbers"),
    ],
)
def test_bad_entries_are_refused_with_key_and_reason(entry: str, message: str) -> None:
    with pytest.raises(MetricsConfigError) as info:
        MetricsConfig.parse([entry])
    assert message in str(info.value)


def test_kiln_serve_refuses_a_bad_metrics_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main,
        ["serve", "--model-repository", str(tmp_path), "--metrics-config", "histogram=true"],
    )
    assert result.exit_code == 2
    assert "--metrics-config" in result.output
    assert "unknown key 'histogram'" in result.output


def test_kiln_serve_refuses_a_too_short_metrics_interval(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["serve", "--model-repository", str(tmp_path), "--metrics-interval-ms", "0"]
    )
    assert result.exit_code == 2
    assert "--metrics-interval-ms" in result.output
