"""``kiln repo``: model repository tools."""

from __future__ import annotations

import json
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


@repo.command("rollout")
@click.argument("url")
@click.argument("model")
@click.argument("fields", nargs=-1)
@click.option("--clear", is_flag=True, help="Remove the model's rollout policy.")
@click.option("--api-key", envvar="KILN_API_KEY", default=None, help="For --api-key servers.")
def repo_rollout(
    url: str, model: str, fields: tuple[str, ...], clear: bool, api_key: str | None
) -> None:
    """Show a served model's rollout, or replace its policy with FIELD=VALUE pairs
    (traffic_split=1:90,2:10 shadow=3:0.5 canary=2 steps=1,10,50,100 ...; docs/rollouts.md)."""
    import urllib.error
    import urllib.request

    body: dict[str, str] = {}
    for f in fields:
        key, sep, value = f.partition("=")
        if not sep:
            raise click.BadParameter(f"'{f}' is not FIELD=VALUE", param_hint="FIELDS")
        body[key] = value
    base = url if "://" in url else "http://" + url
    request = urllib.request.Request(
        f"{base.rstrip('/')}/v2/repository/models/{model}/rollout",
        data=json.dumps(body).encode() if body or clear else None,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            click.echo(json.dumps(json.loads(resp.read() or b"{}"), indent=2))
    except urllib.error.HTTPError as exc:
        raise click.ClickException(f"{exc.code}: {exc.read().decode(errors='replace')}") from None
    except OSError as exc:
        raise click.ClickException(f"{base}: {exc}") from None
