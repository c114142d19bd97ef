"""What every tensor-parallel rank's model runner does differently from a single device's:
it builds its shard's shapes, loads its slices, sums the row-parallel outputs over the
ranks, and agrees with the others on the KV cache's size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.model_runner import ModelRunner
from kiln.llm.models.llama import LlamaForCausalLM
from kiln.llm.parallel.comm import all_reduce, install_all_reduce
from kiln.llm.parallel.shard import Shard, ShardedCheckpoint


class RankRunner(ModelRunner):
    def __init__(
        self,
        checkpoint: Checkpoint,
        args: ModelArgs,
        config: EngineConfig,
        rank: int,
        group: Any,
        loaded: Callable[[], None],
    ) -> None:
        self.shard = Shard.of(args, rank, config.tensor_parallel_size)
        self.group = group
        #: called once the weights are loaded, before the first collective of the load
        self._loaded = loaded
        # CUDA graphs are not captured around the all-reduces (eager steps only)
        config = replace(config, enforce_eager=True)
        sharded = ShardedCheckpoint(checkpoint, self.shard)
        super().__init__(sharded, self.shard.local_args(args), config)

    def _build_model(self, args: ModelArgs) -> LlamaForCausalLM:
        model = super()._build_model(args)
        if self.shard.rank:
            # rank 0 alone samples, so only it holds the LM head: the others stop at the
            # last layer's output (a vocabulary-sized matrix less on each)
            model.lm_head = nn.Identity()  # type: ignore[assignment]
        install_all_reduce(model, self.group)
        return model

    def _num_blocks(self) -> int:
        self._loaded()
        # each rank's share of the cache has the same shape; the smallest budget decides
        # (the host's free memory, a GPU's profile, differ between ranks)
        blocks = torch.tensor([super()._num_blocks()], dtype=torch.int64, device=self.device)
        all_reduce(self.group, blocks, dist.ReduceOp.MIN)
        return int(blocks.item())
