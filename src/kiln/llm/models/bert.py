"""BERT's family of encoders (BERT, RoBERTa, XLM-RoBERTa): every token attends to every
other token of its input, so there is no KV cache and no generation; the final hidden
states are pooled into an embedding, or a classification head scores the first token
(``[CLS]`` / ``<s>``): a reranker's cross-encoder, a sentiment classifier; a token
classifier's head labels every token (named entities).

Tokens travel packed, the inputs one after another with no padding ([T, H]): every
projection, norm and activation runs on real tokens only. Attention alone needs each input's
tokens side by side, so inputs are grouped by length (``AttentionGroup``: sorted, a group
closed once padding it to its longest would add more than ``MAX_PADDING`` of its real
tokens) and each group is gathered into a padded batch for SDPA, then scattered back.

The weights load by their Hugging Face names (``bert.encoder.layer.0.attention.self.query``,
...) mapped onto this module's shorter ones (``RENAMES``); q, k and v are then fused into one
projection. A layer is post-norm: ``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.config import ENCODERS, TOKEN_TYPE_SHIFT, ModelArgs
from kiln.llm.cpu_linear import PackedLinear

#: a Hugging Face name's part inside ``encoder.layer.<i>.`` -> this module's
_LAYER = {
    "attention.self.query": "q",
    "attention.self.key": "k",
    "attention.self.value": "v",
    "attention.output.dense": "o",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}
#: the rest: embeddings, BERT's pooler, the classification heads (RoBERTa's has its own
#: dense layer where BERT uses the pooler's)
_TOP = {
    "embeddings.word_embeddings": "embed",
    "embeddings.position_embeddings": "pos_embed",
    "embeddings.token_type_embeddings": "type_embed",
    "embeddings.LayerNorm": "embed_norm",
    "pooler.dense": "head_dense",
    "classifier.dense": "head_dense",
    "classifier.out_proj": "classifier",
    "classifier": "classifier",
}
#: parts of a checkpoint an encoder never reads: a masked-LM head saved beside the
#: encoder, the position-id buffer older transformers saved
_IGNORED = re.compile(r"^(cls|lm_head)\.|position_ids$")
_LAYER_NAME = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")


def rename(name: str) -> str | None:
    """This module's name of the checkpoint's tensor ``name``; None: not read (a tensor
    kiln does not know keeps its own name, which the loader refuses). Older checkpoints
    name LayerNorm's parameters ``gamma``/``beta``."""
    original = name
    for prefix in ("bert.", "roberta.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    if _IGNORED.search(name):
        return None
    module, _, param = name.rpartition(".")
    param = {"gamma": "weight", "beta": "bias"}.get(param, param)
    match = _LAYER_NAME.match(module)
    if match:
        part = _LAYER.get(match.group(2))
        return original if part is None else f"layers.{match.group(1)}.{part}.{param}"
    top = _TOP.get(module)
    return original if top is None else f"{top}.{param}"


#: oneDNN's GELU post-op algorithm for each of transformers' GELUs
_ONEDNN_GELU = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh",
                "gelu_fast": "tanh"}  # fmt: skip


def _activation(name: str) -> Any:
    if name == "relu":
        return F.relu
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    # gelu_new, gelu_pytorch_tanh, gelu_fast: the tanh approximation
    return lambda x: F.gelu(x, approximate="tanh")


#: a group's padding (to its longest input) stays within this share of its real tokens
MAX_PADDING = 0.25


@dataclass(slots=True)
class AttentionGroup:
    """Inputs of similar length, attended together as one padded batch."""

    #: [b, n] each padded slot's token among the packed ones (padding: the group's first)
    gather: torch.Tensor
    #: [b, 1, 1, n] True on real tokens; None: the inputs are of one length
    mask: torch.Tensor | None
    #: [t] the packed tokens the group's real slots hold, in slot order
    tokens: torch.Tensor
    #: [t] those slots among the b * n (None: all of them)
    real: torch.Tensor | None


