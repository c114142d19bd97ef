"""LLM engine on CPU (issue 8): kiln's engine in-process and over HTTP vs ``transformers``
``generate`` with static batching, on the same 64 requests; KV-cache waste per step.

    .venv/bin/python benchmarks/llm_cpu.py --json llm_cpu.json

The model is a Llama-shaped network with random weights built here (no download). Every
request has a fixed prompt and output length (``ignore_eos``), drawn from a seeded
distribution, so all three runs produce exactly the same number of tokens:

(a) kiln's ``LLMEngine`` in this process: all requests added at once, ``step()`` until done
    (the physical limit of kiln's engine on this machine).
(b) ``kiln serve`` in a subprocess, measured with ``kiln bench --openai`` (token-id prompts,
    max concurrency 64).
(c) ``transformers`` ``generate`` with static batching: batches of B requests padded on the
    left, each batch running until its longest output; B in --hf-batch-sizes, best reported.

Threads: OMP_NUM_THREADS=1 by default (set it to override), inherited by ``kiln serve``.

KV-cache waste, sampled after every step of (a): token slots held in blocks by running
sequences but not (yet) holding a token, over all held slots, weighted by step duration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# One intra-op thread for everything (this process, kiln serve, transformers) unless the
# caller sets OMP_NUM_THREADS: on 2 cores shared with other work, a 2-thread OpenMP team
# spins on a descheduled partner, and the same run measured 7 s to 70 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


@dataclass(frozen=True, slots=True)
class Request:
    prompt: list[int]
    output_len: int


def build_model(folder: Path) -> Path:
    """Random Llama weights (transformers) and a word-level tokenizer covering the vocab."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"])}
    vocab["</s>"] = 2
    del vocab["w2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, eos_token_id=2, bos_token_id=1)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder), safe_serialization=True)
    return folder


def make_requests(
    n: int, seed: int, inputs: tuple[int, int], outputs: tuple[int, int]
) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            [rng.randrange(3, SHAPE["vocab_size"]) for _ in range(rng.randint(*inputs))],
            rng.randint(*outputs),
        )
        for _ in range(n)
    ]


def run_engine(folder: Path, requests: list[Request], block_size: int) -> dict[str, Any]:
    """(a): kiln's engine in-process, with KV-cache waste sampled after every step."""
    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import SamplingParams

    engine = LLMEngine(folder, EngineConfig(block_size=block_size, max_num_seqs=len(requests)))
    # warm-up: one short request, so one-time allocations are not timed
    engine.generate([requests[0].prompt[:8]], SamplingParams(max_tokens=2, temperature=0.0))
    for i, r in enumerate(requests):
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{i}", r.prompt, params)
    waste_time = held_time = 0.0
    peak = 0.0
    steps = 0
    out_tokens = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    last = t0
    while engine.has_work():
        out_tokens += sum(len(o.new_token_ids) for o in engine.step())
        now = time.perf_counter()
        steps += 1
        running = engine.scheduler.running
        held = sum(len(s.block_table) for s in running) * block_size
        used = sum(s.num_computed_tokens for s in running)
        if held:
            waste = (held - used) / held
            peak = max(peak, waste)
            waste_time += waste * (now - last)
            held_time += now - last
        last = now
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "cpu_s": time.process_time() - cpu0,
        "output_tokens": out_tokens,
        "output_tok_s": out_tokens / seconds,
        "steps": steps,
        "preemptions": engine.scheduler.num_preemptions,
        "kv_waste_avg": waste_time / held_time if held_time else 0.0,
        "kv_waste_peak": peak,
        "block_size": block_size,
    }


