"""What ``kiln serve``'s own process spends per streamed token (docs/llm.md, "Streaming:
tokens per event"): a tiny random Llama (its engine is fast, so the server's work shows)
streams ``--num-prompts`` completions at each ``--concurrency`` through ``kiln bench
--openai``, for each ``--stream-interval`` and each source tree (``--tree NAME=PATH``: an
A/B of two checkouts), alternated across ``--repeats``.

Printed per run: output tok/s, TPOT and TTFT p50, tokens per SSE event (kiln bench's
chunks), and CPU microseconds per output token of the server process alone and of its
engine process (the load generator's are left out).

    python benchmarks/stream_events.py --repeats 2 --intervals 1,4
    python benchmarks/stream_events.py --tree before=/tmp/kiln-before --tree after=. \\
        --concurrency 64,256
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from gc_pauses import _ready  # noqa: E402  (waits for kiln serve's readiness)

TICK = os.sysconf("SC_CLK_TCK")


def _seconds(pid: int | str) -> float:
    """A live process's user + system CPU seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def _cpu(pid: int) -> tuple[float, float]:
    """CPU seconds of the server process, and of its live children (the engine process)."""
    children = {c for f in Path(f"/proc/{pid}/task").glob("*/children")
                for c in f.read_text().split()}  # fmt: skip
    return _seconds(pid), sum(_seconds(c) for c in children)


def run(tree: Path, work: Path, interval: int, conc: int, args: argparse.Namespace,
        port: int) -> dict[str, Any]:  # fmt: skip
    env = dict(os.environ, PYTHONPATH=f"{tree / 'src'}:{tree}")
    cmd = [sys.executable, "-m", "kiln", "serve", "--model", str(work / "model"),
           "--served-model-name", "tiny", "--max-num-seqs", str(conc),
           "--http-port", str(port), "--grpc-port", str(port + 1),
           "--metrics-port", str(port + 2), "--no-history"]  # fmt: skip
    if interval > 1:  # (a tree from before the flag runs at its default, 1)
        cmd += ["--stream-interval", str(interval)]
    log = open(work / f"serve-{port}.log", "wb")  # noqa: SIM115 - closed below
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    bench = [sys.executable, "-m", "kiln", "bench", "--openai", f"http://127.0.0.1:{port}",
             "--model", "tiny", "--dataset", str(work / "prompts.jsonl"), "--ignore-eos",
             "--max-concurrency", str(conc)]  # fmt: skip
    try:
        _ready(port)
        warm = [*bench, "--num-prompts", str(conc), "--json", str(work / "warm.json")]
        subprocess.run(warm, env=env, check=True, capture_output=True, timeout=900)
        report = work / f"bench-{port}.json"
        before = _cpu(server.pid)
        measured = [*bench, "--num-prompts", str(args.num_prompts), "--json", str(report)]
        subprocess.run(measured, env=env, check=True, capture_output=True, timeout=900)
        after = _cpu(server.pid)
        doc = json.loads(report.read_text())
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    done = [r for r in doc["requests"] if not r["error"]]
    tokens = sum(r["output_tokens"] for r in done)
    return {
        "tok_s": doc["output_throughput"],
        "tpot_p50": doc["tpot_ms"]["p50"],
        "ttft_p50": doc["ttft_ms"]["p50"],
        "tokens_per_event": tokens / max(sum(r["chunks"] for r in done), 1),
        "server_us": 1e6 * (after[0] - before[0]) / tokens,
        "engine_us": 1e6 * (after[1] - before[1]) / tokens,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tree",
        action="append",
        default=[],
        help="NAME=PATH of a kiln checkout (default: this one, as 'kiln')",
    )
    ap.add_argument("--intervals", default="1", help="--stream-interval values, e.g. 1,4,16")
    ap.add_argument("--concurrency", default="64")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=18300)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    trees = [(n, Path(p).resolve()) for n, p in (t.split("=", 1) for t in args.tree)]
    trees = trees or [("kiln", ROOT)]
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    from tests.llm_models import build_tiny_llm

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_tiny_llm(work / "model")
        rng = random.Random(0)
        with open(work / "prompts.jsonl", "w") as f:
            for _ in range(args.num_prompts):
                prompt = [rng.randrange(5, 250) for _ in range(32)]
                f.write(json.dumps({"prompt": prompt, "max_tokens": args.output_len}) + "\n")
        port = args.port
        for repeat in range(args.repeats):
            for conc in (int(c) for c in args.concurrency.split(",")):
                for interval in (int(i) for i in args.intervals.split(",")):
                    for name, tree in trees:
                        r = run(tree, work, interval, conc, args, port)
                        port += 3
                        r.update(tree=name, interval=interval, concurrency=conc, repeat=repeat)
                        rows.append(r)
                        print(f"{name:8} c={conc:<4} interval {interval:<3} {r['tok_s']:7.0f} "
                              f"tok/s  TPOT p50 {r['tpot_p50']:5.1f} ms  TTFT p50 "
                              f"{r['ttft_p50']:6.0f} ms  {r['tokens_per_event']:5.2f} tok/event"
                              f"  server {r['server_us']:5.1f} us/tok  engine "
                              f"{r['engine_us']:5.1f} us/tok", flush=True)  # fmt: skip
    print("\nmedians (server us/token, tok/s):")
    keys = sorted({(r["tree"], r["concurrency"], r["interval"]) for r in rows})
    for key in keys:
        mine = [r for r in rows if (r["tree"], r["concurrency"], r["interval"]) == key]
        print(
            f"  {key[0]:8} c={key[1]:<4} interval {key[2]:<3} "
            f"{statistics.median(r['server_us'] for r in mine):6.1f} us/tok  "
            f"{statistics.median(r['tok_s'] for r in mine):7.0f} tok/s"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