def attention_groups(lengths: list[int], device: torch.device) -> list[AttentionGroup]:
    """The inputs (of ``lengths``, packed in that order) grouped for attention."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    runs: list[list[int]] = []
    real = 0  # the last run's tokens
    for i in order:  # ascending: the newcomer is the longest
        grown = real + lengths[i]
        if runs and (len(runs[-1]) + 1) * lengths[i] - grown <= MAX_PADDING * grown:
            runs[-1].append(i)
            real = grown
        else:
            runs.append([i])
            real = lengths[i]
    groups = []
    for run in runs:
        longest = max(lengths[i] for i in run)
        slots = torch.arange(longest)
        gather = torch.stack([starts[i] + slots.clamp(max=lengths[i] - 1) for i in run])
        valid = slots[None] < torch.tensor([lengths[i] for i in run])[:, None]
        uniform = bool(valid.all())
        groups.append(
            AttentionGroup(
                gather=gather.to(device),
                mask=None if uniform else valid[:, None, None].to(device),
                tokens=gather[valid].to(device),
                real=None if uniform else valid.flatten().nonzero().flatten().to(device),
            )
        )
    return groups


class EncoderLayer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.heads = args.num_attention_heads
        self.q = nn.Linear(h, h)
        self.k = nn.Linear(h, h)
        self.v = nn.Linear(h, h)
        self.qkv: nn.Linear | None = None
        self.o = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.up = nn.Linear(h, args.intermediate_size)
        self.down = nn.Linear(args.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=eps)
        act = str(args.hf_config.get("hidden_act", "gelu"))
        self.act = _activation(act)
        #: oneDNN's algorithm for the GELU fused into the up-projection (None: not fused)
        self.gelu = _ONEDNN_GELU.get(act)

    def fuse(self) -> None:
        """q, k and v as one projection (one matrix product instead of three)."""
        qkv = nn.Linear(self.q.in_features, 3 * self.q.out_features)
        qkv.to(device=self.q.weight.device, dtype=self.q.weight.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([self.q.weight, self.k.weight, self.v.weight]))
            qkv.bias.copy_(torch.cat([self.q.bias, self.k.bias, self.v.bias]))
        self.qkv = qkv
        del self.q, self.k, self.v

    def forward(
        self, x: torch.Tensor, groups: list[AttentionGroup], rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x`` [T, H]: the inputs' tokens, packed. ``rows``: only those tokens' outputs
        are wanted (the last layer's, pooled from one token each): every token's keys and
        values are still computed, but the projection after attention and the MLP run on
        those rows alone."""
        h = x.shape[1]
        assert self.qkv is not None, "fuse() after loading"
        qkv = self.qkv(x)
        attn = torch.empty_like(x)
        for g in groups:
            b, n = g.gather.shape
            part = qkv[g.gather].view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(part[0], part[1], part[2], attn_mask=g.mask)
            out = out.transpose(1, 2).reshape(b * n, h)
            attn[g.tokens] = out if g.real is None else out[g.real]
        if rows is not None:
            x, attn = x[rows], attn[rows]
        x = self.attn_norm(_plus(self.o, attn, x))
        hidden: torch.Tensor = self.out_norm(_plus(self.down, self._up(x), x))
        return hidden

    def _up(self, x: torch.Tensor) -> torch.Tensor:
        """The activation of the up-projection; with oneDNN's packed weight, GELU runs in
        the product's epilogue instead of a pass of its own over [T, intermediate]."""
        up = self.up
        if isinstance(up, PackedLinear) and self.gelu is not None and up.packs(x):
            fused: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x, up.packed, up.bias, "gelu", [], self.gelu
            )
            return fused
        out: torch.Tensor = self.act(up(x))
        return out


def _plus(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """``residual + proj(x)``; with oneDNN's packed weight the sum is the product's
    epilogue (one pass over the output fewer)."""
    if isinstance(proj, PackedLinear) and proj.packs(x):
        fused: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x, residual, proj.packed, proj.bias, "add"
        )
        return fused
    out: torch.Tensor = residual + proj(x)
    return out


class Encoder(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        raw = args.hf_config
        h = args.hidden_size
        self.args = args
        #: RoBERTa counts positions from past its padding id
        self.position_offset = (
            int(raw.get("pad_token_id", 1)) + 1 if ENCODERS[args.architecture] == "roberta" else 0
        )
        self.embed = nn.Embedding(args.vocab_size, h)
        self.pos_embed = nn.Embedding(int(raw.get("max_position_embeddings", 512)), h)
        self.type_embed = nn.Embedding(max(int(raw.get("type_vocab_size", 2)), 1), h)
        self.embed_norm = nn.LayerNorm(h, eps=args.rms_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(args) for _ in range(args.num_hidden_layers))
        self.head_dense: nn.Linear | None = None
        self.classifier: nn.Linear | None = None
        if args.num_labels:
            self.head_dense = nn.Linear(h, h)
            self.classifier = nn.Linear(h, args.num_labels)
        elif args.is_token_classifier:  # one product on every token's final state
            self.classifier = nn.Linear(h, len(args.token_labels))

    def fuse(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, EncoderLayer)
            layer.fuse()

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, groups: list[AttentionGroup],
                rows: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``ids`` [T]: the inputs' tokens packed (a pair's second segment's ids carry their
        token type above ``TOKEN_TYPE_SHIFT``), ``positions`` [T] each token's within its
        input; the final hidden states [T, H], or only those of ``rows`` [R, H]."""
        types = ids >> TOKEN_TYPE_SHIFT
        tokens = ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        x = self.embed(tokens) + self.pos_embed(positions + self.position_offset)
        x = self.embed_norm(x + self.type_embed(types))
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, groups, rows if i == last else None)
        hidden: torch.Tensor = x
        return hidden

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [B, num_labels] from the first token's final
        state [B, H]: BERT's pooler (dense, tanh) then its classifier; RoBERTa's head is
        the same two products under other names."""
        assert self.head_dense is not None and self.classifier is not None
        logits: torch.Tensor = self.classifier(torch.tanh(self.head_dense(first)))
        return logits


def token_logits(model: Encoder, hidden: torch.Tensor) -> torch.Tensor:
    """A token classifier's logits [T, labels] from every token's final state [T, H]
    (transformers' ``*ForTokenClassification``: its dropout, then one linear layer)."""
    assert model.classifier is not None and model.head_dense is None
    logits: torch.Tensor = model.classifier(hidden)
    return logits


def check_token_types(args: ModelArgs, ids: list[list[int]]) -> None:
    """Every packed token type is one the model has (the frontend packs only 0 and 1)."""
    types = max(int(args.hf_config.get("type_vocab_size", 2)), 1)
    for prompt in ids:
        if prompt and max(prompt) >> TOKEN_TYPE_SHIFT >= types:
            raise KilnError(
                f"llm backend: a token type past the model's type_vocab_size {types}",
                Status.INVALID_ARG,
            )
