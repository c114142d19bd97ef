"""GPU benchmark of kiln's LLM engine (issue 8): a ~1.1B-parameter Llama-shaped model with
random bf16 weights, built locally.

Measures
1. device memory bandwidth: a large device-to-device copy (bytes read + written / s);
2. decode tokens/s at batch 1, as a fraction of the bandwidth bound (each decode step reads
   every weight once: bound = bandwidth / model bytes), with CUDA graphs and eagerly;
3. output tokens/s with 64 concurrent requests, kiln's engine vs ``transformers``
   ``generate`` on the same GPU with the same batch.

    .venv/bin/python benchmarks/llm_gpu.py --json llm_gpu.json

Needs a CUDA GPU (a CUDA build of torch with Triton); elsewhere it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    """Random bf16 weights (std 0.02) in Hugging Face's layout; returns the weight bytes."""
    import torch
    from safetensors.torch import save_file

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


def kiln_run(
    folder: Path, prompts: list[list[int]], output_len: int, eager: bool, kv_gib: float
) -> dict[str, float]:
    """Output tokens/s over the whole run and decode tokens/s after every prefill."""
    import torch

    from kiln.llm.config import EngineConfig
    from kiln.llm.engine import LLMEngine
    from kiln.llm.sequence import SamplingParams

    config = EngineConfig(
        dtype="bfloat16",
        device="cuda",
        max_num_seqs=max(len(prompts), 1),
        max_num_batched_tokens=8192,
        kv_cache_memory_bytes=int(kv_gib * 2**30),
        enforce_eager=eager,
        # the warm-up runs the same prompts: no cached prefixes, prefill is measured too
        enable_prefix_caching=False,
    )
    engine = LLMEngine(folder, config)
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
    del engine
    torch.cuda.empty_cache()
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--kv-cache-gib", type=float, default=4.0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path, default=Path("llm_gpu.json"))
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(
            "benchmarks/llm_gpu.py needs a CUDA GPU (and a CUDA build of torch); "
            f"torch {torch.__version__} sees none",
            file=sys.stderr,
        )
        return 2
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(
        3, SHAPE["vocab_size"], (args.concurrency, args.prompt_len), generator=gen
    ).tolist()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    result |= {k: getattr(args, k) for k in ("prompt_len", "output_len", "concurrency")}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model_bytes = build_model(folder)
        bandwidth = bandwidth_bytes_per_s()
        bound = bandwidth / model_bytes
        result |= {"model_bytes": model_bytes, "bandwidth_bytes_per_s": bandwidth}
        result["decode_bound_tokens_per_s"] = bound
        rows = []
        for eager in (False, True):
            name = "eager" if eager else "cuda_graphs"
            one = kiln_run(folder, prompts[:1], args.output_len, eager, args.kv_cache_gib)
            many = kiln_run(folder, prompts, args.output_len, eager, args.kv_cache_gib)
            result[f"kiln_{name}"] = {"batch1": one, f"concurrency{args.concurrency}": many}
            rows.append((f"kiln ({name})", one["decode_tokens_per_s"], many["output_tokens_per_s"]))
        if not args.skip_transformers:
            hf_one = hf_run(folder, prompts[:1], args.output_len)
            hf_many = hf_run(folder, prompts, args.output_len)
            result["transformers"] = {"batch1": hf_one, f"concurrency{args.concurrency}": hf_many}
            rows.append(("transformers generate", hf_one, hf_many))
    print(
        f"\n{result['device']}: model {model_bytes / 1e9:.2f} GB bf16, "
        f"copy bandwidth {bandwidth / 1e9:.0f} GB/s, batch-1 decode bound {bound:.0f} tok/s"
    )
    print(f"| engine | batch-1 decode tok/s | % of bound | c={args.concurrency} output tok/s |")
    print("|---|--:|--:|--:|")
    for name, one_rate, many_rate in rows:
        print(f"| {name} | {one_rate:.0f} | {100 * one_rate / bound:.0f}% | {many_rate:.0f} |")
    args.json.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
