"""Alert rules files (YAML, Prometheus's layout): load, validate, report file and line.

    groups:
      - name: kiln
        rules:
          - alert: KilnHighErrorRatio
            expr: sum by (model) (rate(nv_inference_request_failure[5m])) > 0.05
            for: 5m
            keep_firing_for: 1m
            labels: {severity: warning}
            annotations:
              summary: "{{ $labels.model }} fails {{ $value }} requests/s"

Every problem is an ``AlertRulesError`` naming ``file:line`` and the reason, raised before
the server starts: a rules file that half-loads would silently never alert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from kiln.monitoring.promql import Expr, ExprError, is_vector, parse, parse_duration

DEFAULT_RULES = "default_rules.yaml"
_RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
_GROUP_KEYS = {"name", "interval", "rules"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# The template forms kiln renders: {{ $labels.NAME }} and {{ $value }}, optionally piped
# through humanize or printf "%.Nf".
_TEMPLATE = re.compile(r"{{\s*(.*?)\s*}}")
TEMPLATE_EXPR = re.compile(
    r"^\$(?:labels\.(?P<label>[A-Za-z_][A-Za-z0-9_]*)|(?P<value>value))"
    r'(?:\s*\|\s*(?P<pipe>humanize|printf\s+"%\.\d+f"))?$'
)


class AlertRulesError(ValueError):
    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason = path, line, reason


@dataclass(frozen=True, slots=True)
class AlertRule:
    name: str
    expr_text: str
    expr: Expr
    for_s: float = 0.0
    keep_firing_for_s: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    group: str = ""
    source: str = ""  # file:line, for logs and /api/alerts


class _Loader(yaml.SafeLoader):
    """SafeLoader that keeps the node of every mapping, so errors can name a line."""


def _compose(path: str, text: str) -> yaml.Node | None:
    try:
        return yaml.compose(text, Loader=_Loader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise AlertRulesError(path, line, f"invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise AlertRulesError(path, 1, f"invalid YAML: {exc}") from None


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _mapping(path: str, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        raise AlertRulesError(path, _line(node), f"{what} must be a mapping")
    out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
    for k, v in node.value:
        if not isinstance(k, yaml.ScalarNode):
            raise AlertRulesError(path, _line(k), f"{what}: keys must be strings")
        if k.value in out:
            raise AlertRulesError(path, _line(k), f"{what}: duplicate key '{k.value}'")
        out[k.value] = (k, v)
    return out


def _scalar(path: str, node: yaml.Node, what: str) -> str:
    if not isinstance(node, yaml.ScalarNode) or node.value == "":
        raise AlertRulesError(path, _line(node), f"'{what}' must be a non-empty string")
    return str(node.value)


def _string_map(path: str, node: yaml.Node, what: str) -> dict[str, str]:
    return {k: _scalar(path, v, f"{what}.{k}") for k, (_, v) in _mapping(path, node, what).items()}


def _duration(path: str, node: yaml.Node, what: str) -> float:
    text = _scalar(path, node, what)
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise AlertRulesError(path, _line(node), f"'{what}': {exc}") from None


def _check_templates(path: str, node: yaml.Node, text: str, what: str) -> None:
    for m in _TEMPLATE.finditer(text):
        if not TEMPLATE_EXPR.match(m.group(1)):
            raise AlertRulesError(
                path,
                _line(node),
                f"{what}: unsupported template '{{{{ {m.group(1)} }}}}' "
                '(supported: $labels.NAME, $value, | humanize, | printf "%.2f")',
            )


def _rule(path: str, node: yaml.Node, group: str) -> AlertRule:
    fields = _mapping(path, node, "rule")
    for key, (knode, _) in fields.items():
        if key not in _RULE_KEYS:
            if key == "record":
                reason = "recording rules are not supported (only 'alert' rules)"
            else:
                reason = f"unknown rule field '{key}' (known: {', '.join(sorted(_RULE_KEYS))})"
            raise AlertRulesError(path, _line(knode), reason)
    for key in ("alert", "expr"):
        if key not in fields:
            raise AlertRulesError(path, _line(node), f"rule is missing '{key}'")
    name_node = fields["alert"][1]
    name = _scalar(path, name_node, "alert")
    if not _NAME.match(name):
        raise AlertRulesError(path, _line(name_node), f"invalid alert name '{name}'")
    expr_node = fields["expr"][1]
    expr_text = _scalar(path, expr_node, "expr")
    try:
        expr = parse(expr_text)
    except ExprError as exc:
        raise AlertRulesError(
            path, _line(expr_node), f"alert '{name}': expr: {exc} (at character {exc.pos + 1})"
        ) from None
    if not is_vector(expr):
        raise AlertRulesError(
            path, _line(expr_node), f"alert '{name}': expr must name a metric (got a constant)"
        )
    values: dict[str, Any] = {}
    for key in ("for", "keep_firing_for"):
        if key in fields:
            values[key] = _duration(path, fields[key][1], key)
    labels = _string_map(path, fields["labels"][1], "labels") if "labels" in fields else {}
    annotations: dict[str, str] = {}
    if "annotations" in fields:
        anode = fields["annotations"][1]
        annotations = _string_map(path, anode, "annotations")
        for key, (_, vnode) in _mapping(path, anode, "annotations").items():
            _check_templates(path, vnode, annotations[key], f"annotations.{key}")
    return AlertRule(
        name,
        expr_text,
        expr,
        values.get("for", 0.0),
        values.get("keep_firing_for", 0.0),
        labels,
        annotations,
        group,
        f"{path}:{_line(node)}",
    )


def parse_rules(text: str, path: str) -> list[AlertRule]:
    root = _compose(path, text)
    if root is None:
        raise AlertRulesError(path, 1, "empty rules file (expected 'groups:')")
    top = _mapping(path, root, "rules file")
    if "groups" not in top:
        raise AlertRulesError(path, _line(root), "rules file needs a top-level 'groups:' list")
    groups_node = top["groups"][1]
    if not isinstance(groups_node, yaml.SequenceNode):
        raise AlertRulesError(path, _line(groups_node), "'groups' must be a list")
    rules: list[AlertRule] = []
    seen: set[str] = set()
    for gnode in groups_node.value:
        g = _mapping(path, gnode, "group")
        for key, (knode, _) in g.items():
            if key not in _GROUP_KEYS:
                raise AlertRulesError(path, _line(knode), f"unknown group field '{key}'")
        if "name" not in g:
            raise AlertRulesError(path, _line(gnode), "group is missing 'name'")
        gname = _scalar(path, g["name"][1], "name")
        if gname in seen:
            raise AlertRulesError(path, _line(g["name"][1]), f"duplicate group name '{gname}'")
        seen.add(gname)
        rnode = g["rules"][1] if "rules" in g else None
        if rnode is None or not isinstance(rnode, yaml.SequenceNode):
            raise AlertRulesError(path, _line(gnode), f"group '{gname}' needs a 'rules' list")
        rules.extend(_rule(path, r, gname) for r in rnode.value)
    return rules


def load_rules(path: Path) -> list[AlertRule]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise AlertRulesError(str(path), 0, f"cannot read rules file: {exc.strerror}") from None
    return parse_rules(text, str(path))


def default_rules() -> list[AlertRule]:
    text = resources.files("kiln.monitoring").joinpath(DEFAULT_RULES).read_text()
    return parse_rules(text, f"<kiln>/{DEFAULT_RULES}")
