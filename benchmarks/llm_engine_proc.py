"""The LLM engine on a thread of the server vs in its own process (``enable_multiprocessing``):
output tok/s and CPU seconds, offline (64 concurrent ``EngineClient.generate`` in this
process) and over HTTP (``kiln serve`` + ``kiln bench --openai``), modes alternated.

    .venv/bin/python benchmarks/llm_engine_proc.py --json engine_proc.json
    .venv/bin/python benchmarks/llm_engine_proc.py --shape 125m --num-requests 16 \
        --output-range 16:64
    .venv/bin/python benchmarks/llm_engine_proc.py --lora   # every request with an adapter

Shapes: ``5m`` (benchmarks/llm_cpu.py's model) and ``125m`` (a 110M-parameter Llama of
the 125M class, random weights). CPU seconds count the server process and, in process
mode, the engine process; the load generator's are left out. Threads: the engine's
intra-op threads follow ``OMP_NUM_THREADS``, which this script sets to the machine's size
unless given.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

# both modes get one intra-op thread per CPU unless the caller says otherwise (llm_cpu
# would set 1 on import)
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))
import llm_cpu  # noqa: E402  (its model builder, request mix and /proc readers)

SHAPES = {
    "5m": dict(llm_cpu.SHAPE),
    "125m": dict(
        vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=2048,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
CONFIG = """name: "bench"
backend: "llm"
instance_group {{ kind: KIND_CPU count: 1 }}
parameters {{ key: "block_size" value {{ string_value: "16" }} }}
parameters {{ key: "max_num_seqs" value {{ string_value: "{seqs}" }} }}
parameters {{ key: "dtype" value {{ string_value: "float32" }} }}
parameters {{ key: "enable_multiprocessing" value {{ string_value: "{mp}" }} }}
"""
#: ``--lora``: a rank-8 adapter on every projection, served as "adapter"
LORA_CONFIG = """parameters {{ key: "enable_lora" value {{ string_value: "true" }} }}
parameters {{ key: "lora_modules" value {{ string_value: "adapter={path}" }} }}
parameters {{ key: "max_lora_rank" value {{ string_value: "8" }} }}
"""


def _config(requests: list[llm_cpu.Request], mp: bool, lora: Path | None) -> str:
    text = CONFIG.format(seqs=len(requests), mp=str(mp).lower())
    return text + (LORA_CONFIG.format(path=lora) if lora is not None else "")


def _children_cpu() -> float:
    """CPU seconds of this process's live children (the engine process)."""
    total = 0.0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children = (task / "children").read_text().split()
        total += sum(llm_cpu.process_cpu(int(pid)) for pid in children)
    return total


async def _offline(
    folder: Path, requests: list[llm_cpu.Request], mp: bool, lora: Path | None
) -> dict[str, Any]:
    from kiln.config.loader import parse_config_text
    from kiln.llm.backend import LLMBackend
    from kiln.llm.sequence import SamplingParams
    from kiln.server.runtime import ModelRuntime

    config = parse_config_text(_config(requests, mp, lora))
    LLMBackend.auto_complete_config(config, folder)
    runtime = ModelRuntime("bench", 1, config, folder, LLMBackend)
    await runtime.load()
    client = runtime.llm_engine()
    if lora is not None:
        assert client.loras is not None
        client = client.with_lora(client.loras.named("adapter"))

    async def one(i: int, r: llm_cpu.Request) -> int:
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        n = 0
        async for out in client.generate(r.prompt, params, f"r{i}"):
            n += len(out.new_token_ids)
        return n

    await one(-1, llm_cpu.Request(requests[0].prompt[:8], 2))  # warm-up
    cpu0, child0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
    seconds = time.perf_counter() - t0
    cpu, child = time.process_time() - cpu0, _children_cpu() - child0
    await runtime.unload(0)
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "server_cpu_s": cpu, "engine_proc_cpu_s": child, "cpu_s": cpu + child}  # fmt: skip


