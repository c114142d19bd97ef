"""GPU benchmark of kiln's LLM engine (issues 8, 27): a ~1.1B-parameter Llama-shaped model
with random bf16 weights, built locally.

Measures, for each attention backend (``--backends``: ``triton``, kiln's Triton kernels, and
``flex``, the kernels off), in one run:
1. device memory bandwidth: a large device-to-device copy (bytes read + written / s);
2. decode tokens/s at batch 1, as a fraction of the bandwidth bound (each decode step reads
   every weight once: bound = bandwidth / model bytes), with CUDA graphs (``--eager``: also
   without);
3. output tokens/s with 64 concurrent requests, in-process (``LLMEngine``) and over the
   OpenAI API (``kiln serve --model`` + ``kiln bench --openai``, the same token-id prompts,
   ``ignore_eos``), with TTFT / TPOT; and ``transformers`` ``generate`` on the same GPU
   (``--skip-transformers`` leaves it out);
4. a ``torch.profiler`` (CPU + CUDA) summary of batch-1 decode steps: host wall time per step
   against GPU kernel time per step, and the kernels that take the most GPU time
   (``--trace FILE``: the Chrome trace too).

    python3 benchmarks/llm_gpu.py --json llm_gpu.json     # scripts/gpu_check.sh runs it

Needs a CUDA GPU (a CUDA build of torch with Triton); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# tests.conftest's KilnProcess starts `kiln serve`: the repository root on the path
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

SHAPE: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=2048,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
    bos_token_id=1,
    eos_token_id=2,
)


def build_model(folder: Path) -> int:
    """Random bf16 weights (std 0.02) in Hugging Face's layout, and a word-level tokenizer
    covering the vocabulary (``kiln serve`` needs one); returns the weight bytes."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(SHAPE["vocab_size"])}
    vocab["</s>"] = 2
    del vocab["w2"]
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))

    h, inter, kv = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_key_value_heads"]
    head_dim = h // SHAPE["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (SHAPE["vocab_size"], h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (SHAPE["vocab_size"], h)
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv * head_dim, h),
            p + "self_attn.v_proj.weight": (kv * head_dim, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=torch.bfloat16, device="cuda")
        else:
            t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
        tensors[name] = t.cpu()
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(SHAPE))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def bandwidth_bytes_per_s(gib: float = 2.0, iters: int = 20) -> float:
    import torch

    n = int(gib * 2**30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000
    return 2 * n * 2 * iters / seconds  # each copy reads and writes n bf16 values


def kiln_engine(
    folder: Path, max_num_seqs: int, eager: bool, kv_gib: float, backend: str,
    device: str = "cuda",
) -> Any:  # fmt: skip
    """One engine per backend serves every in-process measurement (each load captures the
    CUDA graphs and compiles flex's prefill shapes: the device time goes to measuring)."""
    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine

    config = EngineConfig(
        dtype="bfloat16",
        device=device,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=int(kv_gib * 2**30),
        enforce_eager=eager,
        # the warm-up runs the same prompts: no cached prefixes, prefill is measured too
        enable_prefix_caching=False,
        attention_backend=backend,
    )
    return LLMEngine(folder, config)


def kiln_run(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, float]:
    """Output tokens/s over the whole run and decode tokens/s after every prefill."""
    import torch

    from kiln.llm.sequence import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    # warm-up with the measured shapes: flex kernels compile on their first batch shapes
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens = 0
    decode_tokens, decode_start = 0, 0.0
    started: set[str] = set()  # requests that have their first token
    while engine.has_work():
        outputs = engine.step()
        step_tokens = sum(len(o.new_token_ids) for o in outputs)
        tokens += step_tokens
        if decode_start:
            decode_tokens += step_tokens
            continue
        started.update(o.request_id for o in outputs if o.new_token_ids)
        if len(started) == len(prompts):  # every prompt has its first token: decode from here
            torch.cuda.synchronize()
            decode_start = time.perf_counter()
    torch.cuda.synchronize()
    end = time.perf_counter()
    return {
        "output_tokens_per_s": tokens / (end - start),
        "decode_tokens_per_s": decode_tokens / (end - decode_start) if decode_start else 0.0,
    }


def hf_run(folder: Path, prompts: list[list[int]], output_len: int) -> float:
    """``transformers`` ``generate`` on the same batch (equal-length prompts: no padding)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=torch.bfloat16, device_map="cuda"
    ).eval()
    ids = torch.tensor(prompts, device="cuda")
    kwargs: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids),
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    with torch.no_grad():
        model.generate(ids, **(kwargs | {"max_new_tokens": 8, "min_new_tokens": 8}))  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids, **kwargs)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / seconds


def openai_run(
    folder: Path,
    prompts: list[list[int]],
    output_len: int,
    kv_gib: float,
    backend: str,
    work: Path,
) -> dict[str, Any]:
    """``kiln serve --model`` (CUDA graphs) + ``kiln bench --openai`` at max concurrency =
    number of prompts: the same prompts as token ids, ``ignore_eos``."""
    from tests.conftest import KilnProcess

    n = str(len(prompts))
    served = work / f"serve-{backend}"
    served.mkdir()
    args = ["--model", str(folder), "--served-model-name", "bench", "--dtype", "bfloat16",
            "--attention-backend", backend, "--max-num-seqs", n,
            "--max-num-batched-tokens", "8192", "--kv-cache-memory", f"{int(kv_gib * 2**30)}",
            "--no-enable-prefix-caching", "--no-history"]  # fmt: skip
    server = KilnProcess(served, args=args, with_repository=False, log_path=served / "kiln.log")

    def bench(tokens: int, report: Path) -> dict[str, Any]:
        dataset = work / f"prompts-{tokens}.jsonl"
        dataset.write_text("".join(json.dumps({"prompt": p, "max_tokens": tokens}) + "\n"
                                   for p in prompts))  # fmt: skip
        cmd = [sys.executable, "-m", "kiln", "bench", "--openai", f"http://{server.http_url}",
               "--model", "bench", "--dataset", str(dataset), "--num-prompts", n,
               "--max-concurrency", n, "--ignore-eos", "--json", str(report)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"kiln bench failed:\n{done.stdout}\n{done.stderr}")
        doc: dict[str, Any] = json.loads(report.read_text())
        return doc

    from stream_events import _cpu  # the server's and its engine process's CPU seconds

    try:
        server.start(timeout=300)  # loading, profiling, flex compiles, graph capture
        bench(8, work / f"warmup-{backend}.json")  # the batch's prefill shapes compile here
        assert server.proc is not None
        before = _cpu(server.proc.pid)
        doc = bench(output_len, work / f"bench-{backend}.json")
        after = _cpu(server.proc.pid)
    finally:
        server.stop()
    done = [r for r in doc["requests"] if not r["error"]]
    tokens = max(sum(r["output_tokens"] for r in done), 1)
    return {
        "output_tokens_per_s": doc["output_throughput"],
        "failed": doc["failed"],
        "ttft_ms": doc["ttft_ms"],
        "tpot_ms": doc["tpot_ms"],
        "duration_s": doc["duration_s"],
        # the server's own CPU per token (HTTP, detokenizing, SSE) and how many tokens an
        # event carried: above 1 where the server fell behind the engine and merged steps
        "server_cpu_us_per_token": 1e6 * (after[0] - before[0]) / tokens,
        "engine_cpu_us_per_token": 1e6 * (after[1] - before[1]) / tokens,
        "tokens_per_event": tokens / max(sum(r["chunks"] for r in done), 1),
    }


def _device_us(event: Any) -> float:
    # torch renamed the CUDA columns "device" (2.4); older builds keep "cuda"
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def profile_decode(
    engine: Any, steps: int = 8, trace: Path | None = None, eager: bool = False
) -> dict[str, Any]:
    """``steps`` batch-1 decode steps under ``torch.profiler`` (CPU + CUDA): host wall time
    per step, GPU kernel time per step, and the kernels that took the most GPU time.
    ``eager``: the engine's CUDA graphs set aside meanwhile (every kernel launched from
    Python, as the profiler sees it best)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from kiln.llm.sequence import SamplingParams

    graphs = engine.runner.graphs
    if eager:
        engine.runner.graphs = None
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    engine.add_request(f"profiled-{eager}", list(range(3, 131)), params)
    for _ in range(16):  # the prefill, then warm decode steps
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    while engine.has_work():  # the request's remaining tokens
        engine.step()
    engine.runner.graphs = graphs
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    events = prof.key_averages()
    # the kernels themselves (CUDA entries), not the CPU ops their time is also booked to
    kernels = sorted(
        ((e.key, _device_us(e), e.count) for e in events
         if e.device_type == DeviceType.CUDA and _device_us(e) > 0),
        key=lambda k: -k[1],
    )  # fmt: skip
    gpu_us = sum(us for _, us, _ in kernels)
    return {
        "steps": steps,
        "wall_ms_per_step": 1e3 * wall / steps,
        "gpu_kernel_ms_per_step": gpu_us / 1e3 / steps,
        "top_kernels": [
            {"name": k[:90], "ms_per_step": us / 1e3 / steps, "calls_per_step": c / steps}
            for k, us, c in kernels[:12]
        ],
        "cpu_table": events.table(sort_by="self_cpu_time_total", row_limit=12),
    }


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument(
        "--backends",
        default="triton,flex",
        help="attention backends to compare (triton: kiln's kernels; flex: off)",
    )
    ap.add_argument("--eager", action="store_true", help="also measure without CUDA graphs")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-openai", action="store_true")
    ap.add_argument("--skip-profile", action="store_true")
    ap.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write the first backend's profiled decode steps as a Chrome trace",
    )
    ap.add_argument("--json", type=Path, default=Path("llm_gpu.json"))
    args = ap.parse_args(argv)  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks/llm_gpu.py needs a CUDA GPU (and a CUDA build of torch); "
            f"torch {torch.__version__} sees none",
            file=sys.stderr,
        )
        return 2
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))  # for kiln serve / kiln bench
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(
        3, SHAPE["vocab_size"], (args.concurrency, args.prompt_len), generator=gen
    ).tolist()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    result |= {k: getattr(args, k) for k in ("prompt_len", "output_len", "concurrency")}
    rows = []
    profiles: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        folder.mkdir()
        model_bytes = build_model(folder)
        bandwidth = bandwidth_bytes_per_s()
        bound = bandwidth / model_bytes
        _log(f"model {model_bytes / 1e9:.2f} GB, copy {bandwidth / 1e9:.0f} GB/s")
        result |= {"model_bytes": model_bytes, "bandwidth_bytes_per_s": bandwidth}
        result["decode_bound_tokens_per_s"] = bound
        for backend in backends:
            for eager in (False, True) if args.eager else (False,):
                name = f"{backend}, {'eager' if eager else 'CUDA graphs'}"
                engine = kiln_engine(folder, len(prompts), eager, args.kv_cache_gib, backend)
                one = kiln_run(engine, prompts[:1], args.output_len)
                many = kiln_run(engine, prompts, args.output_len)
                _log(f"{name}: batch-1 decode {one['decode_tokens_per_s']:.0f} tok/s "
                     f"({100 * one['decode_tokens_per_s'] / bound:.0f}% of {bound:.0f}), "
                     f"c={len(prompts)} {many['output_tokens_per_s']:.0f} tok/s")  # fmt: skip
                entry: dict[str, Any] = {"batch1": one, f"concurrency{args.concurrency}": many}
                if not eager and not args.skip_profile:
                    trace = args.trace if args.trace and not profiles else None
                    profiles[f"{backend}, CUDA graphs"] = profile_decode(engine, trace=trace)
                    profiles[f"{backend}, eager"] = profile_decode(engine, eager=True)
                del engine
                torch.cuda.empty_cache()
                http = None
                if not eager and not args.skip_openai:
                    http = openai_run(folder, prompts, args.output_len, args.kv_cache_gib,
                                      backend, Path(tmp))  # fmt: skip
                    entry["openai"] = http
                    _log(f"{name}: OpenAI API c={len(prompts)} "
                         f"{http['output_tokens_per_s']:.0f} tok/s, server "
                         f"{http['server_cpu_us_per_token']:.1f} us CPU/token, "
                         f"{http['tokens_per_event']:.2f} tokens/event")  # fmt: skip
                result[f"kiln {name}"] = entry
                # each finished backend is on disk: a device call cut short keeps it
                args.json.write_text(json.dumps(result, indent=2))
                rows.append((f"kiln ({name})", one["decode_tokens_per_s"],
                             many["output_tokens_per_s"], http))  # fmt: skip
        if not args.skip_transformers:
            hf_one = hf_run(folder, prompts[:1], args.output_len)
            hf_many = hf_run(folder, prompts, args.output_len)
            result["transformers"] = {"batch1": hf_one, f"concurrency{args.concurrency}": hf_many}
            rows.append(("transformers generate", hf_one, hf_many, None))
    result["profiles"] = {b: {k: v for k, v in p.items() if k != "cpu_table"}
                          for b, p in profiles.items()}  # fmt: skip
    print(
        f"\n{result['device']} (torch {result['torch']}, triton {result['triton']}): model "
        f"{model_bytes / 1e9:.2f} GB bf16, copy bandwidth {bandwidth / 1e9:.0f} GB/s, batch-1 "
        f"decode bound {bound:.0f} tok/s"
    )
    c = args.concurrency
    print(f"| engine | batch-1 decode tok/s | % of bound | c={c} output tok/s in-process | "
          f"c={c} output tok/s OpenAI API | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|")
    for name, one_rate, many_rate, http in rows:
        api = ttft = tpot = "—"
        if http is not None:
            api = f"{http['output_tokens_per_s']:.0f}"
            ttft = f"{http['ttft_ms']['p50']:.0f} / {http['ttft_ms']['p99']:.0f}"
            tpot = f"{http['tpot_ms']['p50']:.1f} / {http['tpot_ms']['p99']:.1f}"
        print(f"| {name} | {one_rate:.0f} | {100 * one_rate / bound:.0f}% | {many_rate:.0f} | "
              f"{api} | {ttft} | {tpot} |")  # fmt: skip
    for backend, prof in profiles.items():
        print(
            f"\ntorch.profiler, batch-1 decode, {backend}: "
            f"{prof['wall_ms_per_step']:.2f} ms wall per step, "
            f"{prof['gpu_kernel_ms_per_step']:.2f} ms of GPU kernels per step "
            f"({100 * prof['gpu_kernel_ms_per_step'] / prof['wall_ms_per_step']:.0f}% busy)"
        )
        print("| kernel | GPU ms / step | calls / step |\n|---|--:|--:|")
        for k in prof["top_kernels"]:
            print(f"| `{k['name']}` | {k['ms_per_step']:.3f} | {k['calls_per_step']:.0f} |")
        print(f"host side (CPU self time, {prof['steps']} steps):\n{prof['cpu_table']}")
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
