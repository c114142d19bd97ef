"""The runner of an encoder-only model (kiln.llm.models.bert): no KV cache, no sampling,
only ``pool``. Inputs are sorted by length and cut into batches of at most
``max_num_batched_tokens`` tokens (one input alone may exceed it), so a request of many
short texts runs as a few large matrix products instead of one per text; within a batch the
tokens are packed, padded only inside attention (kiln.llm.models.bert)."""

from __future__ import annotations

import logging

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm import cpu_linear
from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.lora_layers import LoRAManager
from kiln.llm.model_runner import DTYPES
from kiln.llm.models.bert import (
    Encoder,
    attention_groups,
    check_token_types,
    rename,
    token_logits,
)
from kiln.llm.pooling import mean_pool, token_rows
from kiln.llm.sampler import SampledToken
from kiln.llm.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

#: a CPU batch's most tokens, below ``max_num_batched_tokens``: the wide products' outputs
#: ([tokens, 3 x hidden], [tokens, intermediate]) then stay in the cache; 512-1,536 were
#: equal and 8,192 6 % slower on bert-base (docs/design/llm-encoders.md)
CPU_BATCH_TOKENS = 1024


def load_encoder_weights(model: Encoder, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
    """The checkpoint's tensors by their Hugging Face names, each copied into the model in
    ``dtype``; a tensor kiln does not know, or one the model lacks, is refused by name."""
    expected = dict(model.state_dict())
    seen: set[str] = set()
    for source, tensors in checkpoint.weights(dtype):
        for name, tensor in tensors.items():
            target = rename(name)
            if target is None or (target.startswith("head_dense.") and target not in expected):
                continue  # a masked-LM head, an embedding model's unused pooler
            if target not in expected:
                raise KilnError(
                    f"llm backend: {source} holds a weight kiln's {model.args.architecture} "
                    f"does not have: {name}",
                    Status.INVALID_ARG,
                )
            if tuple(tensor.shape) != tuple(expected[target].shape):
                raise KilnError(
                    f"llm backend: {source}'s {name} has shape {list(tensor.shape)}, the "
                    f"config says {list(expected[target].shape)}",
                    Status.INVALID_ARG,
                )
            with torch.no_grad():
                expected[target].copy_(tensor)
            seen.add(target)
        del tensors
    missing = sorted(set(expected) - seen)
    if missing:
        raise KilnError(
            f"llm backend: weights missing from {checkpoint.path}: {missing[:5]}",
            Status.INVALID_ARG,
        )


def _onednn_wins() -> bool:
    """Whether oneDNN's packed products beat MKL's for an encoder's thousands of rows: on
    an AVX-512 CPU they did (1.1x, benchmarks/README.md), on the AVX2 EPYC where kiln's
    decode path was tuned they did not for long prefills (0.9-0.95x, kiln.llm.cpu_linear)."""
    capability = str(torch.backends.cpu.get_cpu_capability())
    return capability.startswith("AVX512") and cpu_linear.available()


class EncoderRunner:
    """What the engine asks of a runner, for a model that only pools."""

    #: adapters are not served on encoders
    lora: LoRAManager | None = None

    def __init__(self, checkpoint: Checkpoint, args: ModelArgs, config: EngineConfig) -> None:
        asked = {
            "speculative_config": config.speculative_config is not None,
            "lora_config": config.lora_config is not None,
            "tensor_parallel_size > 1": config.tensor_parallel_size > 1,
            "kv_cache_dtype": config.kv_cache_dtype != "auto",
            "quantization": config.quantization != "auto",
        }
        refused = [name for name, given in asked.items() if given]
        if refused:
            raise KilnError(
                f"llm backend: {args.architecture} is an encoder (it pools, with no KV "
                f"cache): {', '.join(refused)} does not apply to it",
                Status.INVALID_ARG,
            )
        if checkpoint.config().get("quantization_config"):
            raise KilnError(
                f"llm backend: a quantized {args.architecture} is not supported (kiln runs "
                "encoders in float32, float16 or bfloat16)",
                Status.INVALID_ARG,
            )
        if config.max_model_len > args.max_position_embeddings:
            # learned positions: there is no embedding for a position past the table
            raise KilnError(
                f"llm backend: max_model_len {config.max_model_len} is more than "
                f"{args.architecture}'s {args.max_position_embeddings} positions",
                Status.INVALID_ARG,
            )
        self.args = args
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        with torch.device("meta"):
            model = Encoder(args)
        model = model.to_empty(device=self.device).to(self.dtype)
        load_encoder_weights(model, checkpoint, self.dtype)
        model.fuse()
        if self.device.type == "cpu" and self.dtype == torch.float32 and _onednn_wins():
            # every product packed for oneDNN, however many tokens (docs/design/llm-encoders.md)
            cpu_linear.pack(model, max_rows=1 << 62)
        self.model = model.eval()
        #: the engine's block manager wants a cache size: one input's worth of blocks,
        #: never allocated (an encoder keeps no KV)
        self.num_blocks = -(-config.max_model_len // config.block_size)
        log.info(
            "llm: %s encoder of %d layers, %s, pooling with no KV cache",
            args.architecture,
            args.num_hidden_layers,
            config.dtype,
        )

    def close(self) -> None:
        """Nothing to release."""

    def run(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        raise KilnError(
            f"llm backend: {self.args.architecture} is an encoder: it does not generate",
            Status.INVALID_ARG,
        )

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """The inputs' indices, shortest first, in runs of at most ``max_num_batched_tokens``
        tokens (on a CPU at most ``CPU_BATCH_TOKENS``; one longer input alone)."""
        budget = self.config.max_num_batched_tokens
        if self.device.type == "cpu":
            budget = min(budget, CPU_BATCH_TOKENS)
        batches: list[list[int]] = []
        current: list[int] = []
        tokens = 0
        for i in sorted(range(len(lengths)), key=lengths.__getitem__):
            if current and tokens + lengths[i] > budget:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += lengths[i]
        if current:
            batches.append(current)
        return batches

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]], pooling_type: str) -> torch.Tensor:
        """The prompts' pooled final hidden states [len(prompts), hidden] (a classifier's:
        its logits [len(prompts), num_labels], from the first token), float32; ``ALL``:
        every token's, the prompts one after another [sum of lengths, hidden] (a token
        classifier's: every token's logits [sum of lengths, labels], its only pooling)."""
        check_token_types(self.args, prompts)
        lengths = [len(p) for p in prompts]
        if any(n == 0 for n in lengths):
            raise KilnError("llm backend: an encoder's input needs a token", Status.INVALID_ARG)
        every = pooling_type == "ALL"  # every token's state, inputs one after another
        token_labels = len(self.args.token_labels)
        if token_labels and not every:
            raise KilnError(
                f"llm backend: {self.args.architecture} classifies every token: it pools "
                "only with task token_classify",
                Status.INVALID_ARG,
            )
        width = self.args.num_labels or token_labels or self.args.hidden_size
        out = torch.empty(sum(lengths) if every else len(prompts), width, dtype=torch.float32)
        starts = torch.tensor([0, *lengths]).cumsum(0)
        dev = self.device
        for batch in self._batches(lengths):
            sizes = [lengths[i] for i in batch]
            ids = torch.tensor([t for i in batch for t in prompts[i]], device=dev)
            positions = torch.cat([torch.arange(n) for n in sizes]).to(dev)
            rows = token_rows(sizes, "CLS" if self.args.num_labels else pooling_type)
            groups = attention_groups(sizes, dev)
            if every:
                hidden = self.model(ids, positions, groups)
                if token_labels:  # each token's label logits
                    hidden = token_logits(self.model, hidden)
                hidden = hidden.float().cpu()
                at = 0
                for i, n in zip(batch, sizes, strict=True):
                    out[starts[i] : starts[i] + n] = hidden[at : at + n]
                    at += n
                continue
            if rows is None:
                pooled = mean_pool(self.model(ids, positions, groups), sizes)
            else:  # one token each: the last layer finishes those rows alone
                pooled = self.model(ids, positions, groups, rows.to(dev))
            if self.args.num_labels:
                pooled = self.model.classify(pooled)
            out[torch.tensor(batch)] = pooled.float().cpu()
        return out