def _http(
    folder: Path, requests: list[llm_cpu.Request], mp: bool, work: Path, lora: Path | None
) -> dict[str, Any]:
    from tests.conftest import KilnProcess

    repo = folder.parent.parent
    (repo / "bench" / "config.pbtxt").write_text(_config(requests, mp, lora))
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": r.prompt, "max_tokens": r.output_len}) + "\n"
                               for r in requests))  # fmt: skip
    server = KilnProcess(repo, args=["--no-history"], log_path=work / f"kiln-{mp}.log")
    try:
        server.start(timeout=300)
        assert server.proc is not None
        pid = server.proc.pid

        def tree_cpu() -> float:
            # the engine process is the child of the thread that loaded the model
            kids = [c for t in Path(f"/proc/{pid}/task").iterdir()
                    for c in (t / "children").read_text().split()]  # fmt: skip
            return llm_cpu.process_cpu(pid) + sum(llm_cpu.process_cpu(int(c)) for c in kids)

        report = work / "bench.json"
        n = str(len(requests))
        model = "adapter" if lora is not None else "bench"
        cmd = [sys.executable, "-m", "kiln", "bench", "--openai", f"http://{server.http_url}",
               "--model", model, "--dataset", str(dataset), "--num-prompts", n,
               "--max-concurrency", n, "--ignore-eos", "--json", str(report)]  # fmt: skip
        cpu0 = tree_cpu()
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        cpu = tree_cpu() - cpu0
        if done.returncode != 0:
            raise RuntimeError(f"kiln bench failed:\n{done.stdout}\n{done.stderr}")
        doc = json.loads(report.read_text())
    finally:
        server.stop()
    return {"output_tok_s": doc["output_throughput"], "seconds": doc["duration_s"],
            "output_tokens": doc["total_output_tokens"], "failed": doc["failed"],
            "cpu_s": cpu, "ttft_ms": doc["ttft_ms"], "tpot_ms": doc["tpot_ms"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="5m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-range", default="16:256")
    ap.add_argument("--output-range", default="16:256")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--skip", default="", help="comma list of: offline,http")
    ap.add_argument("--modes", default="process,thread", help="comma list of: process,thread")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--lora", action="store_true", help="every request with a LoRA adapter")
    args = ap.parse_args()
    llm_cpu.SHAPE.clear()
    llm_cpu.SHAPE.update(SHAPES[args.shape])
    lo_in, hi_in = (int(x) for x in args.input_range.split(":"))
    lo_out, hi_out = (int(x) for x in args.output_range.split(":"))
    requests = llm_cpu.make_requests(args.num_requests, 0, (lo_in, hi_in), (lo_out, hi_out))
    work = Path(tempfile.mkdtemp(prefix="engine-proc-"))
    folder = llm_cpu.build_model(work / "repo" / "bench" / "1")
    lora = None
    if args.lora:
        from tests.llm_models import build_lora_adapter

        lora = build_lora_adapter(folder, work / "adapter", seed=0)
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for how in ("offline", "http"):
            if how in args.skip:
                continue
            modes = [m == "process" for m in args.modes.split(",")]
            for mp in modes if repeat % 2 == 0 else modes[::-1]:
                load = os.getloadavg()[0]
                if how == "offline":
                    result = asyncio.run(_offline(folder, requests, mp, lora))
                else:
                    result = _http(folder, requests, mp, work, lora)
                result.update(
                    how=how,
                    process=mp,
                    lora=lora is not None,
                    repeat=repeat,
                    load1=load,
                    omp_wait_policy=os.environ.get("OMP_WAIT_POLICY", "default"),
                )
                print(json.dumps(result), flush=True)
                runs.append(result)
    doc = {"shape": args.shape, "machine": llm_cpu.machine(), "args": vars(args) | {"json": None},
           "runs": runs}  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
