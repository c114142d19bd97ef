"""A frontend reaches a model only through core (``Server.infer`` / ``Server.llm_engine``),
never through a runtime's scheduler instances or a backend's engine (ARCHITECTURE.md,
"Layers"). The ``vllm:*`` collector reads the engines through core too."""

from __future__ import annotations

import ast
from pathlib import Path

import kiln

SRC = Path(kiln.__file__).parent
CHECKED = [*sorted((SRC / "frontends").rglob("*.py")), SRC / "llm" / "metrics.py"]
FORBIDDEN_TEXT = ("scheduler.instances", ".backend.engine", ".async_engine")
FORBIDDEN_ATTRS = {"instances", "async_engine"}


def _offences(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"{path.name}: '{s}'" for s in FORBIDDEN_TEXT if s in text]
    for node in ast.walk(ast.parse(text)):
        # x.instances, and getattr(x, "instances") which the text check would not see
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_ATTRS:
            found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "getattr"
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in FORBIDDEN_ATTRS
        ):
            found.append(f"{path.name}:{node.lineno}: getattr(..., {node.args[1].value!r})")
    return found


def test_the_checked_modules_exist() -> None:
    assert len(CHECKED) > 10 and all(p.is_file() for p in CHECKED)
    openai = SRC / "frontends" / "openai"
    routes = ("routes", "endpoint", "preparation", "answers", "completion_routes",
              "response_routes", "pooling_routes", "token_routes")  # fmt: skip
    assert all(openai / f"{name}.py" in CHECKED for name in routes)


def test_no_frontend_walks_scheduler_instances_or_touches_an_engine() -> None:
    offences = [o for path in CHECKED for o in _offences(path)]
    assert offences == []


def test_the_check_sees_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(rt):\n"
        "    for i in getattr(rt.scheduler, 'instances', ()):\n"
        "        return i.backend.engine\n"
    )
    assert len(_offences(bad)) == 2
