"""The engine's profiler: ``/start_profile`` .. ``/stop_profile`` around its steps.

vLLM's worker profiler, as kiln's engine runs it (on the engine's thread, between steps):
a session starts at once or after ``delay_iterations`` steps, records until
``/stop_profile`` or ``max_iterations`` recorded steps, and writes one
``torch.profiler`` trace (``<name>.<ms>.pt.trace.json[.gz]``, for Perfetto or
chrome://tracing) and an op table (``<name>.profiler_out.txt``) into
``torch_profiler_dir``. ``profiler: cuda`` brackets the steps with
``cudaProfilerStart``/``Stop`` instead, for ``nsys profile --capture-range=cudaProfilerApi``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm.profiler_config import ProfilerConfig

log = logging.getLogger("kiln.llm.profiler")


#: what a frontend may run on the engine between two steps (``LLMEngine.call``, through
#: ``engine_control``: the engine's thread, or its process): nothing else runs that way
ENGINE_CALLS = ("start_profile", "stop_profile")


def engine_call(profiler: EngineProfiler | None, op: str, args: Sequence[object]) -> object:
    """``start_profile(prefix, delay, limit)`` or ``stop_profile()`` (its files)."""
    if op not in ENGINE_CALLS:
        raise KilnError(f"llm engine: no call '{op}'", Status.INTERNAL)
    if profiler is None:
        raise KilnError(
            "profiling is not enabled for this model: start it with --profiler-config "
            "(the parameter profiler_config)",
            Status.NOT_FOUND,
        )
    if op == "stop_profile":
        return profiler.stop()
    prefix, delay, limit = args
    assert (prefix is None or isinstance(prefix, str)) and all(
        x is None or isinstance(x, int) for x in (delay, limit)
    )
    profiler.start(prefix, delay, limit)  # type: ignore[arg-type]
    return None


def trace_name(model: str, prefix: str | None, rank: int = 0) -> str:
    """``<prefix>_<model>_tp<rank>``: the model's name keeps only file-name characters."""
    base = f"{re.sub(r'[^A-Za-z0-9._-]', '_', model)[:64]}_tp{rank}"
    return f"{prefix}_{base}" if prefix else base


