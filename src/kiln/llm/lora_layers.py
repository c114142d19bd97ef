"""Multi-LoRA compute: PEFT adapter folders read and checked, and one step's batched LoRA.

Each projection an adapter may target is wrapped in a ``LoRALinear`` holding every device
slot's A and B stacked (``max_loras`` slots of ``max_lora_rank`` each, smaller ranks zero
padded): ``A_all [slots·R, in]``, ``B_all [out, slots·R]``. A step computes
``y = base(x) + ((x @ A_allᵀ) ⊙ mask) @ B_allᵀ`` where the mask keeps, for each token, the
columns of its sequence's slot (none for a token without adapter): two dense matmuls for the
whole mixed batch, no loop over requests or adapters, no host synchronisation, no merged
weights (docs/design/multi-lora.md says why this instead of a gathered per-token matmul).
Fused projections (q/k/v, gate/up) hold one rank block per part, with B's rows of each
block on its part's slice of the output.
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm.lora import LoRAConfig, LoRARequest

if TYPE_CHECKING:
    from kiln.llm.config import ModelArgs
    from kiln.llm.sequence import Sequence

log = logging.getLogger(__name__)

#: adapter_config.json is a few hundred bytes; anything this large is not one
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight"
)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(slots=True)
class AdapterWeights:
    """One adapter on the host, in the serving dtype: (layer, module) -> (A [r, in],
    B [out, r] with the scaling folded in)."""

    request: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _refuse(request: LoRARequest, why: str) -> KilnError:
    return KilnError(f"LoRA adapter '{request.lora_name}': {why}", Status.INVALID_ARG)


def read_adapter(
    request: LoRARequest,
    shapes: dict[str, tuple[int, int]],
    num_layers: int,
    max_rank: int,
    dtype: torch.dtype,
) -> AdapterWeights:
    """A PEFT folder's adapter, every size checked before its tensors are read: the
    config's rank against ``max_rank``, the weight file's size against what such a rank
    can hold, each tensor's name and shape against the model's ``shapes``
    (module -> (in, out)). ``adapter_model.bin`` (a pickle) is never loaded."""
    folder = Path(request.lora_path)
    config_path = folder / "adapter_config.json"
    if not config_path.is_file():
        raise _refuse(request, f"{folder} has no adapter_config.json (not a PEFT folder)")
    if config_path.stat().st_size > MAX_CONFIG_BYTES:
        raise _refuse(request, f"adapter_config.json is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _refuse(request, f"adapter_config.json is not JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise _refuse(request, "adapter_config.json is not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise _refuse(request, f"peft_type {cfg.get('peft_type')!r} is not LORA")
    rank = cfg.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise _refuse(request, f"adapter_config.json's r must be a positive integer: {rank!r}")
    if rank > max_rank:
        raise _refuse(request, f"rank {rank} is above --max-lora-rank ({max_rank})")
    alpha = cfg.get("lora_alpha", rank)
    if not isinstance(alpha, int | float):
        raise _refuse(request, f"lora_alpha must be a number: {alpha!r}")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in ("none", None),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
    }
    for key, bad in unsupported.items():
        if bad:
            raise _refuse(request, f"{key} {cfg.get(key)!r} is not supported by kiln")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        for name in targets:
            if name not in shapes:
                raise _refuse(
                    request,
                    f"target module '{name}' is not supported by kiln for this model "
                    f"(supported: {', '.join(sorted(shapes))})",
                )
    weights_path = folder / "adapter_model.safetensors"
    if not weights_path.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise _refuse(
                request,
                "adapter_model.bin is a pickle, which kiln never loads: save the adapter "
                "with safe_serialization=True (adapter_model.safetensors)",
            )
        raise _refuse(request, f"{folder} has no adapter_model.safetensors")
    # every module of every layer at this rank in float32, and the header: no more
    per_layer = sum(i + o for i, o in shapes.values())
    limit = 4 * rank * per_layer * num_layers + MAX_CONFIG_BYTES
    size = weights_path.stat().st_size
    if size > limit:
        raise _refuse(
            request, f"adapter_model.safetensors holds {size} bytes, more than rank {rank} "
            f"LoRA weights of this model can ({limit})",
        )  # fmt: skip
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    from safetensors import SafetensorError, safe_open

    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                match = _KEY.fullmatch(key)
                if match is None:
                    raise _refuse(request, f"tensor '{key}' is not a LoRA weight kiln supports")
                layer, module, ab = int(match[1]), match[2], match[3]
                if module not in shapes:
                    raise _refuse(
                        request,
                        f"target module '{module}' is not supported by kiln for this model "
                        f"(supported: {', '.join(sorted(shapes))})",
                    )
                if layer >= num_layers:
                    raise _refuse(request, f"'{key}': the model has {num_layers} layers")
                n_in, n_out = shapes[module]
                want = [rank, n_in] if ab == "A" else [n_out, rank]
                shape = list(f.get_slice(key).get_shape())
                if shape != want:
                    raise _refuse(
                        request,
                        f"'{key}' has shape {shape}, this model's needs {want} (an adapter "
                        "for another base model?)",
                    )
                found.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    except SafetensorError as exc:
        raise _refuse(request, f"adapter_model.safetensors: {exc}") from None
    out = AdapterWeights(request, rank)
    for (layer, module), pair in sorted(found.items()):
        if set(pair) != {"A", "B"}:
            raise _refuse(request, f"layer {layer} {module} lacks lora_A or lora_B")
        a, b = pair["A"].float(), pair["B"].float() * scaling
        out.weights[layer, module] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not out.weights:
        raise _refuse(request, "adapter_model.safetensors holds no LoRA weights")
    return out


class LoRAContext:
    """The step's per-token slot (-1: no adapter), shared by every ``LoRALinear``."""

    def __init__(self, slots: int, rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.slots, self.rank = slots, rank
        self.dtype, self.device = dtype, device
        self.token_slot: torch.Tensor | None = None  # None: no adapter in the step
        self._masks: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    def set(self, token_slot: torch.Tensor | None) -> None:
        self.token_slot, self._masks = token_slot, {}

    def mask(self, blocks: int, dtype: torch.dtype) -> torch.Tensor:
        """[T, slots·blocks·R]: 1 on the columns of each token's own slot."""
        key = (blocks, dtype)
        mask = self._masks.get(key)
        if mask is None:
            assert self.token_slot is not None
            width = blocks * self.rank
            cols = torch.arange(self.slots * width, device=self.token_slot.device) // width
            mask = (cols[None, :] == self.token_slot[:, None]).to(dtype)
            self._masks[key] = mask
        return mask


class LoRALinear(nn.Module):
    """A projection plus every slot's LoRA; ``parts``: the module names an adapter may
    give it -> (rank block, output offset, output size)."""

    def __init__(
        self, base: nn.Module, parts: dict[str, tuple[int, int, int]], ctx: LoRAContext
    ) -> None:
        super().__init__()
        self.base = base
        self.parts = parts
        self.ctx = ctx
        self.blocks = 1 + max(b for b, _, _ in parts.values())
        dtype, device = ctx.dtype, ctx.device
        width = ctx.slots * self.blocks * ctx.rank
        n_in, n_out = int(base.in_features), int(base.out_features)  # type: ignore[arg-type]
        self.lora_a = torch.zeros(width, n_in, dtype=dtype, device=device)
        self.lora_b = torch.zeros(n_out, width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        if self.ctx.token_slot is None:
            return y
        h = F.linear(x, self.lora_a)
        h.mul_(self.ctx.mask(self.blocks, h.dtype))
        return y.add_(F.linear(h, self.lora_b).to(y.dtype))

    def load(self, slot: int, adapter: AdapterWeights, layer: int) -> None:
        """Write ``adapter``'s weights of this layer into ``slot`` (zeros where it has none)."""
        r = self.ctx.rank
        start = slot * self.blocks * r
        self.lora_a[start : start + self.blocks * r].zero_()
        self.lora_b[:, start : start + self.blocks * r].zero_()
        for name, (block, offset, size) in self.parts.items():
            pair = adapter.weights.get((layer, name))
            if pair is None:
                continue
            a, b = pair
            col = start + block * r
            self.lora_a[col : col + a.shape[0]] = a.to(self.lora_a.device)
            self.lora_b[offset : offset + size, col : col + b.shape[1]] = b.to(self.lora_b.device)


def _wrap(owner: nn.Module, attr: str, parts: dict[str, tuple[int, int, int]],
          ctx: LoRAContext, layer: int, out: list[tuple[int, LoRALinear]]) -> None:  # fmt: skip
    base = getattr(owner, attr, None)
    if base is None:
        return
    wrapped = LoRALinear(base, parts, ctx)
    setattr(owner, attr, wrapped)
    out.append((layer, wrapped))


class LoRAManager:
    """The model runner's adapters: host copies (at most ``max_cpu_loras``, least recently
    used dropped first and read again from their folder when needed) and the device slots
    (``max_loras``) a step's sequences use."""

    def __init__(
        self,
        model: nn.Module,
        args: ModelArgs,
        config: LoRAConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.config = config
        self.ctx = LoRAContext(config.max_loras, config.max_lora_rank, dtype, device)
        self.layers: list[tuple[int, LoRALinear]] = []
        q = args.num_attention_heads * args.head_dim
        kv = args.num_key_value_heads * args.head_dim
        inter = args.intermediate_size
        hidden = args.hidden_size
        shapes: dict[str, tuple[int, int]] = {}
        for i, layer in enumerate(model.model.layers):  # type: ignore[union-attr,arg-type]
            # the Llama skeleton's names (every architecture kiln has; MoE experts are not
            # an ``mlp`` with a ``down_proj``, and stay without LoRA)
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if attn is not None and hasattr(attn, "o_proj"):
                if getattr(attn, "qkv_proj", None) is not None:
                    parts = {"q_proj": (0, 0, q), "k_proj": (1, q, kv), "v_proj": (2, q + kv, kv),
                             "qkv_proj": (0, 0, q + 2 * kv)}  # fmt: skip
                    _wrap(attn, "qkv_proj", parts, self.ctx, i, self.layers)
                else:
                    for name, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
                        _wrap(attn, name, {name: (0, 0, size)}, self.ctx, i, self.layers)
                _wrap(attn, "o_proj", {"o_proj": (0, 0, hidden)}, self.ctx, i, self.layers)
                shapes.update(q_proj=(hidden, q), k_proj=(hidden, kv), v_proj=(hidden, kv),
                              o_proj=(q, hidden))  # fmt: skip
                if getattr(attn, "qkv_proj", None) is not None:
                    shapes["qkv_proj"] = (hidden, q + 2 * kv)
            if mlp is not None and hasattr(mlp, "down_proj"):
                if getattr(mlp, "gate_up_proj", None) is not None:
                    parts = {"gate_proj": (0, 0, inter), "up_proj": (1, inter, inter),
                             "gate_up_proj": (0, 0, 2 * inter)}  # fmt: skip
                    _wrap(mlp, "gate_up_proj", parts, self.ctx, i, self.layers)
                    shapes["gate_up_proj"] = (hidden, 2 * inter)
                else:
                    for name in ("gate_proj", "up_proj"):
                        _wrap(mlp, name, {name: (0, 0, inter)}, self.ctx, i, self.layers)
                _wrap(mlp, "down_proj", {"down_proj": (0, 0, hidden)}, self.ctx, i, self.layers)
                shapes.update(gate_proj=(hidden, inter), up_proj=(hidden, inter),
                              down_proj=(inter, hidden))  # fmt: skip
        #: the modules an adapter may target -> (in, out)
        self.shapes = shapes
        self.num_layers = args.num_hidden_layers
        self.dtype = dtype
        #: the adapter id in each device slot (None: free)
        self.slots: list[int | None] = [None] * config.max_loras
        self._host: OrderedDict[int, AdapterWeights] = OrderedDict()
        self._lock = threading.Lock()

    def read(self, request: LoRARequest) -> AdapterWeights:
        return read_adapter(
            request, self.shapes, self.num_layers, self.config.max_lora_rank, self.dtype
        )

    def add(self, request: LoRARequest) -> None:
        """Read and check an adapter, and keep it on the host (any thread)."""
        weights = self.read(request)
        with self._lock:
            self._keep(weights)

    def _keep(self, weights: AdapterWeights) -> None:
        self._host[weights.request.lora_int_id] = weights
        self._host.move_to_end(weights.request.lora_int_id)
        while len(self._host) > self.config.cpu_capacity:
            self._host.popitem(last=False)

    def host_copies(self) -> OrderedDict[int, AdapterWeights]:
        """The adapters read so far (sleep level 2 keeps them while the model is dropped)."""
        with self._lock:
            return OrderedDict(self._host)

    def keep_host_copies(self, copies: OrderedDict[int, AdapterWeights]) -> None:
        with self._lock:
            for weights in copies.values():
                self._keep(weights)

    def remove(self, lora_int_id: int) -> None:
        """Drop the host copy (any thread). Its slot stays as it is, for the sequences
        already running with it; no new one can name the id, so the slot is taken over
        when another adapter needs it (slots are the engine thread's alone)."""
        with self._lock:
            self._host.pop(lora_int_id, None)

    def prepare(self, seqs: Seq[Sequence], counts: Seq[int], device: torch.device) -> None:
        """Put the step's adapters in slots and set each token's slot (engine thread)."""
        wanted = {s.lora_request.lora_int_id: s.lora_request for s in seqs if s.lora_request}
        if not wanted:
            self.ctx.set(None)
            return
        for lora_id, request in wanted.items():
            if lora_id not in self.slots:
                self._load_slot(request, set(wanted))
        index = {lora_id: self.slots.index(lora_id) for lora_id in wanted}
        per_seq = [index[s.lora_request.lora_int_id] if s.lora_request else -1 for s in seqs]
        token_slot = torch.tensor(per_seq).repeat_interleave(torch.tensor(list(counts)))
        self.ctx.set(token_slot.to(device))

    def _load_slot(self, request: LoRARequest, in_step: set[int]) -> None:
        with self._lock:
            weights = self._host.get(request.lora_int_id)
            if weights is not None:
                self._host.move_to_end(request.lora_int_id)
        if weights is None:  # dropped from the host cache: its folder again
            weights = self.read(request)
            with self._lock:
                self._keep(weights)
        free = [i for i, s in enumerate(self.slots) if s is None or s not in in_step]
        if not free:
            raise KilnError(
                f"llm engine: more adapters in one step than max_loras ({len(self.slots)})",
                Status.INTERNAL,
            )
        slot = next((i for i in free if self.slots[i] is None), free[0])
        for layer, module in self.layers:
            module.load(slot, weights, layer)
        self.slots[slot] = request.lora_int_id
        log.info("llm: LoRA adapter '%s' in slot %d", request.lora_name, slot)
