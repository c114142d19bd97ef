"""``kiln optimize``: its flags, parsed into :class:`OptimizeOptions`; the outcome printed."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kiln.optimize.types import Objective, OptimizeError, OptimizeOptions

if TYPE_CHECKING:
    from kiln.optimize.pipeline import Outcome

EXIT_UNMET = 2  # ran fine, but no candidate met the constraints


def _batch_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise click.BadParameter(f"'{text}' is not a comma-separated list of positive integers")
    return sizes


def optimize_options(f: Any) -> Any:
    opts = [
        click.argument("model"),
        click.option("--calibration-data", required=True, help=".npy/.npz file or folder."),
        click.option("--validation-data", required=True, help=".npy/.npz file or folder."),
        click.option("--labels", default=None, help="Class labels (.npy) for the validation data."),
        click.option("--max-accuracy-drop", default=0.01, type=click.FloatRange(min=0)),
        click.option("--latency-budget-ms", default=None, type=click.FloatRange(min=0)),
        click.option(
            "--objective", type=click.Choice(["latency", "throughput"]), default="latency"
        ),
        click.option("--batch-sizes", default="1,8,32", help="Profiled batch sizes, e.g. 1,8,32."),
        click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu"),
        click.option(
            "--output-repository", required=True, type=click.Path(file_okay=False, path_type=Path)
        ),
        click.option("--name", default=None, help="Model name in the repository [MODEL's stem]."),
        click.option(
            "--input-shape",
            "input_shapes",
            multiple=True,
            metavar="NAME:1,D1,...",
            help="PyTorch models: an example input (float32, batch first); repeat.",
        ),
        click.option(
            "--candidates",
            default="",
            help="Only candidates matching these comma-separated globs (int8-static-*).",
        ),
        click.option(
            "--profile-seconds",
            default=0.25,
            type=click.FloatRange(min=0.01),
            help="Timing window per candidate and batch size, over all rounds.",
        ),
        click.option(
            "--profile-rounds",
            default=5,
            type=click.IntRange(min=1),
            help="Interleaved rounds of the window; baseline and candidates alternate [5].",
        ),
        click.option(
            "--threads",
            default=1,
            type=click.IntRange(min=1),
            help="ONNX Runtime intra-op threads, when profiling and in config.pbtxt.",
        ),
        click.option(
            "--keep-io-types/--no-keep-io-types",
            default=True,
            help="FP16 candidates keep float32 inputs and outputs [keep].",
        ),
        click.option(
            "--no-tune-serving",
            is_flag=True,
            help="Do not search instance count / dynamic batching for the chosen candidate.",
        ),
        click.option(
            "--tune-seconds",
            default=0.5,
            type=click.FloatRange(min=0.01),
            help="Closed-loop load per serving config when tuning.",
        ),
        click.option(
            "--tune-concurrency",
            default=None,
            type=click.IntRange(min=1),
            help="Concurrent in-process callers when tuning [largest --batch-sizes].",
        ),
        click.option("--no-progress", is_flag=True, help="No progress bar."),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _options(
    *,
    model: str,
    calibration_data: str,
    validation_data: str,
    labels: str | None,
    max_accuracy_drop: float,
    latency_budget_ms: float | None,
    objective: Objective,
    batch_sizes: str,
    device: str,
    output_repository: Path,
    name: str | None,
    input_shapes: tuple[str, ...],
    candidates: str,
    profile_seconds: float,
    profile_rounds: int,
    threads: int,
    keep_io_types: bool,
    no_tune_serving: bool,
    tune_seconds: float,
    tune_concurrency: int | None,
    no_progress: bool,
) -> OptimizeOptions:
    """The flags (one keyword each) as ``OptimizeOptions``; raises OptimizeError for a bad
    --input-shape and click.BadParameter for bad --batch-sizes."""
    from kiln.optimize.export import parse_input_shape

    shapes = dict(parse_input_shape(s) for s in input_shapes)
    return OptimizeOptions(
        model=model,
        calibration_data=calibration_data,
        validation_data=validation_data,
        output_repository=output_repository,
        labels=labels,
        name=name,
        max_accuracy_drop=max_accuracy_drop,
        latency_budget_ms=latency_budget_ms,
        objective=objective,
        batch_sizes=_batch_sizes(batch_sizes),
        device=device,
        input_shapes=shapes,
        candidates=tuple(c.strip() for c in candidates.split(",") if c.strip()),
        profile_seconds=profile_seconds,
        profile_rounds=profile_rounds,
        threads=threads,
        progress=not no_progress and sys.stderr.isatty(),
        keep_io_types=keep_io_types,
        tune_serving=not no_tune_serving,
        tune_seconds=tune_seconds,
        tune_concurrency=tune_concurrency,
    )


def _print_outcome(outcome: Outcome) -> None:
    """The chosen candidate and where it was written; exit 2 when none met the constraints."""
    report = outcome.report
    click.echo(f"report: {outcome.model_dir / 'report.md'}")
    if outcome.chosen is None:
        click.echo(f"no candidate met the constraints: {report['why']}", err=True)
        if report["closest"]:
            click.echo(f"closest: {report['closest']}", err=True)
        sys.exit(EXIT_UNMET)
    click.echo(f"chosen: {outcome.chosen} ({report['why']})")
    click.echo(f"model repository entry: {outcome.model_dir}")
    serving = report["serving"]
    if serving["tuned"]:
        click.echo(f"serving config: {serving['chosen']['label']} ({serving['why']})")


@click.command(context_settings={"show_default": True})
@optimize_options
def optimize(**params: Any) -> None:
    """Build, check, profile and pick the fastest accurate deployment of MODEL.

    MODEL is an ONNX file, a TorchScript file, or a PyTorch module:factory reference
    (with --input-shape). Writes REPO/NAME/{config.pbtxt,1/model.onnx} and report.{json,md,html};
    exits 2 when no candidate meets the constraints.
    """
    from kiln.optimize.pipeline import optimize as run

    try:
        outcome = run(_options(**params))
    except OptimizeError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(1)
    _print_outcome(outcome)
