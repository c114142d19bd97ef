"""``backend: "llm"``: a Hugging Face folder served by kiln's engine.

The version folder (``<repository>/<model>/1/``) holds ``config.json``, ``*.safetensors``
and the tokenizer files. Requests come through the OpenAI frontend (``/v1/*``) or Triton's
generate extension (``/v2/models/{m}/generate``); the KServe v2 ``infer`` path is refused.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import numpy as np

from kiln.backends.base import Backend, InstanceSpec, parameter
from kiln.backends.gpus import torch_gpu_count
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.llm.async_engine import AsyncEngine
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine
from kiln.llm.structured import GrammarCompiler
from kiln.llm.tokenizer import Tokenizer

_INT_PARAMETERS = (
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "num_gpu_blocks",
    "kv_cache_memory_bytes",
    "max_model_len",
    "max_waiting",
)
_BOOLEANS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def engine_config(config: ModelConfig, instance: InstanceSpec) -> EngineConfig:
    out = EngineConfig()
    for key in _INT_PARAMETERS:
        raw = parameter(config, key)
        if raw is None:
            continue
        try:
            setattr(out, key, int(raw))
        except ValueError:
            raise KilnError(
                f"model '{config.name}': parameter {key} must be an integer, got '{raw}'",
                Status.INVALID_ARG,
            ) from None
    out.dtype = parameter(config, "dtype", out.dtype) or out.dtype
    for key in ("enable_prefix_caching", "enforce_eager"):
        raw = parameter(config, key)
        if raw is None:
            continue
        flag = _BOOLEANS.get(raw.strip().lower())
        if flag is None:
            raise KilnError(
                f"model '{config.name}': parameter {key} must be true or false, got '{raw}'",
                Status.INVALID_ARG,
            )
        setattr(out, key, flag)
    backend = parameter(config, "attention_backend")
    if backend is not None:
        out.attention_backend = backend.strip().lower()
    sizes = parameter(config, "cuda_graph_sizes")
    if sizes is not None:
        try:
            out.cuda_graph_sizes = tuple(int(s) for s in sizes.replace(",", " ").split())
        except ValueError:
            raise KilnError(
                f"model '{config.name}': parameter cuda_graph_sizes must be integers "
                f"separated by commas or spaces, got '{sizes}'",
                Status.INVALID_ARG,
            ) from None
    policy = parameter(config, "scheduling_policy")
    if policy is not None:
        out.scheduling_policy = policy.strip().lower()
    out.device = f"cuda:{instance.device_id}" if instance.kind == "gpu" else "cpu"
    return out


class LLMBackend(Backend):
    name = "llm"
    platforms: ClassVar[tuple[str, ...]] = ()
    #: One engine serves the model (the routes use the first instance): a ``KIND_GPU``
    #: group without ``gpus`` runs on GPU 0 alone, not on every GPU.
    spread_over_gpus: ClassVar[bool] = False

    def __init__(self, config: ModelConfig, version_dir: Path, instance: InstanceSpec) -> None:
        super().__init__(config, version_dir, instance)
        if instance.total_instances > 1:
            # Each instance would load the weights and reserve its KV cache, and the
            # routes serve from the first: the others would hold memory for nothing.
            raise KilnError(
                f"model '{config.name}': the llm backend runs one engine per model, and "
                f"instance_group asks for {instance.total_instances} instances; set one "
                "instance (count: 1, one GPU in gpus), and serve the same weights under "
                "another model name for a second engine",
                Status.INVALID_ARG,
            )
        folder = Path(parameter(config, "model_path", "") or version_dir)
        self.tokenizer = Tokenizer(folder)
        self.engine = LLMEngine(folder, engine_config(config, instance))
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos not in self.engine.args.eos_token_ids:
            # chat models often end turns with the tokenizer's eos, not config.json's
            self.engine.args = replace(
                self.engine.args, eos_token_ids=(*self.engine.args.eos_token_ids, eos)
            )
        args = self.engine.args
        self.engine.grammars = GrammarCompiler(self.tokenizer, args.vocab_size, args.eos_token_ids)
        self.async_engine = AsyncEngine(self.engine, config.name)

    @classmethod
    def gpu_count(cls) -> int:
        return torch_gpu_count()

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        raise KilnError(
            f"model '{self.config.name}' is an LLM: use /v1/completions, /v1/chat/completions "
            f"or /v2/models/{self.config.name}/generate",
            Status.UNSUPPORTED,
        )

    def close(self) -> None:
        self.async_engine.close()
