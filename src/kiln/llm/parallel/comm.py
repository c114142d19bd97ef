"""The ranks' process group, the all-reduces of the row-parallel projections, and the
per-step message rank 0 sends the others.

The group is built directly on a ``TCPStore`` (not ``init_process_group``): the engine's
process may serve several models, each with its own group, and holds no global one.

The step message is one int64 array (block tables, computed lengths, token ids, positions),
written length-prefixed to each worker's stdin: the workers wait on a pipe, not in a
collective, so an idle model runs into no collective timeout, and a worker whose engine is
gone reads end-of-file and exits.
"""

from __future__ import annotations

from datetime import timedelta
from typing import IO, Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

#: a collective waits this long for a rank (a step's compute, not idle time: the workers
#: idle on their pipe)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)

STOP, STEP, COPY = 0, 1, 2
_LEN = np.dtype("<u8")
_INT = np.dtype("<i8")


def new_group(store: Any, rank: int, world_size: int, device: torch.device) -> Any:
    """gloo on the CPU, NCCL on CUDA (each rank on its own GPU, already current)."""
    if device.type == "cuda":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("this torch build has no NCCL")
        options = nccl.Options()
        options._timeout = COLLECTIVE_TIMEOUT
        return nccl(store, rank, world_size, options)
    return dist.ProcessGroupGloo(store, rank, world_size, COLLECTIVE_TIMEOUT)


def all_reduce(group: Any, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    group.allreduce([tensor], opts).wait()


#: the row-parallel projections: their outputs are partial sums over the ranks
ROW_PARALLEL = ("o_proj", "down_proj")


def install_all_reduce(model: nn.Module, group: Any) -> int:
    """Sum each row-parallel projection's output over the ranks (in place, as a forward
    hook: the model code stays the single-device one). Returns how many were hooked."""

    def hook(module: nn.Module, inputs: Any, output: torch.Tensor) -> torch.Tensor:
        all_reduce(group, output)
        return output

    count = 0
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROW_PARALLEL:
            module.register_forward_hook(hook)
            count += 1
    return count


def write_frame(pipe: IO[bytes], data: bytes) -> None:
    pipe.write(np.array([len(data)], dtype=_LEN).tobytes() + data)
    pipe.flush()


def read_frame(pipe: IO[bytes]) -> bytes | None:
    """The next message, or None at end-of-file (the engine closed the pipe or died)."""
    head = pipe.read(8)
    if len(head) < 8:
        return None
    size = int(np.frombuffer(head, dtype=_LEN)[0])
    data = pipe.read(size)
    return data if len(data) == size else None


def kind(msg: bytes) -> int:
    return int(np.frombuffer(msg[:8], dtype=_INT)[0])


def encode_step(
    tables: list[list[int]],
    computed: list[int],
    num_new_tokens: list[int],
    input_ids: list[int],
    positions: list[int],
) -> bytes:
    """[STEP, seqs, tokens, table lengths..., tables..., computed..., new..., ids..., pos...]"""
    lengths = [len(t) for t in tables]
    flat = [b for t in tables for b in t]
    head = [STEP, len(tables), len(input_ids)]
    values = head + lengths + flat + computed + num_new_tokens + input_ids + positions
    return np.array(values, dtype=_INT).tobytes()


def decode_step(
    msg: bytes,
) -> tuple[list[list[int]], list[int], list[int], list[int], list[int]]:
    """(block tables, computed, new tokens, input ids, positions)"""
    values = np.frombuffer(msg, dtype=_INT).tolist()
    seqs, tokens = values[1], values[2]
    at = 3
    lengths = values[at : at + seqs]
    at += seqs
    tables = []
    for n in lengths:
        tables.append(values[at : at + n])
        at += n
    computed = values[at : at + seqs]
    new = values[at + seqs : at + 2 * seqs]
    at += 2 * seqs
    return tables, computed, new, values[at : at + tokens], values[at + tokens : at + 2 * tokens]


def encode_copies(copies: list[tuple[int, int]]) -> bytes:
    values = [COPY, len(copies), *(c[0] for c in copies), *(c[1] for c in copies)]
    return np.array(values, dtype=_INT).tobytes()


def encode_stop() -> bytes:
    return np.array([STOP], dtype=_INT).tobytes()


def decode_copies(msg: bytes) -> list[tuple[int, int]]:
    values = np.frombuffer(msg, dtype=_INT).tolist()
    n = values[1]
    return list(zip(values[2 : 2 + n], values[2 + n : 2 + 2 * n], strict=True))
