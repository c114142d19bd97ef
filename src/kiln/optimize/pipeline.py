"""``kiln optimize``: export, build candidates, guard accuracy, profile, select, deploy, report."""

from __future__ import annotations

import fnmatch
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from kiln.optimize import gpu, graph, precision
from kiln.optimize.accuracy import compare, task_accuracy, verdict
from kiln.optimize.data import Batch, load_data, load_labels
from kiln.optimize.deploy import write_entry
from kiln.optimize.profile import Timed, profile_all
from kiln.optimize.report import write_reports
from kiln.optimize.select import select
from kiln.optimize.session import (
    check_batch_axis,
    check_onnx,
    input_specs,
    open_runner,
    open_session,
    run_all,
)
from kiln.optimize.tune import ServingPoint, Tuning, tune
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
    for name, method, per_channel, form in precision.static_names():
        build = partial(precision.build_int8_static, method=method, per_channel=per_channel,
                        form=form)  # fmt: skip
        builders.append((name, lambda b=build: b(prepared(), work, calib)))  # type: ignore[misc]
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


def _gpu_builders(options: OptimizeOptions, source: Path, work: Path, batch_sizes: list[int],
                  valid: Batch, cpu_results: list[Result], reasons: dict[str, str | None]
                  ) -> tuple[list[tuple[str, Callable[[], Candidate]]], list[Result]]:  # fmt: skip
    """Builders for the GPU candidates this machine can build; skipped results for the rest."""
    from kiln.optimize import trt_engine

    fp16: list[Path] = []

    def fp16_model() -> Path:  # converted once, shared by fp16 and tensorrt-fp16
        if not fp16:
            fp16.append(precision.build_fp16(source, work, "fp16", options.keep_io_types))
        return fp16[0]

    qdq = sorted((r for r in cpu_results if r.candidate.kind == "int8-static"
                  and r.status == "accepted" and r.accuracy is not None),
                 key=lambda r: r.accuracy.drop if r.accuracy else 0.0)  # fmt: skip
    builders: list[tuple[str, Callable[[], Candidate]]] = []
    skipped: list[Result] = []
    for spec in gpu.GPU_CANDIDATES:
        reason = reasons[spec.name]
        if reason is None and spec.precision == "int8" and not qdq:
            reason = "no INT8 static QDQ candidate passed the accuracy guard to build it from"
        if reason is not None:
            skipped.append(Result(gpu.candidate(spec, reason), status="skipped", reason=reason))
            continue
        if not _wanted(spec.name, options.candidates):
            continue

        def build(spec: gpu.GpuCandidate = spec) -> Candidate:
            c = gpu.candidate(spec)
            start = time.perf_counter()
            if spec.runtime == "tensorrt":
                onnx_path: Path | None = source
                if spec.precision == "fp16":
                    onnx_path = fp16_model()
                elif spec.precision == "int8":  # the most accurate calibrated QDQ model
                    best = qdq[0].candidate
                    assert best.path is not None
                    # TensorRT's parser refuses INT32 bias DequantizeLinear: float biases
                    onnx_path = precision.fold_int32_bias(best.path, work / "int8-trt.onnx")
                    c.description += f" ({best.name}, biases in float)"
                assert onnx_path is not None
                return trt_engine.build_candidate(c, onnx_path, work, batch_sizes, valid)
            c.path = fp16_model() if spec.kind == "fp16" else source
            c.build_seconds = time.perf_counter() - start
            return c

        builders.append((spec.name, build))
    return builders, skipped


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
        max_batch = batch_sizes[-1]
        cuda = options.device == "cuda"
        reasons = gpu.skip_reasons(options.device, gpu.probe() if cuda else None)
        memory = gpu.GpuMemory.open() if cuda else None

        def runner(c: Candidate) -> Any:
            return open_runner(c, options.threads, max_batch, work / "ort-trt-cache")

        builders = [(n, b) for n, b in _builders(source, work, calib, options.threads)
                    if _wanted(n, options.candidates)]  # fmt: skip
        gpu_total = sum(r is None for r in reasons.values())
        built: list[Result] = []
        rounds = max(1, options.profile_rounds)
        with _progress(options.progress, len(builders) + gpu_total + rounds) as step:

            def run_builders(todo: list[tuple[str, Callable[[], Candidate]]]) -> None:
                for cand_name, build in todo:
                    step(f"build {cand_name}")
                    built.append(_build_and_guard(build, cand_name, ref_out, valid, labels,
                                                  options, runner))  # fmt: skip

            run_builders(builders)
            gpu_todo, skipped = _gpu_builders(options, source, work, batch_sizes, valid, built,
                                              reasons)  # fmt: skip
            run_builders(gpu_todo)
            # The baseline is timed with the candidates, in the same interleaved rounds, so a
            # burst of load on a shared machine cannot favour whichever was timed at a quiet
            # moment (profile.py).
            accepted = [r for r in built if r.status == "accepted"]
            timed = [Timed(lambda: open_session(source, "all", options.threads), source)]
            for result in accepted:
                assert result.candidate.path is not None
                timed.append(Timed(partial(runner, result.candidate), result.candidate.path))
            profiles = profile_all(
                timed, valid, batch_sizes, options.profile_seconds, rounds, memory,
                on_round=lambda r: step(f"profile round {r + 1}/{rounds}"),
            )  # fmt: skip
            baseline = profiles[0]
            for result, measured in zip(accepted, profiles[1:], strict=True):
                result.profile = measured
        if memory is not None:
            memory.close()
        results = built + skipped
        selection = select(results, options.objective, options.latency_budget_ms)
        model_dir = options.output_repository / name
        serving: dict[str, Any] = {"tuned": False, "why": "nothing was chosen", "grid": []}
        if selection.chosen is not None:
            selection.chosen.status = "chosen"
            chosen_c = selection.chosen.candidate
            config = None
            if options.tune_serving:
                tuning = tune(chosen_c, name, work / "tune", valid, batch_sizes, options.threads,
                              options.tune_concurrency or max_batch, options.tune_seconds,
                              options.latency_budget_ms)  # fmt: skip
                config = tuning.best.config if tuning.best else None
                serving = _serving_json(tuning, options, max_batch)
            else:
                serving = {"tuned": False, "why": "--no-tune-serving", "grid": []}
            write_entry(options.output_repository, name, chosen_c, max_batch, options.threads,
                        config)  # fmt: skip
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
            "serving": serving,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_reports(model_dir, report)
        chosen = selection.chosen.candidate.name if selection.chosen else None
        return Outcome(report, model_dir, chosen)