def run_transformers(folder: Path, requests: list[Request], batch: int) -> dict[str, Any]:
    """(c): static batching: left-padded batches, each running to its longest output."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    model.generate(torch.tensor([requests[0].prompt[:8]]), max_new_tokens=2, do_sample=False,
                   pad_token_id=0)  # fmt: skip
    useful = 0
    generated = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch):
        group = requests[start : start + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, r in enumerate(group):
            ids[row, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[row, width - len(r.prompt) :] = 1
        longest = max(r.output_len for r in group)
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
        generated += (out.shape[1] - width) * len(group)
        # a request only wanted its own output_len: the rest of its rows is padding work
        useful += sum(r.output_len for r in group)
    seconds = time.perf_counter() - t0
    return {"batch": batch, "seconds": seconds, "cpu_s": time.process_time() - cpu0,
            "output_tokens": useful,
            "generated_tokens": generated, "output_tok_s": useful / seconds}  # fmt: skip


CONFIG = """name: "bench"
backend: "llm"
parameters {{ key: "block_size" value {{ string_value: "{block_size}" }} }}
parameters {{ key: "max_num_seqs" value {{ string_value: "{max_num_seqs}" }} }}
"""


def run_http(folder: Path, requests: list[Request], work: Path, block_size: int) -> dict[str, Any]:
    """(b): ``kiln serve`` + ``kiln bench --openai`` at max concurrency = number of requests."""
    from tests.conftest import KilnProcess

    repo = folder.parent.parent  # the model was built as repo/bench/1 (no symlink: refused)
    (repo / "bench" / "config.pbtxt").write_text(
        CONFIG.format(block_size=block_size, max_num_seqs=len(requests))
    )
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": r.prompt, "max_tokens": r.output_len}) + "\n"
                               for r in requests))  # fmt: skip
    server = KilnProcess(repo, args=["--no-history"], log_path=work / "kiln.log")
    try:
        server.start(timeout=180)
        report = work / "bench.json"
        n = str(len(requests))
        cmd = [sys.executable, "-m", "kiln", "bench", "--openai", f"http://{server.http_url}",
               "--model", "bench", "--dataset", str(dataset), "--num-prompts", n,
               "--max-concurrency", n, "--ignore-eos", "--json", str(report)]  # fmt: skip
        assert server.proc is not None
        server_cpu = process_cpu(server.proc.pid)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        server_cpu = process_cpu(server.proc.pid) - server_cpu
        client_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"kiln bench failed:\n{done.stdout}\n{done.stderr}")
        doc = json.loads(report.read_text())
    finally:
        server.stop()
    return {
        "seconds": doc["duration_s"],
        "server_cpu_s": server_cpu,  # model load excluded; the warm-up request included
        "client_cpu_s": client_cpu.ru_utime + client_cpu.ru_stime,  # the whole kiln bench
        "output_tokens": doc["total_output_tokens"],
        "output_tok_s": doc["output_throughput"],
        "failed": doc["failed"],
        "ttft_ms": doc["ttft_ms"],
        "tpot_ms": doc["tpot_ms"],
        "itl_ms": doc["itl_ms"],
        "e2el_ms": doc["e2el_ms"],
    }


def process_cpu(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_ticks() -> list[int]:
    """The machine's /proc/stat CPU counters (user nice system idle iowait irq softirq
    steal ...)."""
    return [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]


def steal_pct(before: list[int], after: list[int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to other guests meanwhile: on a
    shared VM a busy host slows every figure down, and not all of them equally."""
    delta = [b - a for a, b in zip(before, after, strict=True)]
    return 100.0 * delta[7] / max(sum(delta[:8]), 1)


def _with_steal(run: Any, *args: Any) -> dict[str, Any]:
    before = cpu_ticks()
    result: dict[str, Any] = run(*args)
    result["steal_pct"] = steal_pct(before, cpu_ticks())
    return result


