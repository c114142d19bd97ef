"""FP32 candidates: ONNX Runtime graph optimization levels, with the optimized graph saved.

Above ``basic`` the saved graph may hold CPU-specific fused ops (ONNX Runtime's docs), which is
fine here: the candidate is measured and served on this same kind of machine.
"""

from __future__ import annotations

import time
from pathlib import Path

from kiln.optimize.session import open_session, session_options
from kiln.optimize.types import Candidate

GRAPH_LEVELS = ("basic", "extended", "all")


def build_fp32(source: Path, workdir: Path, level: str, threads: int) -> Candidate:
    import onnxruntime as ort

    out = workdir / f"fp32-{level}.onnx"
    candidate = Candidate(
        name=f"fp32-{level}",
        kind="fp32",
        description=f"FP32, ONNX Runtime graph optimizations '{level}' (saved offline)",
        graph_level=level,
    )
    start = time.perf_counter()
    ort.InferenceSession(
        str(source),
        session_options(level, threads, save_to=out),
        providers=["CPUExecutionProvider"],
    )
    candidate.build_seconds = time.perf_counter() - start
    candidate.path = out
    open_session(out, level, threads)  # the saved graph must load again on its own
    return candidate
