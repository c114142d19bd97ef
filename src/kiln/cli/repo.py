"""``kiln repo``: model repository tools."""

from __future__ import annotations

import sys
from pathlib import Path

import click


@click.group()
def repo() -> None:
    """Model repository tools."""


@repo.command("check")
@click.argument("directory", type=click.Path(exists=True, file_okay=False, path_type=Path))
def repo_check(directory: Path) -> None:
    """Validate every config in a model repository; report every problem with file and line."""
    from kiln.config.check import check_repository

    problems = check_repository(directory)
    for p in problems:
        click.echo(str(p), err=True)
    if problems:
        click.echo(f"{len(problems)} problem(s) found", err=True)
        sys.exit(1)
    click.echo(f"{directory}: OK")


@repo.command("example")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
@click.option("--model", "models", multiple=True, help="Only these models (default: all).")
@click.option("--overwrite", is_flag=True, help="Replace existing model folders.")
def repo_example(directory: Path, models: tuple[str, ...], overwrite: bool) -> None:
    """Build the example model repository (simple, simple_string, mlp, cnn,
    simple_sequence*, image_preprocess, postprocess, cnn_pipeline, torch_mlp)."""
    from kiln.examples import build_example_repository
    from kiln.examples.repository import unavailable_examples

    try:
        built = build_example_repository(directory, models or None, overwrite=overwrite)
        skipped = unavailable_examples(models or None)
    except (ValueError, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from exc
    for path in built:
        click.echo(f"built {path}")
    for name, reason in skipped.items():
        click.echo(f"skipped {name} ({reason})")