def run_pairs(
    folder: Path, requests: list[Request], args: argparse.Namespace, hf: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Engine and transformers alternated ``args.pairs`` times: a slow spell of the host
    then hits one pair, not one side of every comparison."""
    block = int(args.block_sizes.split(",")[0])
    batch = max(hf, key=lambda r: r["output_tok_s"])["batch"]
    pairs = []
    for i in range(args.pairs):
        engine = _with_steal(run_engine, folder, requests, block)
        reference = _with_steal(run_transformers, folder, requests, batch)
        pair = {
            "engine_tok_s": engine["output_tok_s"],
            "hf_tok_s": reference["output_tok_s"],
            "ratio": engine["output_tok_s"] / reference["output_tok_s"],
            "ratio_cpu_s": reference["cpu_s"] / engine["cpu_s"],
            "steal_pct": (engine["steal_pct"], reference["steal_pct"]),
        }
        print(f"pair {i + 1}/{args.pairs}", json.dumps(pair), flush=True)
        pairs.append(pair)
    return pairs


def machine() -> dict[str, Any]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text()
                .splitlines() if line.startswith("model name")), platform.processor())  # fmt: skip
    return {"nproc": os.cpu_count(), "cpu": cpu, "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__, "loadavg_start": os.getloadavg()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--input-range", default="16:256", help="prompt lengths, uniform lo:hi")
    ap.add_argument("--output-range", default="16:256", help="output lengths, uniform lo:hi")
    ap.add_argument("--hf-batch-sizes", default="8,16,64")
    ap.add_argument("--block-sizes", default="16,8", help="engine runs (a), one per size")
    ap.add_argument("--skip", default="", help="comma list of: engine,http,hf")
    ap.add_argument(
        "--pairs",
        type=int,
        default=0,
        help="then N more engine (first block size) / transformers (best batch) runs, "
        "alternated: each pair's ratio and their median, less exposed to a noisy host",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lo_in, hi_in = (int(x) for x in args.input_range.split(":"))
    lo_out, hi_out = (int(x) for x in args.output_range.split(":"))
    requests = make_requests(args.num_requests, args.seed, (lo_in, hi_in), (lo_out, hi_out))
    skip = set(filter(None, args.skip.split(",")))
    workload = {
        "n": len(requests),
        "input": args.input_range,
        "output": args.output_range,
        "seed": args.seed,
        "prompt_tokens": sum(len(r.prompt) for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }
    report: dict[str, Any] = {"machine": machine(), "shape": SHAPE, "requests": workload}
    print(json.dumps(report, indent=1), flush=True)
    with tempfile.TemporaryDirectory(prefix="kiln-llm-bench-") as tmp:
        work = Path(tmp)
        folder = build_model(work / "repo" / "bench" / "1")
        if "engine" not in skip:
            report["engine"] = [_with_steal(run_engine, folder, requests, int(b))
                                for b in args.block_sizes.split(",")]  # fmt: skip
            print("engine", json.dumps(report["engine"], indent=1), flush=True)
        if "http" not in skip:
            report["http"] = _with_steal(run_http, folder, requests, work, 16)
            print("http", json.dumps(report["http"], indent=1), flush=True)
        if "hf" not in skip:
            report["transformers"] = [_with_steal(run_transformers, folder, requests, int(b))
                                      for b in args.hf_batch_sizes.split(",")]  # fmt: skip
            print("transformers", json.dumps(report["transformers"], indent=1), flush=True)
        if args.pairs and "engine" in report and "transformers" in report:
            report["pairs"] = run_pairs(folder, requests, args, report["transformers"])
    report["machine"]["loadavg_end"] = os.getloadavg()
    if "transformers" in report:
        best = max(report["transformers"], key=lambda r: r["output_tok_s"])
        report["ratios"] = {
            name: report[key][0]["output_tok_s"] / best["output_tok_s"] if key == "engine"
            else report[key]["output_tok_s"] / best["output_tok_s"]
            for name, key in (("engine_vs_hf", "engine"), ("http_vs_hf", "http")) if key in report
        }  # fmt: skip
        if "engine" in report:  # by CPU seconds: less disturbed by other load than wall time
            report["ratios"]["engine_vs_hf_cpu_s"] = best["cpu_s"] / report["engine"][0]["cpu_s"]
        if report.get("pairs"):
            ratios = sorted(p["ratio"] for p in report["pairs"])
            report["ratios"]["engine_vs_hf_pairs"] = ratios
            report["ratios"]["engine_vs_hf_pairs_median"] = statistics.median(ratios)
        print("ratios", report["ratios"])
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
