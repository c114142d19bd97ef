"""Value objects shared by the optimize pipeline: options, candidates, measurements, results."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Objective = Literal["latency", "throughput"]


class OptimizeError(Exception):
    """A user-facing failure of ``kiln optimize`` (bad model, bad data, export failure)."""


@dataclass(slots=True)
class OptimizeOptions:
    """What a user asks of ``kiln optimize``; the CLI and :func:`kiln.optimize` build this."""

    model: str
    calibration_data: str
    validation_data: str
    output_repository: Path
    labels: str | None = None
    name: str | None = None
    max_accuracy_drop: float = 0.01
    latency_budget_ms: float | None = None
    objective: Objective = "latency"
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    device: str = "cpu"
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    candidates: tuple[str, ...] = ()  # name filters (fnmatch); empty = all
    profile_seconds: float = 0.25  # per candidate and batch size, over all rounds
    profile_rounds: int = 5  # interleaved rounds that window is split into (profile.py)
    threads: int = 1
    progress: bool = True
    workdir: Path | None = None
    keep_io_types: bool = True  # FP16 candidates keep float32 inputs/outputs
    tune_serving: bool = True  # search dynamic batching / instance count for the chosen one
    tune_seconds: float = 0.5  # closed-loop load per serving config
    tune_concurrency: int | None = None  # in-process callers; None: the largest batch size


@dataclass(slots=True)
class Candidate:
    """One way to run the model: a file plus how ONNX Runtime should load it."""

    name: str
    kind: str  # fp32 | int8-dynamic | int8-static | fp16 | tensorrt | ort-cuda | ort-trt
    description: str
    graph_level: str = "all"  # ONNX Runtime graph optimization level when serving
    # Where it runs: cpu (ORT CPU EP) | cuda (ORT CUDA EP) | ort-tensorrt (ORT TensorRT EP)
    # | tensorrt (a serialized engine, run by kiln's TensorRT backend).
    runtime: str = "cpu"
    precision: str = "fp32"  # fp32 | fp16 | int8; ort-tensorrt: the EP's precision_mode
    built_from: Path | None = None  # a TensorRT engine: the ONNX model it was built from
    path: Path | None = None
    build_seconds: float = 0.0
    skipped: str | None = None  # why it could not run here
    error: str | None = None  # why building or running it failed


@dataclass(frozen=True, slots=True)
class ServingConfig:
    """The serving fields kiln optimize tunes in ``config.pbtxt``."""

    instances: int
    max_queue_delay_us: int | None  # None: no dynamic_batching (each request runs alone)
    preferred_batch_sizes: tuple[int, ...] = ()

    def label(self) -> str:
        if self.max_queue_delay_us is None:
            return f"{self.instances} instance(s), no dynamic batching"
        return (
            f"{self.instances} instance(s), dynamic batching, preferred "
            f"{list(self.preferred_batch_sizes)}, max delay {self.max_queue_delay_us} us"
        )


@dataclass(slots=True)
class Accuracy:
    """A candidate's outputs against the FP32 reference on the validation data."""

    max_abs_error: float
    max_rel_error: float
    cosine_similarity: float
    top1_agreement: float | None
    task_accuracy: float | None
    drop: float  # what --max-accuracy-drop bounds (see accuracy.accuracy_drop)
    drop_metric: str


@dataclass(slots=True)
class BatchProfile:
    """One batch size's figures. p50 and throughput are paired with the baseline round for round
    (profile.py), so they compare runners; p99 is every timed call's, unscaled."""

    batch_size: int
    p50_ms: float
    p99_ms: float
    throughput: float  # inferences (samples) per second
    iterations: int
    # Each interleaved round's raw median (profile.py): their spread is the noise.
    round_p50_ms: list[float] = field(default_factory=list)


@dataclass(slots=True)
class Profile:
    batches: list[BatchProfile]
    rss_mb: float  # host RSS the loaded, warmed session added
    file_size_mb: float
    gpu_mb: float | None = None  # GPU memory the loaded, warmed model added (NVML); None: CPU

    def at(self, batch_size: int) -> BatchProfile:
        return next(b for b in self.batches if b.batch_size == batch_size)


@dataclass(slots=True)
class Result:
    """Everything known about one candidate after the run."""

    candidate: Candidate
    accuracy: Accuracy | None = None
    profile: Profile | None = None
    status: str = "pending"  # accepted | rejected | skipped | failed | over-budget | chosen
    reason: str = ""

    def to_json(self) -> dict[str, Any]:
        from dataclasses import asdict

        c = self.candidate
        return {
            "name": c.name,
            "kind": c.kind,
            "description": c.description,
            "graph_level": c.graph_level,
            "runtime": c.runtime,
            "status": self.status,
            "reason": self.reason,
            "build_seconds": c.build_seconds,
            "accuracy": asdict(self.accuracy) if self.accuracy else None,
            "profile": asdict(self.profile) if self.profile else None,
        }
