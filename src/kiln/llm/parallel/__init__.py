"""Tensor parallelism (vLLM's ``--tensor-parallel-size``): the weights and the KV heads split
over N ranks, Megatron style, one process each; rank 0 runs in the engine's process.

- ``shard``: which slice of each weight a rank holds, the refusals, the sliced loading;
- ``comm``: the process group (gloo on CPU, NCCL on CUDA), the all-reduces after the
  row-parallel projections, and the per-step message the other ranks read;
- ``driver``: rank 0's model runner, which starts, feeds and stops the workers;
- ``worker``: ``python -m kiln.llm.parallel.worker``, ranks 1..N-1.
"""

from kiln.llm.parallel.driver import create_runner

__all__ = ["create_runner"]
