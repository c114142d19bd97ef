"""The ``kiln`` group: one module per command, every help page reachable."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kiln.cli import main


def _paths(command: click.Command, path: list[str]) -> Iterator[list[str]]:
    yield path
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from _paths(sub, [*path, name])


def test_the_group_has_one_command_per_module() -> None:
    assert sorted(main.commands) == ["bench", "monitor", "optimize", "repo", "serve", "trace"]
    for name, command in main.commands.items():
        assert command.callback is not None
        assert command.callback.__module__ == f"kiln.cli.{name}"


@pytest.mark.parametrize("path", list(_paths(main, [])), ids=" ".join)
def test_every_help_page_exits_0(path: list[str]) -> None:
    for flag in ("--help", "-h"):  # -h is inherited from the group's context settings
        result = CliRunner().invoke(main, [*path, flag], prog_name="kiln")
        assert result.exit_code == 0, result.output
        assert result.output.startswith(f"Usage: kiln {' '.join(path)}".replace("  ", " "))


def test_python_m_kiln_is_the_same_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kiln", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "kiln, version 0.1.0"


def test_optimize_is_a_function_of_an_ordinary_package() -> None:
    import types

    import kiln.optimize
    from kiln.optimize import optimize

    assert isinstance(optimize, types.FunctionType)
    assert type(kiln.optimize) is types.ModuleType  # no longer made callable


def test_serve_reads_vllms_command_line(tmp_path: Path) -> None:
    """``kiln serve MODEL --port N`` as ``vllm serve MODEL --port N``: the positional
    checkpoints are served before the --model ones."""
    from kiln.cli.serve import serve

    first, second = tmp_path / "a.gguf", tmp_path / "b"
    first.write_bytes(b"")
    second.mkdir()
    ctx = serve.make_context("serve", [str(first), "--port", "9123", "--model", str(second)])
    assert ctx.params["http_port"] == 9123
    assert ctx.params["model_paths"] == (first,) and ctx.params["models"] == (second,)
    ctx = serve.make_context("serve", ["--model", str(second)])
    assert ctx.params["http_port"] == 8000 and ctx.params["model_paths"] == ()
    with pytest.raises(click.BadParameter):
        serve.make_context("serve", [str(tmp_path / "missing")])
    # vLLM's operational flags that have nothing to change in kiln are accepted
    flags = ["--disable-log-requests", "--disable-log-stats", "--trust-remote-code",
             "--enable-chunked-prefill"]  # fmt: skip
    ctx = serve.make_context("serve", [str(first), *flags])
    assert not set(ctx.params) & {"disable_log_requests", "disable_log_stats",
                                  "enable_chunked_prefill"}  # fmt: skip
    # and vLLM's engine flags kiln has, with vLLM's names
    engine = ["--seed", "3", "--max-logprobs", "-1", "--stream-interval", "4"]
    ctx = serve.make_context("serve", [str(first), *engine])
    assert (ctx.params["seed"], ctx.params["max_logprobs"], ctx.params["stream_interval"]) == (
        3, -1, 4,
    )  # fmt: skip
