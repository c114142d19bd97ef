"""deploy/: Prometheus config and rules pass promtool; the rules match kiln's defaults;
the Grafana dashboard queries only metrics a real kiln scrape exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kiln.metrics.gpu import FAMILIES as GPU_FAMILIES
from kiln.monitoring.snapshot import KNOWN_METRICS
from tests.conftest import KilnProcess
from tests.integration.monitor_helpers import infer_simple

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DEFAULT_RULES = ROOT / "src" / "kiln" / "monitoring" / "default_rules.yaml"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
GPU_NAMES = {name for _, name, _, _ in GPU_FAMILIES} | {"kiln_gpu_clock_event_active"}
KEYWORDS = {"by", "without", "and", "or", "unless", "on", "ignoring", "bool", "offset"}
PROMETHEUS_OWN = {"up"}  # Prometheus's per-target series, not kiln's


def metric_names(promql: str) -> set[str]:
    """Metric names in a PromQL expression (strings, matchers, ranges and groupings cut)."""
    text = re.sub(r'"[^"]*"', "", promql)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        if text[m.end() :].lstrip().startswith("(") or m.group() in KEYWORDS:
            continue  # a function or aggregation
        names.add(m.group())
    return names


@pytest.fixture(scope="module")
def scraped(kiln_server: KilnProcess) -> set[str]:
    infer_simple(kiln_server, 2)
    with urllib.request.urlopen(kiln_server.metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    families = list(text_string_to_metric_families(text))  # it must parse
    assert families
    # Sample names as written (the client parser would add _total to counters).
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def test_promtool_checks_config_and_rules() -> None:
    config = _promtool("check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS" in config.stdout
    for rules in (DEPLOY / "prometheus" / "kiln-alerts.yml", DEFAULT_RULES):
        out = _promtool("check", "rules", str(rules))
        assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rejects_a_broken_rule(tmp_path: Path) -> None:
    # the check above is only worth something if promtool really parses the PromQL
    broken = tmp_path / "broken.yml"
    broken.write_text("groups: [{name: g, rules: [{alert: A, expr: 'rate(x[5m]'}]}]\n")
    assert _promtool("check", "rules", str(broken)).returncode != 0


def _rules(path: Path) -> dict[str, dict[str, object]]:
    doc = yaml.safe_load(path.read_text())
    return {r["alert"]: r for g in doc["groups"] for r in g["rules"]}


def test_deploy_rules_are_the_defaults_in_promql() -> None:
    deploy, defaults = _rules(DEPLOY / "prometheus" / "kiln-alerts.yml"), _rules(DEFAULT_RULES)
    assert set(defaults) <= set(deploy)
    for name, rule in defaults.items():
        assert deploy[name] == rule, name


def test_rules_name_only_exported_metrics(scraped: set[str]) -> None:
    for rule in _rules(DEPLOY / "prometheus" / "kiln-alerts.yml").values():
        for name in metric_names(str(rule["expr"])) - PROMETHEUS_OWN:
            # vllm:* exist only with an llm model: tests/integration/test_llm_vllm_metrics.py
            known = name in scraped or name in GPU_NAMES or name.startswith("vllm:")
            assert known, (rule["alert"], name)


def test_every_scraped_metric_is_known_to_alert_rules(scraped: set[str]) -> None:
    assert scraped <= KNOWN_METRICS, scraped - KNOWN_METRICS
    assert GPU_NAMES <= KNOWN_METRICS


def test_grafana_dashboard_panels_query_exported_metrics(scraped: set[str]) -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "kiln-dashboard.json").read_text())
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    titles = {p["title"] for p in panels}
    for wanted in ("Throughput", "Latency p50 / p99", "Queue vs compute", "batch size",
                   "GPU utilization", "GPU memory", "GPU temperature", "GPU power", "CPU",
                   "Memory"):  # fmt: skip
        assert any(wanted.lower() in t.lower() for t in titles), wanted
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used: set[str] = set()
    for expr in exprs:
        if expr.startswith("label_values("):  # label_values(selector, label)
            expr = expr[len("label_values(") :].rsplit(",", 1)[0]
        names = metric_names(expr)
        assert names, expr
        used |= names
    # GPU and LLM families exist only with a GPU / an llm model, which this server lacks
    llm = {n for n in KNOWN_METRICS if n.startswith("vllm:")}
    llm |= {f"{n}_bucket" for n in llm}
    unknown = {n for n in used if n not in scraped and n not in GPU_NAMES and n not in llm}
    assert not unknown, unknown
    assert any("vllm:generation_tokens_total" in e for e in exprs)
    assert "kiln_request_duration_seconds_bucket" in used
    assert any("histogram_quantile(0.99" in e for e in exprs)
