"""Where a CPU step's time goes: kiln's engine and vLLM's CPU build on the same model and
the same 64 requests (issue 27, "find where the 1.33x goes").

    # build the model once (kiln's venv), then each engine on it
    PYTHONPATH=src .venv/bin/python benchmarks/llm_cpu_profile.py build --model /tmp/m125
    PYTHONPATH=src .venv/bin/python benchmarks/llm_cpu_profile.py kiln --model /tmp/m125
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \\
      .bench/vllm/bin/python benchmarks/llm_cpu_profile.py vllm --model /tmp/m125

The model: ``benchmarks/llm_vllm.py``'s ``125m`` Llama shape (hidden 768, 12 layers, 12
query and 4 KV heads, MLP 2,048, vocabulary 32,000, untied embeddings: 125 M parameters,
75 M outside the embeddings and LM head) with random weights. The workload:
``benchmarks/llm_cpu.py``'s (64 requests, prompts and outputs of 16..256 tokens, seed 0,
greedy, ``ignore_eos``).

``kiln``: runs the whole workload with ``LLMEngine.step()`` and reports output tok/s, the
process's CPU seconds, and each step's wall time split into the model's forward pass
(``ModelRunner._eager``), sampling, and everything else (scheduling, inputs, outputs: the
Python around the model); then ``torch.profiler`` over one decode step of the full batch
and over the first (prefill) step, printed as op tables (self CPU time).

``vllm``: the same workload through ``vllm.LLM.generate`` in one process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and its worker run here, so their CPU
time is this process's and the profiler sees them); ``--profile`` wraps the whole run in
``torch.profiler`` (the op table divided by the steps compares with kiln's per step).

Threads: ``OMP_NUM_THREADS`` (default 1 here, as in ``llm_cpu.py``); vLLM is given the
same count (``VLLM_CPU_OMP_THREADS_BIND``, ``nobind`` unless set). ``--no-packed``: kiln without
``kiln.llm.cpu_linear`` (the A/B's "before").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

SHAPE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
)


def make_requests(n: int, seed: int, lo: int, hi: int, vocab: int) -> list[tuple[list[int], int]]:
    """``llm_cpu.py``'s workload: (prompt, output length) pairs."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(n)
    ]


def build(folder: Path, kv_heads: int) -> None:
    import torch
    import transformers

    shape = dict(SHAPE, num_key_value_heads=kv_heads)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**shape, eos_token_id=2, bos_token_id=1)
    model = transformers.LlamaForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(folder), safe_serialization=True)
    # vLLM wants a tokenizer even with skip_tokenizer_init off; a word-level one suffices
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(shape["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2"}))
    params = sum(p.numel() for p in model.parameters())
    print(f"built {folder}: {params / 1e6:.1f} M parameters", flush=True)


def _table(prof: Any, rows: int, per: int = 1) -> str:
    table: str = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
    return table if per == 1 else f"(totals over {per} steps)\n{table}"


