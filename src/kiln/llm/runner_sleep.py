"""Sleep mode's memory side (vLLM's ``sleep`` / ``wake_up`` of a worker): what a model
runner gives back while its engine sleeps, and how it gets it back.

- **KV cache** (``kv_cache``, levels 1 and 2, and ``release_kv_cache_memory``): the cache
  tensor, the decode workspace and the CUDA graphs (they point into the cache) are dropped;
  a wake allocates a zeroed cache of the same number of blocks and captures the graphs again.
- **Weights** (``weights``): level 1 on a GPU copies the model to host memory and back
  (``offload``); level 2, and level 1 on the CPU for a quantized or LoRA model whose
  tensors ``Module.to`` does not all move, drops the model, and a wake builds it again from
  the model files, as at load (the host copies of LoRA adapters are kept). Level 1 on the
  CPU keeps the weights where they are: they are already in host memory.

The memory goes back to the system, not only to torch's allocator: ``empty_cache`` on a
GPU, glibc's ``malloc_trim`` on the CPU.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from typing import TYPE_CHECKING

import torch

from kiln.llm.attention import KVWorkspace
from kiln.llm.cuda_graphs import DecodeGraphs, capture_sizes

if TYPE_CHECKING:
    from kiln.llm.model_runner import ModelRunner

log = logging.getLogger(__name__)

#: vLLM's tags: what a sleep released and a wake may bring back, one at a time
SLEEP_TAGS = ("weights", "kv_cache")


def _give_back(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim(0)  # glibc: freed heap pages back to the system
    except (OSError, AttributeError):  # not glibc: its allocator keeps them
        pass


def _empty(runner: ModelRunner) -> torch.Tensor:
    return torch.empty(0, dtype=runner.cache_dtype, device=runner.device)


def _recapture(runner: ModelRunner) -> None:
    """The CUDA graphs again, when the runner had them (they replay into the cache's and
    the weights' addresses, which a sleep changed)."""
    if runner.graphs_wanted and runner.kv_cache.numel() and runner.weights_resident:
        config = runner.config
        runner.graphs = DecodeGraphs(
            runner, capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
        )


def release_kv_cache(runner: ModelRunner) -> None:
    runner.graphs = None
    runner.kv_cache = _empty(runner)
    runner.workspace = KVWorkspace()
    if runner.weights_resident:
        for attn in runner.model.attention_layers():
            attn.k_cache = attn.v_cache = runner.kv_cache
    _give_back(runner.device)


def restore_kv_cache(runner: ModelRunner) -> None:
    runner._allocate_cache(runner.num_blocks)  # (the views: once the model is back)
    _recapture(runner)


def offloadable(runner: ModelRunner) -> bool:
    """Whether ``Module.to`` moves every weight of the model: not with quantized
    projections or LoRA wrappers, which keep tensors of their own."""
    return runner.quantization is None and runner.lora is None


def release_weights(runner: ModelRunner, level: int) -> None:
    """Level 1 on a GPU: the weights to host memory; level 2 (or level 1 of a model that
    cannot be moved whole): dropped. Level 1 on the CPU: nothing to do."""
    if runner.device.type == "cpu" and level == 1:
        return
    runner.graphs = None
    if level == 1 and offloadable(runner):
        runner.model.to("cpu")
        runner.offloaded = True
    else:
        runner.saved_adapters = runner.lora.host_copies() if runner.lora is not None else None
        runner.lora = None
        del runner.model
        runner.weights_resident = False
    _give_back(runner.device)


def restore_weights(runner: ModelRunner) -> None:
    if runner.offloaded:
        runner.model.to(runner.device)
        runner.offloaded = False
    elif not runner.weights_resident:
        log.info("llm: reading the weights again from %s", runner.checkpoint.path)
        runner._load_model()
        runner._prepare_model()
        if runner.lora is not None and runner.saved_adapters is not None:
            runner.lora.keep_host_copies(runner.saved_adapters)
        runner.saved_adapters = None
        runner.weights_resident = True
        for i, attn in enumerate(runner.model.attention_layers()):
            if runner.kv_cache.numel():
                attn.k_cache, attn.v_cache = runner.kv_cache[0, i], runner.kv_cache[1, i]
            else:
                attn.k_cache = attn.v_cache = runner.kv_cache
    _recapture(runner)
