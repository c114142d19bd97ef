"""``kiln optimize``: export, build candidates, guard accuracy, profile, select, deploy, report."""

from __future__ import annotations

import fnmatch
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.optimize import graph, precision
from kiln.optimize.accuracy import compare, task_accuracy, verdict
from kiln.optimize.data import Batch, load_data, load_labels
from kiln.optimize.deploy import write_entry
from kiln.optimize.profile import profile
from kiln.optimize.report import write_reports
from kiln.optimize.select import select
from kiln.optimize.session import check_batch_axis, check_onnx, input_specs, open_session, run_all
from kiln.optimize.types import Candidate, OptimizeError, OptimizeOptions, Result


@dataclass(slots=True)
class Outcome:
    """What :func:`optimize` returns: the report (as in report.json) and where things went."""

    report: dict[str, Any]
    model_dir: Path
    chosen: str | None

    @property
    def ok(self) -> bool:
        return self.chosen is not None


def _builders(source: Path, work: Path, calib: Batch, threads: int
              ) -> list[tuple[str, Callable[[], Candidate]]]:  # fmt: skip
    builders: list[tuple[str, Callable[[], Candidate]]] = [
        (f"fp32-{level}", lambda level=level: graph.build_fp32(source, work, level, threads))  # type: ignore[misc]
        for level in graph.GRAPH_LEVELS
    ]
    pre: list[Path] = []

    def prepared() -> Path:  # pre-process once, and only when an INT8 candidate is wanted
        if not pre:
            pre.append(precision.preprocess(source, work))
        return pre[0]

    builders.append(("int8-dynamic", lambda: precision.build_int8_dynamic(prepared(), work)))
    for name, method, per_channel in precision.static_names():
        builders.append(
            (name, lambda m=method, pc=per_channel: precision.build_int8_static(  # type: ignore[misc]
                prepared(), work, calib, m, pc))
        )  # fmt: skip
    return builders


@contextmanager
def _progress(enabled: bool, total: int) -> Iterator[Callable[[str], None]]:
    if not enabled:
        yield lambda _label: None
        return
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
               "{task.total}"), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("optimize", total=total)

        def step(label: str) -> None:
            bar.update(task, advance=1, description=label)

        yield step


def _wanted(name: str, filters: tuple[str, ...]) -> bool:
    return not filters or any(fnmatch.fnmatch(name, f) for f in filters)


def optimize(options: OptimizeOptions) -> Outcome:
    """Run the whole pipeline; raise :class:`OptimizeError` on bad model or data."""
    from kiln.optimize.export import resolve_model

    batch_sizes = sorted(set(options.batch_sizes))
    if not batch_sizes or batch_sizes[0] < 1:
        raise OptimizeError("--batch-sizes must be positive integers")
    with tempfile.TemporaryDirectory(prefix="kiln-optimize-") as tmp:
        work = options.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        source, exported = resolve_model(options, work, batch_sizes)
        reference = check_onnx(source)
        specs = input_specs(reference)
        calib = load_data(options.calibration_data, specs, "calibration")
        valid = load_data(options.validation_data, specs, "validation")
        labels = (
            load_labels(options.labels, len(next(iter(valid.values())))) if options.labels else None
        )
        check_batch_axis(reference, valid, batch_sizes)
        ref_out = run_all(reference, valid)
        name = options.name or Path(options.model.split(":")[0]).stem
        builders = [(n, b) for n, b in _builders(source, work, calib, options.threads)
                    if _wanted(n, options.candidates)]  # fmt: skip
        built: list[Result] = []
        with _progress(options.progress, 2 * len(builders) + 1) as step:
            step("baseline FP32")
            baseline = profile(source, "all", valid, batch_sizes, options.profile_seconds,
                               options.threads)  # fmt: skip
            for cand_name, build in builders:
                step(f"build {cand_name}")
                result = _build_and_guard(build, cand_name, ref_out, valid, labels, options)
                built.append(result)
                step(f"profile {cand_name}")
                if result.status == "accepted":
                    assert result.candidate.path is not None
                    result.profile = profile(result.candidate.path, result.candidate.graph_level,
                                             valid, batch_sizes, options.profile_seconds,
                                             options.threads)  # fmt: skip
        gpu = precision.gpu_candidates(_gpu_reason(options.device))
        results = built + [Result(c, status="skipped", reason=c.skipped or "") for c in gpu]
        selection = select(results, options.objective, options.latency_budget_ms)
        model_dir = options.output_repository / name
        if selection.chosen is not None:
            selection.chosen.status = "chosen"
            write_entry(options.output_repository, name, selection.chosen.candidate,
                        batch_sizes[-1], options.threads)  # fmt: skip
        report = {
            "name": name,
            "model": options.model,
            "exported_onnx": exported,
            "device": options.device,
            "batch_sizes": batch_sizes,
            "threads": options.threads,
            "constraints": {
                "max_accuracy_drop": options.max_accuracy_drop,
                "latency_budget_ms": options.latency_budget_ms,
                "objective": options.objective,
            },
            "validation_samples": len(ref_out[0]),
            "calibration_samples": len(next(iter(calib.values()))),
            "baseline": {
                "description": "the input model as FP32, ONNX Runtime defaults (graph level all)",
                "task_accuracy": task_accuracy(ref_out, labels),
                "profile": _asdict(baseline),
            },
            "chosen": selection.chosen.candidate.name if selection.chosen else None,
            "closest": selection.closest.candidate.name if selection.closest else None,
            "why": selection.why,
            "candidates": [r.to_json() for r in results],
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_reports(model_dir, report)
        chosen = selection.chosen.candidate.name if selection.chosen else None
        return Outcome(report, model_dir, chosen)


def _asdict(value: object) -> Any:
    from dataclasses import asdict

    return asdict(value)  # type: ignore[call-overload]


def _gpu_reason(device: str) -> str:
    if device == "cpu":
        return "needs an NVIDIA GPU (--device cuda); this run is --device cpu"
    return "GPU candidates are not implemented by kiln optimize yet"


def _build_and_guard(build: Callable[[], Candidate], name: str, reference: list[Any],
                     valid: Batch, labels: Any, options: OptimizeOptions) -> Result:  # fmt: skip
    try:
        candidate = build()
    except Exception as exc:
        failed = Candidate(name, name.split("-")[0], "", error=str(exc))
        return Result(failed, status="failed", reason=f"build failed: {_first_line(exc)}")
    try:
        assert candidate.path is not None
        outputs = run_all(open_session(candidate.path, candidate.graph_level, options.threads),
                          valid)  # fmt: skip
    except Exception as exc:
        return Result(candidate, status="failed", reason=f"does not run: {_first_line(exc)}")
    accuracy = compare(reference, outputs, labels)
    why = verdict(accuracy, options.max_accuracy_drop)
    if why is not None:
        return Result(candidate, accuracy, status="rejected", reason=why)
    return Result(candidate, accuracy, status="accepted")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