class SelfTimes:
    """Self CPU seconds (this thread's) of wrapped functions, nested calls subtracted: where a
    step's CPU goes, robust to other load on the machine (unlike wall time)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        #: the step's kind: "prefill" (any prompt token in it) or "decode"; keys are per kind
        self.phase = "decode"
        self.stack: list[list[float]] = []  # [start, children's inclusive time]

    def wrap(self, name: Any, fn: Any) -> Any:
        """``name``: a string, or a function of the call's first argument giving one."""
        clock = time.thread_time

        def wrapper(*a: Any, **k: Any) -> Any:
            frame = [clock(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                inclusive = clock() - frame[0]
                self.stack.pop()
                if self.stack:
                    self.stack[-1][1] += inclusive
                key = name if isinstance(name, str) else name(a[0] if a else None)
                key = f"{self.phase}: {key}"
                self.totals[key] = self.totals.get(key, 0.0) + inclusive - frame[1]
                self.calls[key] = self.calls.get(key, 0) + 1

        return wrapper

    def install(self, engine: Any) -> None:
        import torch.nn.functional as F
        from torch import nn

        from kiln.llm import attention, attention_cpu, cpu_ops, model_runner
        from kiln.llm.models import llama

        roles = {id(m): n.rsplit(".", 1)[-1] for n, m in engine.runner.model.named_modules()}
        linear = nn.Linear.forward
        nn.Linear.forward = self.wrap(  # type: ignore[method-assign]
            lambda m: f"linear {roles.get(id(m), '?')}", linear
        )
        from kiln.llm import cpu_linear

        cpu_linear.PackedLinear.forward = self.wrap(  # type: ignore[method-assign]
            lambda m: f"linear {roles.get(id(m), '?')}", cpu_linear.PackedLinear.forward
        )
        attention_cpu.decode = self.wrap("attention: decode kernel (numba)", attention_cpu.decode)
        attention.attend = self.wrap("attention: prefill SDPA", attention.attend)
        attention.paged_attention = self.wrap("attention: other", attention.paged_attention)
        llama.paged_attention = attention.paged_attention
        for fn in ("add_rms_norm", "rms_norm", "rotate_"):
            setattr(cpu_ops, fn, self.wrap(f"cpu_ops.{fn} (numba)", getattr(cpu_ops, fn)))
        F.silu = self.wrap("mlp: silu", F.silu)
        llama.MLP.forward = self.wrap("mlp: other (mul, chunk)", llama.MLP.forward)
        llama.Attention.forward = self.wrap("attention layer: other", llama.Attention.forward)
        llama.LlamaForCausalLM.forward = self.wrap(
            "model: other (embedding, rope lookup, rows)", llama.LlamaForCausalLM.forward
        )
        runner = engine.runner
        runner._eager = self.wrap("runner: metadata, input tensors", runner._eager)
        model_runner.sample = self.wrap("sampler", model_runner.sample)
        runner.run = self.wrap("runner: other (input lists)", runner.run)
        engine.step = self.wrap("engine: schedule, outputs", engine.step)

    def report(self, steps: dict[str, int]) -> str:
        lines = []
        for phase, count in steps.items():
            mine = {k: t for k, t in self.totals.items() if k.startswith(f"{phase}: ")}
            total = sum(mine.values())
            if not count or not total:
                continue
            lines.append(f"{phase + ' steps: ' + str(count):<56} {'s':>7} {'%':>6} "
                         f"{'ms/step':>8} {'calls':>7}")  # fmt: skip
            for name, t in sorted(mine.items(), key=lambda kv: -kv[1]):
                lines.append(f"{name:<56} {t:7.2f} {100 * t / total:6.1f} "
                             f"{1e3 * t / count:8.2f} {self.calls[name]:7d}")  # fmt: skip
            lines.append(f"{phase + ': total':<56} {total:7.2f} {'':6} {1e3 * total / count:8.2f}")
        return "\n".join(lines)


def _median_ms(steps: list[dict[str, Any]], key: str) -> float | None:
    return 1e3 * sorted(s[key] for s in steps)[len(steps) // 2] if steps else None


def run_kiln(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import SamplingParams

    if args.no_packed:  # the A/B's "before": every projection through F.linear
        from kiln.llm import cpu_linear

        cpu_linear.pack = lambda model: 0
    engine = LLMEngine(args.model, EngineConfig(max_num_seqs=len(requests)))
    engine.generate([requests[0][0][:8]], SamplingParams(max_tokens=2, temperature=0.0))
    runner = engine.runner
    timers = {"forward": 0.0}
    eager = runner._eager

    def timed_eager(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return eager(*a, **k)
        finally:
            timers["forward"] += time.perf_counter() - t0

    runner._eager = timed_eager  # type: ignore[method-assign]
    times = SelfTimes()
    if args.breakdown:
        times.install(engine)
    for i, (prompt, n) in enumerate(requests):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
    steps: list[dict[str, Any]] = []
    tokens = 0
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    profiled: dict[str, str] = {}
    cpu0, t0 = time.process_time(), time.perf_counter()
    while engine.has_work() and len(steps) < args.max_steps:
        sched = engine.scheduler
        decode_only = not sched.waiting and all(
            s.num_computed_tokens == s.num_tokens - 1 for s in sched.running
        )
        want = None
        if args.profile and not steps:
            want = "prefill"
        elif (
            args.profile
            and decode_only
            and "decode" not in profiled
            and len(sched.running) == len(requests)
        ):
            want = "decode"
        timers["forward"] = 0.0
        times.phase = "decode" if decode_only else "prefill"
        s0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        if want:
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                outs = engine.step()
            profiled[want] = _table(prof, args.rows)
        else:
            outs = engine.step()
        wall = time.perf_counter() - s0
        steps.append({"wall": wall, "cpu": time.thread_time() - c0,
                      "process_cpu": time.process_time() - p0,
                      "forward": timers["forward"], "decode": decode_only,
                      "batch": len(outs)})  # fmt: skip
        tokens += sum(len(o.new_token_ids) for o in outs)
        for o in outs:
            ids[o.request_id].extend(o.new_token_ids)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    for name, table in profiled.items():
        print(f"\n=== kiln: one {name} step ===\n{table}", flush=True)
    if args.tokens_out:
        Path(args.tokens_out).write_text(json.dumps(list(ids.values())))
    if args.steps_out:
        Path(args.steps_out).write_text(json.dumps(steps))
    if args.breakdown:
        kinds = {"decode": sum(s["decode"] for s in steps),
                 "prefill": sum(not s["decode"] for s in steps)}  # fmt: skip
        print(f"\n=== kiln: self CPU over the run ===\n{times.report(kinds)}", flush=True)
    dec = [s for s in steps if s["decode"]]
    result = {
        "engine": "kiln",
        "threads": torch.get_num_threads(),
        "output_tokens": tokens,
        "seconds": seconds,
        "cpu_s": cpu,
        "output_tok_s": tokens / seconds,
        "steps": len(steps),
        "decode_steps": len(dec),
        "preemptions": engine.scheduler.num_preemptions,
        "forward_s": sum(s["forward"] for s in steps),
        "outside_forward_s": sum(s["wall"] - s["forward"] for s in steps),
        "decode_ms_median": _median_ms(dec, "wall"),
        # every thread's CPU (OpenMP and numba workers too): spinning shows here, not in wall
        "decode_cpu_ms_median": _median_ms(dec, "process_cpu"),
        "prefill_cpu_s": sum(s["process_cpu"] for s in steps if not s["decode"]),
    }
    return result


def run_vllm(args: argparse.Namespace, requests: list[tuple[list[int], int]]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=str(args.model),
        dtype="float32",
        max_num_seqs=len(requests),
        seed=0,
        enforce_eager=args.enforce_eager,
    )
    llm.generate([TokensPrompt(prompt_token_ids=requests[0][0][:8])],
                 SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)  # fmt: skip
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in requests]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for _, n in requests]
    cpu0, t0 = time.process_time(), time.perf_counter()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            outs = llm.generate(prompts, params, use_tqdm=False)
        print(f"\n=== vLLM: whole run ===\n{_table(prof, args.rows)}", flush=True)
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if args.tokens_out:
        Path(args.tokens_out).write_text(json.dumps([list(o.outputs[0].token_ids) for o in outs]))
    return {"engine": "vllm", "threads": torch.get_num_threads(), "output_tokens": tokens,
            "seconds": seconds, "cpu_s": cpu, "output_tok_s": tokens / seconds}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["build", "kiln", "vllm"])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--kv-heads", type=int, default=SHAPE["num_key_value_heads"])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--range", default="16:256", help="prompt and output lengths, lo:hi")
    ap.add_argument("--profile", action="store_true", help="torch.profiler op tables")
    ap.add_argument(
        "--breakdown",
        action="store_true",
        help="kiln: self CPU seconds per part of the step over the whole run",
    )
    ap.add_argument(
        "--max-steps",
        type=int,
        default=1 << 30,
        help="kiln: stop after this many steps (a shorter profile)",
    )
    ap.add_argument(
        "--no-packed",
        action="store_true",
        help="kiln: no oneDNN packed projections (kiln.llm.cpu_linear)",
    )
    ap.add_argument(
        "--steps-out", default=None, help="kiln: write each step's wall, CPU and batch here (JSON)"
    )
    ap.add_argument("--rows", type=int, default=25, help="rows of each op table")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM: no torch.compile")
    ap.add_argument(
        "--tokens-out", default=None, help="write the output ids here (kiln's and vLLM's compared)"
    )
    args = ap.parse_args()
    if args.what == "build":
        build(args.model, args.kv_heads)
        return
    lo, hi = (int(x) for x in args.range.split(":"))
    vocab = json.loads((args.model / "config.json").read_text())["vocab_size"]
    requests = make_requests(args.num_requests, args.seed, lo, hi, vocab)
    run = run_kiln if args.what == "kiln" else run_vllm
    result = run(args, requests)
    result["loadavg"] = os.getloadavg()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
