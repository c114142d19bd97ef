"""scripts/package_graph.py: the package graph from the imports, and its cycle check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("package_graph", ROOT / "scripts/package_graph.py")
assert _spec is not None and _spec.loader is not None
package_graph = importlib.util.module_from_spec(_spec)
sys.modules["package_graph"] = package_graph
_spec.loader.exec_module(package_graph)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "src" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "src"


def test_function_level_and_relative_imports_are_edges(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/low/__init__.py": "",
            "pkg/low/types.py": "X = 1\n",
            "pkg/high/__init__.py": "",
            "pkg/high/app.py": "def f():\n    from ..low import types\n    return types.X\n",
            "pkg/tool.py": "import pkg.high.app\n",
        },
    )
    graph, evidence = package_graph.build_graph(src, "pkg")
    assert graph["pkg.high"] == {"pkg.low"}
    assert graph["pkg.tool"] == {"pkg.high"}  # a module directly under the root: its own node
    assert graph["pkg.low"] == set()
    assert evidence[("pkg.high", "pkg.low")] == ("pkg.high.app", "pkg.low.types")


def test_a_cycle_between_packages_fails_and_names_the_imports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/m.py": "from pkg.b.n import Y\n",
            "pkg/b/__init__.py": "",
            "pkg/b/n.py": "Y = 1\n\ndef g():\n    from pkg.a import m\n",
        },
    )
    assert package_graph.main(["--src", str(src), "--root", "pkg"]) == 1
    out = capsys.readouterr().out
    assert "CYCLE: a b" in out
    assert "a -> b: pkg.a.m imports pkg.b.n" in out
    assert "b -> a: pkg.b.n imports pkg.a.m" in out


def test_an_import_the_contract_ignores_is_no_edge(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pyproject.toml's import-linter ``ignore_imports`` (next to src/) drop the same imports
    here, so the cycle check and lint-imports agree."""
    src = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/m.py": "from pkg.b.n import Y\n",
            "pkg/b/__init__.py": "",
            "pkg/b/n.py": "Y = 1\n",
            "pkg/b/view.py": "from pkg.a import m\n",
        },
    )
    (tmp_path / "pyproject.toml").write_text(
        '[[tool.importlinter.contracts]]\nname = "layers"\n'
        'ignore_imports = ["pkg.b.view -> pkg.a.**"]\n'
    )
    assert package_graph.main(["--src", str(src), "--root", "pkg"]) == 0
    out = capsys.readouterr().out
    assert "no cycles between packages" in out
    assert " b                    -> -" in out


def test_a_package_and_its_subpackage_fail_only_when_strict(tmp_path: Path) -> None:
    src = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a/__init__.py": "",
            "pkg/a/ops.py": "Z = 1\n",
            "pkg/a/runner.py": "from pkg.a.sub import model\n",
            "pkg/a/sub/__init__.py": "",
            "pkg/a/sub/model.py": "from pkg.a import ops\n",
        },
    )
    assert package_graph.main(["--src", str(src), "--root", "pkg", "--quiet"]) == 0
    assert package_graph.main(["--src", str(src), "--root", "pkg", "--strict"]) == 1


def test_kiln_has_no_cycle_between_packages() -> None:
    assert package_graph.main(["--src", str(ROOT / "src"), "--quiet"]) == 0
