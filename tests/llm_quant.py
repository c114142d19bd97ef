"""Quantized checkpoints written at test time, as the hub's tools write them, from a tiny
random model: each writer returns the quantized folder and a float folder holding the
same weights dequantized (the reference ``transformers`` runs).

The packing is written plainly here (a loop over a word's eight nibbles), independently of
``kiln.llm.quantization.packing``, which the tests check against it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from tests.llm_models import build_tiny_llm

#: the projections a quantizer converts (lm_head and the embeddings stay as they are)
PROJECTIONS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
#: hidden 256 / intermediate 512: every projection's input spans two or more groups of 128
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def base_model(folder: Path) -> Path:
    return build_tiny_llm(folder, **SHAPE)  # type: ignore[arg-type]


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2**32) -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_columns(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] values 0..15 -> [R, C/8] int32: nibble i of word w holds column 8w + order[i]."""
    q = q.long()
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.long)
    for i in range(8):
        words |= q[:, order[i] :: 8] << (4 * i)
    return _to_int32(words)


def pack_rows(q: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> [R/8, C] int32: nibble i of word r holds row 8r + i."""
    q = q.long()
    words = torch.zeros(q.shape[0] // 8, q.shape[1], dtype=torch.long)
    for i in range(8):
        words |= q[i::8] << (4 * i)
    return _to_int32(words)


def _weights(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(src / "model.safetensors"))


def _projection_names(tensors: dict[str, torch.Tensor]) -> list[str]:
    return [
        n.removesuffix(".weight")
        for n in tensors
        if n.endswith(".weight") and any(p in n for p in PROJECTIONS)
    ]


def _write(
    src: Path,
    dst: Path,
    quantized: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
    quantization_config: dict[str, Any] | None,
) -> tuple[Path, Path]:
    from safetensors.torch import save_file

    qdir, rdir = dst / "quantized", dst / "reference"
    for folder, tensors, qc in ((qdir, quantized, quantization_config), (rdir, reference, None)):
        shutil.copytree(src, folder, ignore=shutil.ignore_patterns("*.safetensors"))
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, str(folder / "model.safetensors"))
        if qc is not None:
            config = json.loads((folder / "config.json").read_text())
            config["quantization_config"] = qc
            (folder / "config.json").write_text(json.dumps(config))
    return qdir, rdir


def write_fp8(src: Path, dst: Path, per_channel: bool, method: str = "fp8") -> tuple[Path, Path]:
    """``fp8`` (AutoFP8: a scalar weight_scale) or compressed-tensors ``float-quantized``;
    method ``fp8-block``: transformers' fine-grained FP8, a ``weight_scale_inv`` a tile of
    128 x 128."""
    tensors = _weights(src)
    quantized, reference = dict(tensors), dict(tensors)
    for name in _projection_names(tensors):
        w = tensors[f"{name}.weight"].float()
        if method == "fp8-block":
            n, k = w.shape
            tiles = w.reshape(n // 128, 128, k // 128, 128)
            scale = tiles.abs().amax(dim=(1, 3)) / 448.0  # [N/128, K/128]
            wq = (tiles / scale[:, None, :, None]).reshape(n, k).to(torch.float8_e4m3fn)
            quantized[f"{name}.weight"] = wq
            quantized[f"{name}.weight_scale_inv"] = scale
            tiled = wq.float().reshape(n // 128, 128, k // 128, 128)
            reference[f"{name}.weight"] = (tiled * scale[:, None, :, None]).reshape(n, k)
            continue
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max()
        scale = (amax / 448.0).float()
        wq = (w / scale).to(torch.float8_e4m3fn)
        quantized[f"{name}.weight"] = wq
        quantized[f"{name}.weight_scale"] = scale if per_channel else scale.reshape(())
        reference[f"{name}.weight"] = wq.float() * scale
    if method.startswith("fp8"):
        qc: dict[str, Any] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
        if method == "fp8-block":
            qc["weight_block_size"] = [128, 128]
    else:
        qc = _compressed(
            "float", "channel" if per_channel else "tensor", "float-quantized", activations=True
        )
    return _write(src, dst, quantized, reference, qc)


def _compressed(kind: str, strategy: str, fmt: str, activations: bool) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": strategy}
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    group["input_activations"] = (
        {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True}
        if activations
        else None
    )
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
    }


def write_int8(src: Path, dst: Path, per_channel: bool, w8a8: bool) -> tuple[Path, Path]:
    """compressed-tensors ``int-quantized``: int8 weights, weight_scale [N, 1] or [1]."""
    tensors = _weights(src)
    quantized, reference = dict(tensors), dict(tensors)
    for name in _projection_names(tensors):
        w = tensors[f"{name}.weight"].float()
        amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().max().reshape(1)
        scale = amax / 127.0
        q = (w / scale).round().clamp(-128, 127).to(torch.int8)
        quantized[f"{name}.weight"] = q
        quantized[f"{name}.weight_scale"] = scale
        reference[f"{name}.weight"] = q.float() * scale
    qc = _compressed("int", "channel" if per_channel else "tensor", "int-quantized", w8a8)
    return _write(src, dst, quantized, reference, qc)


def _int4_groups(
    w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> q [N, K] (0..15), scale and zero [G, N] (scales rounded to fp16, as
    stored)."""
    n = w.shape[0]
    scale, zero = torch.zeros(groups, n), torch.zeros(groups, n)
    for g in range(groups):
        cols = w[:, g_idx == g]
        lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
        if sym:
            s = torch.maximum(-lo, hi) * 2 / 15
            z = torch.full_like(s, 8.0)
        else:
            s = (hi - lo) / 15
            z = (-lo / s).round()
        scale[g], zero[g] = s.half().float(), z
    s_k, z_k = scale[g_idx].t(), zero[g_idx].t()
    q = (w / s_k + z_k).round().clamp(0, 15)
    return q.to(torch.uint8), scale, zero


def write_awq(src: Path, dst: Path, group_size: int = 128) -> tuple[Path, Path]:
    """AutoAWQ's GEMM layout: qweight [K, N/8], qzeros [K/G, N/8], scales [K/G, N] fp16."""
    tensors = _weights(src)
    quantized, reference = dict(tensors), dict(tensors)
    for name in _projection_names(tensors):
        w = quantized.pop(f"{name}.weight").float()
        k = w.shape[1]
        g_idx = torch.arange(k) // group_size
        q, scale, zero = _int4_groups(w, g_idx, k // group_size, sym=False)
        quantized[f"{name}.qweight"] = pack_columns(q.t(), AWQ_ORDER)
        quantized[f"{name}.qzeros"] = pack_columns(zero.to(torch.uint8), AWQ_ORDER)
        quantized[f"{name}.scales"] = scale.half()
        reference[f"{name}.weight"] = (q.float() - zero[g_idx].t()) * scale[g_idx].t()
    qc = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    return _write(src, dst, quantized, reference, qc)


def write_gptq(
    src: Path, dst: Path, group_size: int = 128, desc_act: bool = False, sym: bool = True
) -> tuple[Path, Path]:
    """AutoGPTQ's layout: qweight [K/8, N], qzeros [G, N/8] holding zero - 1, scales [G, N]
    fp16, g_idx [K] (act-order: a permutation's groups)."""
    tensors = _weights(src)
    quantized, reference = dict(tensors), dict(tensors)
    gen = torch.Generator().manual_seed(1)
    for name in _projection_names(tensors):
        w = quantized.pop(f"{name}.weight").float()
        k = w.shape[1]
        size = k if group_size == -1 else group_size
        g_idx = torch.arange(k) // size
        if desc_act:
            # GPTQ visits columns in a data-dependent order; group j holds the j-th slice of it
            perm = torch.randperm(k, generator=gen)
            g_idx = torch.empty(k, dtype=torch.long)
            g_idx[perm] = torch.arange(k) // size
        q, scale, zero = _int4_groups(w, g_idx, k // size, sym=sym)
        quantized[f"{name}.qweight"] = pack_rows(q.t())
        quantized[f"{name}.qzeros"] = pack_columns((zero.long() - 1) & 0xF)
        quantized[f"{name}.scales"] = scale.half()
        quantized[f"{name}.g_idx"] = g_idx.to(torch.int32)
        reference[f"{name}.weight"] = (q.float() - zero[g_idx].t()) * scale[g_idx].t()
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": desc_act,
        "sym": sym,
        "checkpoint_format": "gptq",
    }
    return _write(src, dst, quantized, reference, qc)


def kiln_logits(engine: Any, prompt: list[int]) -> torch.Tensor:
    """kiln's logits at every position of ``prompt`` (one dense forward pass)."""
    from kiln.llm.attention import DenseMetadata

    runner = engine.runner
    dev = runner.device
    metas = {w: DenseMetadata.build([len(prompt)], dev, w) for w in runner.windows}
    with torch.inference_mode():
        return runner.model(
            torch.tensor(prompt, device=dev),
            torch.arange(len(prompt), device=dev),
            metas,
            torch.arange(len(prompt), device=dev),
        ).float()


def reference_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), torch_dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()
