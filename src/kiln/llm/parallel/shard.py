"""Which slice of each weight a rank holds (Megatron's split), and loading only that slice.

q/k/v and gate/up are column-parallel (a rank computes its heads' and its intermediate
columns' outputs), o_proj and down_proj row-parallel (a rank multiplies its part of the
inputs; the partial sums are all-reduced, ``comm.install_all_reduce``). The embedding and
the norms are replicated; the LM head lives on rank 0 alone, which samples (see
docs/scaling.md for why not vocab-parallel).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm.checkpoint import Checkpoint, FolderCheckpoint
from kiln.llm.config import EngineConfig, ModelArgs

#: routed experts are not split over ranks (expert parallelism is not built)
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class Shard:
    """Rank ``rank`` of ``world_size``, for a model of these (whole-model) sizes."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int

    @classmethod
    def of(cls, args: ModelArgs, rank: int, world_size: int) -> Shard:
        return cls(
            rank,
            world_size,
            args.num_attention_heads,
            args.num_key_value_heads,
            args.intermediate_size,
            args.head_dim,
        )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def local_kv_heads(self) -> int:
        # fewer KV heads than ranks: each rank holds one, replicated over world / kv ranks
        # (vLLM's rule), so a rank's query heads always find their KV head locally
        return max(self.num_kv_heads // self.world_size, 1)

    @property
    def kv_head_start(self) -> int:
        return self.rank * self.num_kv_heads // self.world_size

    @property
    def local_intermediate(self) -> int:
        return self.intermediate_size // self.world_size

    def local_args(self, args: ModelArgs) -> ModelArgs:
        """The shape of this rank's model: its heads and intermediate columns only (the
        model classes build their projections from these)."""
        return replace(
            args,
            num_attention_heads=self.local_heads,
            num_key_value_heads=self.local_kv_heads,
            intermediate_size=self.local_intermediate,
        )

    def ranges(self, module: str, param: str) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [start, stop) ranges concatenated along it) of the checkpoint tensor
        ``<module>.<param>`` this rank holds; None: the whole tensor."""
        d, r = self.head_dim, self.rank
        q = (r * self.local_heads * d, (r + 1) * self.local_heads * d)
        kv0 = self.kv_head_start * d
        kv = (kv0, kv0 + self.local_kv_heads * d)
        inter = (r * self.local_intermediate, (r + 1) * self.local_intermediate)
        if module == "q_proj":
            return 0, [q]
        if module in ("k_proj", "v_proj"):
            return 0, [kv]
        if module == "gate_proj" or module == "up_proj":
            return 0, [inter]
        if module == "o_proj" and param == "weight":
            return 1, [q]
        if module == "down_proj" and param == "weight":
            return 1, [inter]
        if module == "qkv_proj":  # Phi-3: q, k and v stacked in the checkpoint
            qs, kvs = self.num_heads * d, self.num_kv_heads * d
            return 0, [q, (qs + kv[0], qs + kv[1]), (qs + kvs + kv[0], qs + kvs + kv[1])]
        if module == "gate_up_proj":  # Phi-3: gate and up stacked
            full = self.intermediate_size
            return 0, [inter, (full + inter[0], full + inter[1])]
        return None


def check(args: ModelArgs, config: EngineConfig, raw: dict[str, Any], path: Path) -> None:
    """Refuse, before any process starts or weight loads, what cannot be split over
    ``config.tensor_parallel_size`` ranks; the message names the model, the sizes and N."""
    n = config.tensor_parallel_size
    name = config.served_model_name or path.name

    def refuse(reason: str) -> KilnError:
        return KilnError(f"model '{name}': tensor_parallel_size {n}: {reason}", Status.INVALID_ARG)

    if args.architecture in MOE_ARCHITECTURES:
        raise refuse(
            f"{args.architecture}'s experts are not split over ranks (expert parallelism "
            "is not built); serve it with tensor_parallel_size 1"
        )
    if path.is_file():
        raise refuse("a .gguf file is not split over ranks; serve the Hugging Face folder")
    if raw.get("quantization_config") or config.quantization not in ("auto", ""):
        raise refuse(
            "quantized weights are not split over ranks yet; serve them with tensor_parallel_size 1"
        )
    heads, kv, inter = args.num_attention_heads, args.num_key_value_heads, args.intermediate_size
    if heads % n:
        raise refuse(f"num_attention_heads {heads} is not divisible by {n}")
    if kv >= n and kv % n:
        raise refuse(f"num_key_value_heads {kv} is not divisible by {n}")
    if kv < n and n % kv:
        # replicating a KV head needs every rank's query heads to map to one KV head
        raise refuse(f"{n} is not a multiple of num_key_value_heads {kv}")
    if inter % n:
        raise refuse(f"intermediate_size {inter} is not divisible by {n}")
    if config.runner != "generate":
        raise refuse(f"runner '{config.runner}' is served with tensor_parallel_size 1 only")
    device = torch.device(config.device)
    if device.type == "cuda":
        first = device.index or 0
        visible = torch.cuda.device_count()
        if first + n > visible:
            raise refuse(f"needs {n} GPUs from cuda:{first}, and {visible} are visible")
    elif device.type != "cpu":
        raise refuse(f"device {device} is not supported (cpu or cuda)")


class ShardedCheckpoint:
    """A Hugging Face folder read slice by slice: each rank reads only its part of every
    split tensor from the safetensors files (``get_slice``), never the whole model."""

    def __init__(self, checkpoint: Checkpoint, shard: Shard) -> None:
        if not isinstance(checkpoint, FolderCheckpoint):
            raise KilnError(
                f"llm backend: {checkpoint.path} cannot be read by tensor-parallel ranks "
                "(a Hugging Face folder of safetensors files can)",
                Status.INVALID_ARG,
            )
        self.base = checkpoint
        self.path = checkpoint.path
        self.shard = shard

    def config(self) -> dict[str, Any]:
        return self.base.config()

    def generation_config(self) -> dict[str, Any]:
        return self.base.generation_config()

    def weights(self, dtype: torch.dtype) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
        from safetensors import safe_open

        files = self.base.weight_files()
        if not files:
            raise KilnError(
                f"llm backend: no *.safetensors file in {self.path}", Status.INVALID_ARG
            )
        for path in files:
            tensors: dict[str, torch.Tensor] = {}
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    if self.shard.rank and key == "lm_head.weight":
                        continue  # rank 0 alone computes the logits
                    tensors[key] = self._read(f, key)
            yield path.name, tensors

    def _read(self, f: Any, key: str) -> torch.Tensor:
        parts = key.rsplit(".", 2)
        found = self.shard.ranges(parts[-2], parts[-1]) if len(parts) == 3 else None
        if found is None:
            if self.shard.rank and key.endswith("o_proj.bias"):
                # a row-parallel bias is added once, by rank 0, before the sum
                tensor: torch.Tensor = f.get_tensor(key)
                return torch.zeros_like(tensor)
            whole: torch.Tensor = f.get_tensor(key)
            return whole
        dim, spans = found
        view = f.get_slice(key)
        pieces = [view[a:b] if dim == 0 else view[:, a:b] for a, b in spans]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)
