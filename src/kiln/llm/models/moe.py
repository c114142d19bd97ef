"""Mixture-of-experts feed-forward layers: Mixtral and Qwen3-MoE.

A router picks ``top_k`` experts per token (softmax over all experts' logits, then the
top k, renormalised to sum to 1 for Mixtral and for Qwen3-MoE when ``norm_topk_prob``:
transformers' order of operations). The (token, expert) pairs are sorted by expert, so each
expert's tokens lie in one contiguous slice: an expert that has tokens runs once, as one
matrix product over its slice, and an expert without any is skipped. The rows come back to
their tokens weighted by their routing weights (``index_add_``). The checkpoint's per-expert
matrices are stacked into one [experts, ...] tensor each at load (``fuse``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.llm.config import ModelArgs
from kiln.llm.models.llama import DecoderLayer, LlamaForCausalLM
from kiln.llm.models.qwen3 import NormedAttention


class Expert(nn.Module):
    """One expert's SwiGLU weights, under the checkpoint's names (``gate``, ``up``,
    ``down``: Mixtral's w1, w3, w2; Qwen3-MoE's gate_proj, up_proj, down_proj)."""

    def __init__(self, hidden: int, intermediate: int, names: tuple[str, str, str]) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, nn.Linear(hidden, intermediate, bias=False))
        self.add_module(up, nn.Linear(hidden, intermediate, bias=False))
        self.add_module(down, nn.Linear(intermediate, hidden, bias=False))

    def weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        gate, up, down = (getattr(self, n).weight for n in self.names)
        return gate, up, down


class SparseMoe(nn.Module):
    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        names: tuple[str, str, str],
    ) -> None:
        super().__init__()
        self.top_k = top_k
        self.normalize = normalize
        self.gate = nn.Linear(hidden, num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(
            Expert(hidden, intermediate, names) for _ in range(num_experts)
        )
        #: [E, 2I, H]: each expert's gate and up rows stacked (after ``fuse``)
        self.gate_up = torch.empty(0)
        #: [E, H, I]
        self.down = torch.empty(0)

    def fuse(self) -> None:
        """Stack the experts' matrices (loaded under the checkpoint's names) into one
        tensor each: the forward pass indexes them by expert."""
        parts = [e.weights() for e in self.experts]  # type: ignore[operator]
        self.gate_up = torch.stack([torch.cat((g, u)) for g, u, _ in parts])
        self.down = torch.stack([d for _, _, d in parts])
        del self.experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights [T, k] (float32)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights /= weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        # (token, expert) pairs grouped by expert: each expert's rows are one slice
        order = torch.argsort(flat, stable=True)
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            span = slice(start, start + n)
            gate, up = F.linear(rows[span], self.gate_up[e]).chunk(2, dim=-1)
            out[span] = F.linear(F.silu(gate) * up, self.down[e])
            start += n
        out *= weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)


def _num_experts(raw: dict[str, object]) -> int:
    value = raw.get("num_local_experts", raw.get("num_experts"))
    if not isinstance(value, int | str):
        raise ValueError(f"config.json: num_local_experts / num_experts is {value!r}")
    return int(value)


class MixtralDecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        raw = args.hf_config
        del self.mlp
        self.block_sparse_moe = SparseMoe(
            args.hidden_size,
            args.intermediate_size,
            _num_experts(raw),
            int(raw.get("num_experts_per_tok", 2)),
            normalize=True,
            names=("w1", "w3", "w2"),
        )

    def feed_forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block_sparse_moe(h)
        return out


class Qwen3MoeDecoderLayer(DecoderLayer):
    def __init__(self, args: ModelArgs, layer: int) -> None:
        super().__init__(args, layer)
        raw = args.hf_config
        self.self_attn = NormedAttention(args, layer)
        experts = _num_experts(raw)
        step = int(raw.get("decoder_sparse_step", 1))
        dense = layer in (raw.get("mlp_only_layers") or []) or experts == 0
        if dense or (layer + 1) % step != 0:
            return  # Llama's MLP of intermediate_size, as transformers
        self.mlp = SparseMoe(  # type: ignore[assignment]
            args.hidden_size,
            int(raw.get("moe_intermediate_size", args.intermediate_size)),
            experts,
            int(raw.get("num_experts_per_tok", 8)),
            normalize=bool(raw.get("norm_topk_prob", False)),
            names=("gate_proj", "up_proj", "down_proj"),
        )


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = MixtralDecoderLayer
    # the experts' slice sizes are read on the host each step: no graph capture
    cuda_graphs = False


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls: type[nn.Module] = Qwen3MoeDecoderLayer
    cuda_graphs = False
