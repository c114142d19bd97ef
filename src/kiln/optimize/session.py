"""ONNX Runtime sessions for the pipeline: the reference model, candidates, and batched runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from kiln.optimize.data import ORT_NUMPY, Batch, InputSpec, sample_count, slice_batch
from kiln.optimize.types import Candidate, OptimizeError

LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


def session_options(level: str, threads: int, save_to: Path | None = None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = LEVELS[level]
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # Spinning threads burn the shared cores between runs and skew the other candidates' timings.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    if save_to is not None:
        options.optimized_model_filepath = str(save_to)
    return options


def open_session(path: Path, level: str = "all", threads: int = 1) -> ort.InferenceSession:
    return ort.InferenceSession(
        str(path), session_options(level, threads), providers=["CPUExecutionProvider"]
    )


def check_onnx(path: Path) -> ort.InferenceSession:
    """Open the user's model with graph optimizations off: the FP32 reference."""
    if not path.exists():
        raise OptimizeError(f"model '{path}' does not exist")
    try:
        return open_session(path, "disable")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise OptimizeError(f"'{path}' is not a loadable ONNX model: {first}") from exc


def input_specs(session: ort.InferenceSession) -> list[InputSpec]:
    specs = []
    for i in session.get_inputs():
        if i.type not in ORT_NUMPY:
            raise OptimizeError(f"input '{i.name}' has type {i.type}, which optimize cannot feed")
        dims = tuple(d if isinstance(d, int) and d >= 0 else None for d in i.shape)
        specs.append(InputSpec(i.name, ORT_NUMPY[i.type], dims))
    return specs


def run_all(session: ort.InferenceSession, data: Batch, batch_size: int = 64) -> list[np.ndarray]:
    """Run ``data`` through ``session`` in chunks; one concatenated array per output."""
    chunks: list[list[np.ndarray]] = []
    n = sample_count(data)
    for start in range(0, n, batch_size):
        chunks.append(session.run(None, slice_batch(data, start, start + batch_size)))
    return [np.concatenate([c[i] for c in chunks]) for i in range(len(chunks[0]))]


def check_batch_axis(session: ort.InferenceSession, data: Batch, batch_sizes: list[int]) -> None:
    """A model the optimizer deploys must take every batch size it is profiled at."""
    from kiln.optimize.data import tile_to

    for size in batch_sizes:
        try:
            outputs = session.run(None, tile_to(data, size))
        except Exception as exc:
            raise OptimizeError(
                f"the model does not run at batch size {size} (is the batch dimension fixed?): "
                f"{str(exc).strip().splitlines()[0]}"
            ) from exc
        for meta, out in zip(session.get_outputs(), outputs, strict=True):
            if out.ndim == 0 or out.shape[0] != size:
                raise OptimizeError(
                    f"output '{meta.name}' has shape {list(out.shape)} for a batch of {size}: "
                    "its first dimension must be the batch"
                )


def open_runner(candidate: Candidate, threads: int, max_batch_size: int, cache_dir: Path) -> Any:
    """Something with ``InferenceSession.run``'s shape that runs ``candidate`` where it runs.

    GPU ONNX candidates get the execution providers kiln's ONNX Runtime backend derives from
    the very ``config.pbtxt`` the candidate would be deployed with, so what is measured is
    what is served.
    """
    assert candidate.path is not None
    if candidate.runtime == "cpu":
        return open_session(candidate.path, candidate.graph_level, threads)
    if candidate.runtime == "tensorrt":
        from kiln.optimize.trt_engine import EngineRunner

        return EngineRunner(candidate.path, max_batch_size)
    from kiln.backends.ort_providers import (
        check_session_providers,
        execution_providers,
        preload_cuda_libraries,
    )
    from kiln.config.loader import parse_config_text
    from kiln.optimize.deploy import config_text

    cache_dir.mkdir(parents=True, exist_ok=True)
    config = parse_config_text(
        config_text("optimize", candidate, max_batch_size, threads, cache_dir=cache_dir)
    )
    providers = execution_providers(config, "gpu", 0, ort.get_available_providers())
    preload_cuda_libraries(ort)
    session = ort.InferenceSession(
        str(candidate.path), session_options(candidate.graph_level, threads), providers=providers
    )
    check_session_providers(candidate.name, 0, providers, session.get_providers())
    return session
