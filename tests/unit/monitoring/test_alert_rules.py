"""Rules files: what loads, and every kind of bad input named with file, line and reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.monitoring.rules import AlertRulesError, default_rules, load_rules, parse_rules

GOOD = """\
groups:
  - name: serving
    rules:
      - alert: HighQueue
        expr: nv_inference_pending_request_count > 10
        for: 2m
        keep_firing_for: 30s
        labels: {severity: warning}
        annotations:
          summary: "{{ $labels.model }} has {{ $value }} pending"
"""


def test_good_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(GOOD)
    [rule] = load_rules(path)
    assert (rule.name, rule.for_s, rule.keep_firing_for_s) == ("HighQueue", 120.0, 30.0)
    assert rule.labels == {"severity": "warning"}
    assert rule.group == "serving" and rule.source == f"{path}:4"


def _error(text: str) -> AlertRulesError:
    with pytest.raises(AlertRulesError) as info:
        parse_rules(text, "r.yaml")
    return info.value


def test_unknown_metric_names_file_line_and_metric() -> None:
    err = _error(GOOD.replace("nv_inference_pending_request_count", "nv_pending"))
    assert err.line == 5
    assert str(err).startswith("r.yaml:5: alert 'HighQueue': expr: unknown metric 'nv_pending'")


def test_bad_duration_names_its_line() -> None:
    err = _error(GOOD.replace("keep_firing_for: 30s", "keep_firing_for: 30 seconds"))
    assert err.line == 7
    assert "'keep_firing_for': invalid duration '30 seconds'" in str(err)
    err = _error(GOOD.replace("for: 2m", "for: soon"))
    assert (err.line, err.reason.split(":")[0]) == (6, "'for'")


def test_bad_yaml_names_its_line() -> None:
    err = _error(GOOD.replace("labels: {severity: warning}", "labels: {severity: warning"))
    assert err.line >= 8 and "invalid YAML" in err.reason


@pytest.mark.parametrize(
    ("change", "line", "reason"),
    [
        (("for: 2m", "for: 2m\n        severity: page"), 7, "unknown rule field 'severity'"),
        (("alert: HighQueue", "record: high_queue"), 4, "recording rules are not supported"),
        (("        expr: nv_inference_pending_request_count > 10\n", ""), 4, "missing 'expr'"),
        (("alert: HighQueue", "alert: high-queue"), 4, "invalid alert name 'high-queue'"),
        (("{{ $value }}", "{{ $value | title }}"), 10, "unsupported template"),
        (("nv_inference_pending_request_count > 10", "1 > 0"), 5, "expr must name a metric"),
        (("  - name: serving\n", "  - nam: serving\n"), 2, "unknown group field 'nam'"),
    ],
)
def test_structural_errors(change: tuple[str, str], line: int, reason: str) -> None:
    err = _error(GOOD.replace(*change))
    assert err.line == line and reason in err.reason


def test_top_level_shape() -> None:
    assert "needs a top-level 'groups:'" in str(_error("rules: []\n"))
    assert "empty rules file" in str(_error("\n"))
    assert "'groups' must be a list" in str(_error("groups: {a: 1}\n"))


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(AlertRulesError, match="cannot read rules file"):
        load_rules(tmp_path / "nope.yaml")


def test_default_rules_cover_the_issue() -> None:
    names = {r.name for r in default_rules()}
    assert names == {
        "KilnGpuTemperatureHigh",
        "KilnGpuMemoryNearFull",
        "KilnP99LatencyHigh",
        "KilnQueueTimeRising",
        "KilnErrorRatioHigh",
        "KilnModelNotReady",
        "KilnLLMTimeToFirstTokenHigh",
        "KilnLLMKVCachePressure",
        "KilnLLMPreemptions",
        "KilnLLMWaitingQueueHigh",
    }
    assert all(r.labels.get("severity") and r.annotations.get("summary") for r in default_rules())
