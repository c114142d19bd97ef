"""benchmarks/llm_gpu.py on a machine without a CUDA GPU: a clear message, exit status 2,
and no JSON written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the benchmark would run")
def test_gpu_benchmark_says_it_needs_a_cuda_gpu(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "llm_gpu.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr
    assert not out.exists()