def _serving_json(tuning: Tuning, options: OptimizeOptions, max_batch: int) -> dict[str, Any]:
    best = tuning.best
    return {
        "tuned": best is not None,
        "why": tuning.why,
        "concurrency": options.tune_concurrency or max_batch,
        "seconds_per_config": options.tune_seconds,
        "max_batch_size": max_batch,
        "chosen": _point(best) if best else None,
        "grid": [_point(p) for p in tuning.grid],
    }


def _point(point: ServingPoint) -> dict[str, Any]:
    return {"label": point.config.label(), **_asdict(point)}


def _asdict(value: object) -> Any:
    from dataclasses import asdict

    return asdict(value)  # type: ignore[call-overload]


def _build_and_guard(build: Callable[[], Candidate], name: str, reference: list[Any],
                     valid: Batch, labels: Any, options: OptimizeOptions,
                     runner: Callable[[Candidate], Any]) -> Result:  # fmt: skip
    try:
        candidate = build()
    except Exception as exc:
        failed = Candidate(name, name.split("-")[0], "", error=str(exc))
        return Result(failed, status="failed", reason=f"build failed: {_first_line(exc)}")
    try:
        assert candidate.path is not None
        session = runner(candidate)
        # Chunks no larger than the largest profiled batch: a TensorRT profile's maximum.
        outputs = run_all(session, valid, max(options.batch_sizes))
        close = getattr(session, "close", None)
        if close is not None:
            close()
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
