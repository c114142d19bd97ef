"""Garbage-collector pauses in ``kiln serve`` while it streams (docs/design/gc-freeze.md).

A tiny random Llama (the engine is fast, so the server process's own work shows) is served
with ``kiln serve --model``; ``kiln bench --openai`` streams ``--num-prompts`` completions
of 128 tokens at ``--max-concurrency``. The server process runs under a wrapper that
times every collection (``gc.callbacks``) from the moment the server is ready, with the
startup heap frozen (kiln's default) or, with ``--no-freeze``, thawed again right after
(the server as it was before the freeze). Modes alternate across ``--repeats``. Printed
per run: output tok/s, TPOT and TTFT p50 / p99, the server's full (generation 2)
collections while serving with their longest pause, and the time of all collections.

    python benchmarks/gc_pauses.py --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Runs in the server process: kiln's CLI under a gc.callbacks timer.
WRAPPER = r"""
import gc, json, os, runpy, sys, time
import kiln.core.heap as heap
freeze = heap.freeze_startup_heap
pauses, began = [], {}
def timer(phase, info):
    if phase == "start":
        began["t"] = time.perf_counter()
    elif "t" in began and began.get("on"):
        pauses.append((info["generation"], time.perf_counter() - began["t"]))
def ready():
    frozen = freeze()
    if os.environ.get("KILN_BENCH_THAW"):
        gc.unfreeze()  # as before the freeze: every object in the collector's passes
    began["on"] = True  # count what serving costs, not the startup collection
    return frozen
heap.freeze_startup_heap = ready
gc.callbacks.append(timer)
def report():
    with open(os.environ["KILN_BENCH_GC"], "w") as f:
        json.dump({"pauses": pauses, "frozen": gc.get_freeze_count()}, f)
import atexit
atexit.register(report)
sys.argv = ["kiln"] + sys.argv[1:]
runpy.run_module("kiln", run_name="__main__")
"""


def _ready(port: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError("kiln serve did not become ready")


def run(model: Path, work: Path, thaw: bool, args: argparse.Namespace, port: int) -> dict[str, Any]:
    gc_file = work / f"gc-{port}.json"
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}:{ROOT}", KILN_BENCH_GC=str(gc_file))
    if thaw:
        env["KILN_BENCH_THAW"] = "1"
    wrapper = work / "wrapper.py"
    wrapper.write_text(WRAPPER)
    cmd = [sys.executable, str(wrapper), "serve", "--model", str(model),
           "--served-model-name", "tiny", "--max-num-seqs", str(args.max_concurrency),
           "--http-port", str(port), "--grpc-port", str(port + 1),
           "--metrics-port", str(port + 2), "--no-history"]  # fmt: skip
    log = open(work / f"serve-{port}.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        _ready(port)
        report = work / f"bench-{port}.json"
        bench = [sys.executable, "-m", "kiln", "bench", "--openai", f"http://127.0.0.1:{port}",
                 "--model", "tiny", "--dataset", str(work / "prompts.jsonl"),
                 "--num-prompts", str(args.num_prompts), "--max-concurrency",
                 str(args.max_concurrency), "--ignore-eos", "--json", str(report)]  # fmt: skip
        subprocess.run(bench, env=env, check=True, capture_output=True, timeout=900)
        doc = json.loads(report.read_text())
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    gc_doc = json.loads(gc_file.read_text())
    full = [t for g, t in gc_doc["pauses"] if g == 2]
    return {
        "mode": "thawed (before)" if thaw else "frozen (kiln)",
        "tok_s": doc["output_throughput"],
        "tpot": (doc["tpot_ms"]["p50"], doc["tpot_ms"]["p99"]),
        "ttft": (doc["ttft_ms"]["p50"], doc["ttft_ms"]["p99"]),
        "full_passes": len(full),
        "longest_full_ms": 1e3 * max(full, default=0.0),
        "all_gc_ms": 1e3 * sum(t for _, t in gc_doc["pauses"]),
        "frozen": gc_doc["frozen"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--port", type=int, default=18123)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    from tests.llm_models import build_tiny_llm

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_tiny_llm(work / "model")
        rng = random.Random(0)
        with open(work / "prompts.jsonl", "w") as f:
            for _ in range(args.num_prompts):
                prompt = [rng.randrange(5, 250) for _ in range(32)]
                f.write(json.dumps({"prompt": prompt, "max_tokens": 128}) + "\n")
        port = args.port
        for _ in range(args.repeats):
            for thaw in (True, False):
                rows.append(run(model, work, thaw, args, port))
                port += 3
                r = rows[-1]
                tpot, ttft = r["tpot"], r["ttft"]
                print(f"{r['mode']:16} {r['tok_s']:7.0f} tok/s  TPOT p50/p99 {tpot[0]:.1f}/"
                      f"{tpot[1]:.1f} ms  TTFT p50/p99 {ttft[0]:.0f}/{ttft[1]:.0f} ms  "
                      f"full GC passes {r['full_passes']} (longest {r['longest_full_ms']:.1f} "
                      f"ms)  all GC {r['all_gc_ms']:.0f} ms  frozen {r['frozen']}",
                      flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