class EngineProfiler:
    """One engine's profiling sessions; every method runs on the engine's thread."""

    def __init__(self, config: ProfilerConfig, model: str, device: str) -> None:
        self.config = config
        self.model = model
        self.device = device
        cuda = device.startswith("cuda")
        activities = config.torch_profiler_activities or (("CPU", "CUDA") if cuda else ("CPU",))
        if "CUDA" in activities and not cuda:
            raise KilnError(
                f"model '{model}': profiler_config: torch_profiler_activities 'CUDA' needs "
                f"a GPU, and the engine runs on '{device}'",
                Status.INVALID_ARG,
            )
        if config.profiler == "cuda" and not cuda:
            raise KilnError(
                f"model '{model}': profiler_config: profiler 'cuda' needs a GPU, and the "
                f"engine runs on '{device}' (use profiler 'torch')",
                Status.INVALID_ARG,
            )
        self.activities = activities
        if config.torch_profiler_dir:
            Path(config.torch_profiler_dir).mkdir(parents=True, exist_ok=True)
        self.active = False  # a session was started and not stopped
        self.running = False  # recording now
        self._name = trace_name(model, None)
        self._delay = config.delay_iterations
        self._limit = config.max_iterations
        self._steps = 0  # steps since the session started
        self._recorded = 0  # steps recorded (a schedule's warmup steps not counted)
        self._warmup_left = 0
        self._profile: Any = None  # torch.profiler.profile while recording
        self._before: set[str] = set()
        #: the files the last finished session wrote
        self.written: list[str] = []

    # ---- sessions ----------------------------------------------------------------------
    def start(self, prefix: str | None, delay: int | None, limit: int | None) -> None:
        if self.active:
            raise KilnError(
                "A profiling session is already active. Call /stop_profile before starting "
                "another session.",
                Status.CONFLICT,
            )
        self._name = trace_name(self.model, prefix)
        self._delay = self.config.delay_iterations if delay is None else delay
        self._limit = self.config.max_iterations if limit is None else limit
        self._steps = self._recorded = 0
        self.active = True
        self.written = []
        if self._delay == 0:
            self._record()

    def stop(self) -> list[str]:
        """End the session (nothing when none is active); the files it wrote."""
        if not self.active:
            return []
        self.active = False
        if self.running:
            self._finish()
        return self.written

    def step(self) -> None:
        """After each engine step that ran the model: a delayed start (the next step is
        the first recorded), the schedule's phases, the step limit."""
        if not self.active:
            return
        self._steps += 1
        if not self.running:
            if self._steps == self._delay:
                self._record()
            return
        if self._profile is not None and self._scheduled():
            self._profile.step()
            if self._warmup_left > 0:  # a wait or warmup step: discarded
                self._warmup_left -= 1
                return
        self._recorded += 1
        if self._limit > 0 and self._recorded >= self._limit:
            log.info("profiler: %d steps recorded, the session ends", self._recorded)
            self.stop()

    @contextlib.contextmanager
    def annotate(self, name: str) -> Iterator[None]:
        """A named range in the trace (``torch``) or NVTX (``cuda``) while recording."""
        if not self.running:
            yield
        elif self.config.profiler == "cuda":
            with torch.cuda.nvtx.range(name):
                yield
        else:
            with torch.profiler.record_function(name):
                yield

    def close(self) -> None:
        with contextlib.suppress(Exception):  # unloading: a broken trace is not an error
            self.stop()

    # ---- recording ---------------------------------------------------------------------
    def _scheduled(self) -> bool:
        return self.config.warmup_iterations > 0 or self.config.wait_iterations > 0

    def _record(self) -> None:
        config = self.config
        try:
            if config.profiler == "cuda":
                torch.cuda.profiler.start()  # type: ignore[no-untyped-call]
            else:
                # the files there before: a schedule's trace is written while it runs
                self._before = set(os.listdir(config.torch_profiler_dir))
                self._profile = self._build()
                self._profile.start()
        except Exception as exc:  # vLLM: a profiler that cannot start is logged
            log.warning("profiler: could not start: %s", exc)
            self._profile = None
            return
        scheduled = self._scheduled()
        self._warmup_left = config.wait_iterations + config.warmup_iterations if scheduled else 0
        self.running = True

    def _build(self) -> Any:
        config = self.config
        kinds = {"CPU": torch.profiler.ProfilerActivity.CPU,
                 "CUDA": torch.profiler.ProfilerActivity.CUDA}  # fmt: skip
        schedule = None
        if self._scheduled():
            schedule = torch.profiler.schedule(
                wait=config.wait_iterations,
                warmup=config.warmup_iterations,
                active=config.active_iterations,
                repeat=1,
            )
        handler = torch.profiler.tensorboard_trace_handler(
            config.torch_profiler_dir,
            worker_name=self._name,
            use_gzip=config.torch_profiler_use_gzip,
        )
        return torch.profiler.profile(
            activities=[kinds[a] for a in self.activities],
            schedule=schedule,
            record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory,
            with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=handler,
        )

    def _finish(self) -> None:
        self.running = False
        config = self.config
        if config.profiler == "cuda":
            with contextlib.suppress(Exception):
                torch.cuda.profiler.stop()  # type: ignore[no-untyped-call]
            return
        profile, self._profile = self._profile, None
        if profile is None:
            return
        folder = Path(config.torch_profiler_dir)
        try:
            profile.stop()
        except Exception as exc:
            log.warning("profiler: could not stop: %s", exc)
            return
        tables = []
        device = any(a != "CPU" for a in self.activities)
        if device and config.torch_profiler_dump_cuda_time_total:
            tables.append(self._table(profile, "self_device_time_total", None))
        if self.activities == ("CPU",):
            tables.append(self._table(profile, "self_cpu_time_total", 50))
        written = set(os.listdir(folder)) - self._before
        if any(tables):
            table = f"{self._name}.profiler_out.txt"
            (folder / table).write_text("\n".join(t for t in tables if t) + "\n")
            written.add(table)
        self.written = [str(folder / f) for f in sorted(written)]
        log.info("profiler: wrote %s", ", ".join(self.written))

    def _table(self, profile: Any, sort_by: str, rows: int | None) -> str:
        try:
            averages = profile.key_averages(
                group_by_input_shape=self.config.torch_profiler_record_shapes
            )
            text: str = averages.table(sort_by=sort_by, row_limit=rows if rows else 100)
        except Exception as exc:  # a schedule that never recorded has no events
            log.warning("profiler: no op table: %s", exc)
            return ""
        return text
