"""BERT's family of encoders (BERT, RoBERTa, XLM-RoBERTa): every token attends to every
other token of its input, so there is no KV cache and no generation; the final hidden
states are pooled into an embedding, or a classification head scores the first token
(``[CLS]`` / ``<s>``): a reranker's cross-encoder, a sentiment classifier.

The weights load by their Hugging Face names (``bert.encoder.layer.0.attention.self.query``,
...) mapped onto this module's shorter ones (``RENAMES``); q, k and v are then fused into one
projection. A layer is post-norm: ``x = LN(x + attn(x))``, ``x = LN(x + mlp(x))``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.config import ENCODERS, TOKEN_TYPE_SHIFT, ModelArgs

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


def _activation(name: str) -> Any:
    if name == "relu":
        return F.relu
    if name == "silu":
        return F.silu
    if name == "gelu":
        return F.gelu
    # gelu_new, gelu_pytorch_tanh, gelu_fast: the tanh approximation
    return lambda x: F.gelu(x, approximate="tanh")


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
        self.act = _activation(str(args.hf_config.get("hidden_act", "gelu")))

    def fuse(self) -> None:
        """q, k and v as one projection (one matrix product instead of three)."""
        qkv = nn.Linear(self.q.in_features, 3 * self.q.out_features)
        qkv.to(device=self.q.weight.device, dtype=self.q.weight.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([self.q.weight, self.k.weight, self.v.weight]))
            qkv.bias.copy_(torch.cat([self.q.bias, self.k.bias, self.v.bias]))
        self.qkv = qkv
        del self.q, self.k, self.v

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """``x`` [B, L, H]; ``mask`` [B, 1, 1, L], True on the inputs' real tokens (None:
        no padding)."""
        b, n, h = x.shape
        assert self.qkv is not None, "fuse() after loading"
        qkv = self.qkv(x).view(b, n, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], attn_mask=mask)
        x = self.attn_norm(x + self.o(attn.transpose(1, 2).reshape(b, n, h)))
        out: torch.Tensor = self.out_norm(x + self.down(self.act(self.up(x))))
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

    def fuse(self) -> None:
        for layer in self.layers:
            assert isinstance(layer, EncoderLayer)
            layer.fuse()

    def forward(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """``ids`` [B, L] (padded past each input's length; a pair's second segment's ids
        carry their token type above ``TOKEN_TYPE_SHIFT``), ``lengths`` [B]; the final
        hidden states [B, L, H] (the padding's rows are not meaningful)."""
        n = ids.shape[1]
        types = ids >> TOKEN_TYPE_SHIFT
        tokens = ids & ((1 << TOKEN_TYPE_SHIFT) - 1)
        positions = torch.arange(n, device=ids.device) + self.position_offset
        x = self.embed(tokens) + self.pos_embed(positions)[None] + self.type_embed(types)
        x = self.embed_norm(x)
        mask = None
        if bool((lengths < n).any()):
            mask = (torch.arange(n, device=ids.device)[None] < lengths[:, None])[:, None, None]
        for layer in self.layers:
            x = layer(x, mask)
        hidden: torch.Tensor = x
        return hidden

    def classify(self, first: torch.Tensor) -> torch.Tensor:
        """The classification head's logits [B, num_labels] from the first token's final
        state [B, H]: BERT's pooler (dense, tanh) then its classifier; RoBERTa's head is
        the same two products under other names."""
        assert self.head_dense is not None and self.classifier is not None
        logits: torch.Tensor = self.classifier(torch.tanh(self.head_dense(first)))
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
