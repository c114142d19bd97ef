"""What ``kiln bench`` was asked to do: typed options and perf_analyzer-style range parsing."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path


class BenchError(Exception):
    """A problem that stops the run before or outside measuring (exit status 2)."""


def require_plotting(plot: object) -> None:
    """With ``--plot``, fail before measuring (not after) when matplotlib is missing."""
    if plot is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BenchError("--plot needs matplotlib: install kiln-serve[bench]") from None


@dataclass(frozen=True)
class Reports:
    """Where a run's results go besides the table: ``--csv``, ``--json``, ``--plot``."""

    csv: Path | None = None
    json: Path | None = None
    plot: Path | None = None


class Protocol(enum.Enum):
    HTTP = "http"
    GRPC = "grpc"


class Distribution(enum.Enum):
    CONSTANT = "constant"
    POISSON = "poisson"


def parse_range(text: str, what: str, integer: bool = True) -> list[float]:
    """``start[:end[:step]]`` as perf_analyzer reads it: inclusive end, step defaults to 1.

    A single number is one level. Steps are added (not multiplied), like perf_analyzer.
    """
    parts = text.split(":")
    if not 1 <= len(parts) <= 3 or any(p.strip() == "" for p in parts):
        raise BenchError(f"{what}: expected 'start[:end[:step]]', got '{text}'")
    try:
        values = [int(p) if integer else float(p) for p in parts]
    except ValueError:
        kind = "integers" if integer else "numbers"
        raise BenchError(f"{what}: '{text}' must be {kind} 'start[:end[:step]]'") from None
    start = values[0]
    end = values[1] if len(values) > 1 else start
    step = values[2] if len(values) > 2 else 1
    if start <= 0:
        raise BenchError(f"{what}: start must be > 0, got {start}")
    if end < start:
        raise BenchError(f"{what}: end {end} is below start {start}")
    if step <= 0:
        raise BenchError(f"{what}: step must be > 0, got {step}")
    levels: list[float] = []
    value = start
    # A small epsilon keeps float ranges like 0.5:1.5:0.5 inclusive of their end.
    while value <= end + 1e-9:
        levels.append(value)
        value += step
        if len(levels) > 10_000:
            raise BenchError(f"{what}: '{text}' makes more than 10000 levels")
    return levels


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME:d1,d2`` (perf_analyzer's ``--shape``); the name may itself contain ':'."""
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise BenchError(f"--shape: expected 'NAME:d1,d2,...', got '{text}'")
    try:
        shape = [int(d) for d in dims.split(",")] if dims else []
    except ValueError:
        raise BenchError(f"--shape {name}: dims must be integers, got '{dims}'") from None
    if any(d < 0 for d in shape):
        raise BenchError(f"--shape {name}: dims must be >= 0, got '{dims}'")
    return name, shape


@dataclass(slots=True)
class BenchOptions:
    """Everything a run needs; ``kiln.bench.run`` takes one (or the same keywords)."""

    model: str
    url: str = ""  # default per protocol: localhost:8000 (HTTP) / localhost:8001 (gRPC)
    protocol: Protocol = Protocol.HTTP
    binary: bool = True  # HTTP: binary tensor extension (perf_analyzer's default) or JSON
    model_version: str = ""
    concurrency: list[int] = field(default_factory=lambda: [1])
    request_rates: list[float] = field(default_factory=list)  # non-empty: open loop
    distribution: Distribution = Distribution.CONSTANT
    max_outstanding: int = 64  # open loop: sends beyond this many in flight are dropped
    batch_size: int = 1
    input_data: str = "random"  # random | zero | FILE.json | FILE.npz
    shapes: dict[str, list[int]] = field(default_factory=dict)
    shared_memory: str = "none"  # none | system
    # A model with sequence_batching (perf_analyzer's defaults): each closed-loop client
    # sends sequences of this many requests under its own id, sequence_id_start + client.
    sequence_length: int = 20
    sequence_id_start: int = 1
    # gRPC: send over ModelStreamInfer, a request done at its final response (perf_analyzer's
    # --streaming); a decoupled model is always streamed
    streaming: bool = False
    measurement_interval_ms: int = 2000
    duration_s: float | None = None  # fixed single window instead of stability windows
    stability_percentage: float = 10.0
    max_trials: int = 10
    percentile: int | None = None  # stability on this latency percentile instead of avg
    seed: int = 0
    timeout_s: float = 30.0  # per request; a request past it counts as an error
    api_key: str | None = None  # sent as "Authorization: Bearer" (HTTP header, gRPC metadata)

    def auth_headers(self) -> dict[str, str]:
        """HTTP headers of every request: the API key when one is set."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def grpc_metadata(self) -> tuple[tuple[str, str], ...] | None:
        """gRPC call metadata (lowercase keys): the API key when one is set."""
        return (("authorization", f"Bearer {self.api_key}"),) if self.api_key else None

    def __post_init__(self) -> None:
        if not self.url:
            self.url = "localhost:8001" if self.protocol is Protocol.GRPC else "localhost:8000"
        if self.batch_size < 1:
            raise BenchError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.shared_memory not in ("none", "system"):
            raise BenchError(
                f"--shared-memory '{self.shared_memory}': supported are 'none' and 'system'"
            )
        if self.max_trials < 1:
            raise BenchError(f"--max-trials must be >= 1, got {self.max_trials}")
        if self.measurement_interval_ms <= 0:
            raise BenchError("--measurement-interval must be > 0")
        if self.duration_s is not None and self.duration_s <= 0:
            raise BenchError("--duration must be > 0")
        if self.percentile is not None and not 1 <= self.percentile <= 99:
            raise BenchError(f"--percentile must be within 1..99, got {self.percentile}")
        if any(c < 1 for c in self.concurrency):
            raise BenchError("--concurrency levels must be >= 1")
        if any(r <= 0 for r in self.request_rates):
            raise BenchError("--request-rate levels must be > 0")
        if self.max_outstanding < 1:
            raise BenchError("--max-outstanding must be >= 1")
        if self.sequence_length < 1:
            raise BenchError(f"--sequence-length must be >= 1, got {self.sequence_length}")
        if self.streaming and self.protocol is not Protocol.GRPC:
            raise BenchError("--streaming needs gRPC: add -i grpc")
        if self.sequence_id_start < 1:
            raise BenchError(f"--sequence-id-start must be >= 1, got {self.sequence_id_start}")

    @property
    def open_loop(self) -> bool:
        return bool(self.request_rates)

    @property
    def input_path(self) -> Path | None:
        return None if self.input_data in ("random", "zero") else Path(self.input_data)
