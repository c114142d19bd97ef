"""A/B of kiln source trees on the HTTP and gRPC hot paths, interleaved in pairs.

Runs ``grpc_transport.py`` (kiln's HTTP/2 transport and the fast HTTP/binary path, mlp,
c=16) and ``serving_baseline.py`` (HTTP/JSON against raw onnxruntime, simple and mlp, c=1
and c=16) once per tree and pair, each tree's ``src`` first on ``PYTHONPATH`` (the
``kiln serve`` subprocesses inherit it). Trees are usually git worktrees of two commits::

    git worktree add /tmp/before HEAD~5
    .venv/bin/python benchmarks/hot_path_ab.py --trees /tmp/before/src,src --pairs 3

Prints req/s per cell, tree and pair, and each cell's median ratio (second tree over first).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run(script: str, args: list[str], tree: str) -> str:
    env = dict(os.environ, PYTHONPATH=f"{tree}{os.pathsep}{HERE}")
    out = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env, capture_output=True, text=True, check=True, timeout=900,
    )  # fmt: skip
    return out.stdout


def grpc_cells(tree: str, duration: float) -> dict[str, float]:
    text = run(
        "grpc_transport.py",
        ["--rounds", "1", "--implementations", "kiln,http", "--duration", str(duration)],
        tree,
    )
    cells = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in ("kiln", "http"):
            name = "gRPC binary mlp c=16" if parts[0] == "kiln" else "HTTP/binary mlp c=16"
            cells[name] = float(parts[1])
    return cells


def baseline_cells(tree: str, duration: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "baseline.json"
        run("serving_baseline.py", ["--duration", str(duration), "--json", str(out)], tree)
        rows = json.loads(out.read_text())
    return {
        f"HTTP/JSON {r['model']} c={r['concurrency']}": r["throughput"]
        for r in rows
        if r["target"] != "raw ORT"
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trees", required=True, help="comma-separated kiln src folders")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--duration", type=float, default=3.0)
    args = parser.parse_args()
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    results: dict[str, dict[str, list[float]]] = {}
    for pair in range(args.pairs):
        for tree in trees:
            cells = grpc_cells(tree, args.duration) | baseline_cells(tree, args.duration)
            for cell, value in cells.items():
                results.setdefault(cell, {}).setdefault(tree, []).append(value)
                print(f"pair {pair} {cell:24} {value:8.0f} req/s  {tree}", flush=True)
    print()
    print(f"{'cell':24} " + " ".join(f"{'tree ' + str(i):>26}" for i in range(len(trees)))
          + "  median ratio")  # fmt: skip
    for cell, by_tree in results.items():
        figures = [by_tree.get(t, []) for t in trees]
        shown = " ".join(f"{'/'.join(f'{v:.0f}' for v in f):>26}" for f in figures)
        ratio = ""
        if len(trees) == 2 and all(figures):
            ratio = f"{statistics.median(figures[1]) / statistics.median(figures[0]):.2f}"
        print(f"{cell:24} {shown}  {ratio}")


if __name__ == "__main__":
    main()
