"""Loads the weights, owns the KV-cache tensors, and runs one scheduled step."""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from kiln.core.errors import KilnError, Status
from kiln.llm import attention_cpu, cpu_linear, cpu_ops, kernels, quantization
from kiln.llm.attention import AttentionMetadata, DenseMetadata, KVWorkspace, cache_shape
from kiln.llm.attention_flex import FlexMetadata, resolve_attention_backend
from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.cuda_graphs import DecodeGraphs, capture_sizes
from kiln.llm.lora_layers import LoRAManager
from kiln.llm.models.llama import LlamaForCausalLM, StepMetadata
from kiln.llm.models.moe import SparseMoe
from kiln.llm.models.registry import build_model
from kiln.llm.pooling import mean_pool, token_rows
from kiln.llm.quantization import kv_cache
from kiln.llm.sampler import SampledToken, prompt_logprobs, sample
from kiln.llm.scheduler import SchedulerOutput
from kiln.llm.sequence import SamplingParams, Sequence
from kiln.llm.spec_decode import verify

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_weights(model: LlamaForCausalLM, checkpoint: Checkpoint, dtype: torch.dtype) -> None:
    expected = set(model.state_dict())
    seen: set[str] = set()
    for source, tensors in checkpoint.weights(dtype):
        unknown = set(tensors) - expected
        if unknown:
            raise KilnError(
                f"llm backend: {source} holds weights kiln's "
                f"{model.args.architecture} does not have: {sorted(unknown)[:5]}",
                Status.INVALID_ARG,
            )
        model.load_state_dict(tensors, strict=False)
        seen |= set(tensors)
        del tensors  # one file's tensors at a time
    missing = expected - seen
    if model.args.tie_word_embeddings or model.args.num_labels:
        missing.discard("lm_head.weight")
    if missing:
        raise KilnError(
            f"llm backend: weights missing from {checkpoint.path}: {sorted(missing)[:5]}",
            Status.INVALID_ARG,
        )


def resolve_dtype(name: str, checkpoint_dtype: str | None, device: torch.device) -> str:
    """``auto``: float32 on the CPU (kiln's CPU kernels are float32, and bf16 matmuls there
    are slower than float32 ones without AMX), the checkpoint's own dtype on a GPU."""
    if name != "auto":
        return name
    if device.type == "cpu":
        return "float32"
    return checkpoint_dtype if checkpoint_dtype in DTYPES else "float32"


def _available_memory() -> int:
    """The host's available memory in bytes (``MemAvailable``), or 8 GiB when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


#: vLLM's CPU default for the KV cache (``VLLM_CPU_KVCACHE_SPACE``: 4 GiB)
CPU_KV_CACHE_BYTES = 4 << 30


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, args: ModelArgs, config: EngineConfig) -> None:
        self.args = args
        self.config = config
        self.device = torch.device(config.device)
        if config.dtype not in DTYPES:
            raise KilnError(
                f"llm backend: dtype '{config.dtype}' is not one of {sorted(DTYPES)}",
                Status.INVALID_ARG,
            )
        self.dtype = DTYPES[config.dtype]
        #: the KV cache's dtype: the model's, or fp8 (``kv_cache_dtype``)
        self.cache_dtype = kv_cache.cache_dtype(config.kv_cache_dtype, self.dtype)
        #: the checkpoint the weights are read from (again by a wake from sleep level 2)
        self.checkpoint = checkpoint
        #: sleep mode (``runner_sleep``): the weights are on their device / in host memory,
        #: and the adapters' host copies kept while the model is dropped
        self.weights_resident = True
        self.offloaded = False
        self.saved_adapters: OrderedDict[int, Any] | None = None
        self._load_model()
        #: the layers' distinct sliding windows (None: full attention), a metadata each step
        self.windows = self.model.windows()
        self.block_bytes = (
            2
            * args.num_hidden_layers
            * config.block_size
            * args.num_key_value_heads
            * args.head_dim
            * self.cache_dtype.itemsize
        )
        self.attention_backend = kv_cache.attention_backend(
            config.attention_backend,
            resolve_attention_backend(
                config.attention_backend,
                self.device,
                config.block_size,
                self.cache_dtype,
                softcap=args.attn_logit_softcapping is not None,
            ),
            self.cache_dtype,
        )
        #: flex and triton share the cache layout, the prefill path and CUDA graphs
        self.paged_flex = self.attention_backend in ("flex", "triton")
        if self.attention_backend == "cpu":
            attention_cpu.warm_up()
        self._prepare_model()
        self.workspace = KVWorkspace()
        self.num_blocks = self._num_blocks()
        self._allocate_cache(self.num_blocks)
        self.graphs: DecodeGraphs | None = None
        # graphs need the flex backend's fixed-shape metadata, and a GPU
        use_graphs = self.paged_flex and not config.enforce_eager
        use_graphs = use_graphs and self.model.cuda_graphs  # MoE: host-side routing
        use_graphs = use_graphs and self.lora is None  # the step's slots are set eagerly
        self.graphs_wanted = use_graphs and self.device.type == "cuda"
        if use_graphs and self.device.type == "cuda" and torch.cuda.is_available():
            sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
            self.graphs = DecodeGraphs(self, sizes)

    def _load_model(self) -> None:
        """Build the model and read its weights from the checkpoint (at start, and when
        the engine wakes from sleep level 2, which dropped them)."""
        args, config = self.args, self.config
        with torch.device("meta"):
            model = self._build_model(args)
        # quantized projections swapped while the model is still on the meta device (their
        # float weights are never allocated): the checkpoint's tensors load as they are
        self.quantization = quantization.apply(
            model, self.checkpoint, config.quantization, self.dtype, torch.device("meta")
        )
        model = model.to_empty(device=self.device)
        # rope tables are computed, not loaded: rebuild them off the meta device
        model.rebuild_rope(self.device)
        # cast before loading: the weights are copied (and rounded) straight into the
        # serving dtype, never held in float32 beside it
        model = model.to(self.dtype)
        load_weights(model, self.checkpoint, self.dtype)
        quantization.finalize(model)
        if args.tie_word_embeddings or args.num_labels:
            model.lm_head.weight = model.model.embed_tokens.weight
        self.model = model.eval()
        self.model.fuse()
        #: the adapters (``lora_config``): their projections wrapped after fusing
        self.lora: LoRAManager | None = None
        if config.lora_config is not None:
            self.lora = LoRAManager(model, args, config.lora_config, self.dtype, self.device)

    def _prepare_model(self) -> None:
        """The backend's per-model set-up once the weights are final (kernels, packing)."""
        config = self.config
        if self.attention_backend == "triton":
            # the norms, SiLU-and-mul and RoPE of the Llama skeleton take their kernels too
            kernels.enable(self.model)
        if config.batch_invariant:
            self._batch_invariant()
        elif self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_ops.warm_up()
            # after fuse() and the tied LM head: the packed copies are of the final weights
            if config.tensor_parallel_size == 1:  # a rank's shard: the workers keep F.linear
                cpu_linear.pack(self.model)

    def _batch_invariant(self) -> None:
        """Every projection on oneDNN's product of ``TILE_ROWS``-row tiles; what kiln has
        no invariant product for is refused by name."""
        why = ""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            why = f"it runs on the CPU in float32 (this model: {self.device.type}, {self.dtype})"
        elif not cpu_linear.available():
            why = "this torch has no oneDNN (USE_MKLDNN)"
        elif self.attention_backend != "cpu":
            why = f"it runs with attention_backend 'cpu' (this model: '{self.attention_backend}')"
        else:
            cpu_ops.warm_up()
            cpu_linear.pack(self.model, tile=cpu_linear.TILE_ROWS)
            packed = cpu_linear.PackedLinear
            left = [n for n, m in self.model.named_modules()
                    if isinstance(m, nn.Linear) and not isinstance(m, packed)]  # fmt: skip
            if left:
                why = f"its products are dense float32 projections ({left[0]} is not)"
            elif any(isinstance(m, SparseMoe) for m in self.model.modules()):
                why = "its products are dense projections (a Mixture-of-Experts layer is not)"
        if why:
            raise KilnError(
                f"llm backend: batch_invariant is supported when {why}", Status.INVALID_ARG
            )

    def _build_model(self, args: ModelArgs) -> LlamaForCausalLM:
        """The model, on the meta device (a tensor-parallel rank shapes its shard here)."""
        return build_model(args, self.config.max_model_len)

    def close(self) -> None:
        """Nothing to release in this process's runner (a tensor-parallel one stops its
        workers)."""

    def _allocate_cache(self, num_blocks: int) -> None:
        config, args = self.config, self.args
        # flex: one scratch page past the pool's, written only by CUDA graphs' dummy rows
        scratch = 1 if self.paged_flex else 0
        pages = num_blocks + scratch
        bs, heads, dim = config.block_size, args.num_key_value_heads, args.head_dim
        # flex reads the whole pool as one key sequence, slot by slot ([pages, bs, Hkv, D]);
        # the portable backend gathers head by head ([pages, Hkv, bs, D], see attention.py)
        flex = self.paged_flex
        layer = (pages, bs, heads, dim) if flex else cache_shape(pages, bs, heads, dim)
        # one allocation for all layers; each layer's attention gets views into it
        self.kv_cache = torch.zeros(
            2, args.num_hidden_layers, *layer, dtype=self.cache_dtype, device=self.device
        )
        if not self.weights_resident:  # asleep: the views are set when the model is back
            return
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]

    def _num_blocks(self) -> int:
        config = self.config
        if config.num_gpu_blocks:
            return config.num_gpu_blocks
        if config.kv_cache_memory_bytes:
            return max(config.kv_cache_memory_bytes // self.block_bytes, 1)
        # never more than the running sequences can fill at their longest: more would only
        # keep more prefix-cache entries, and the flex backend's per-step metadata grows
        # with the cache's pages
        useful = config.max_num_seqs * config.max_model_len * self.block_bytes
        useful = useful // config.block_size + self.block_bytes
        if self.device.type == "cuda":
            budget = min(self._profile_gpu(), useful)
            source = f"gpu_memory_utilization {config.gpu_memory_utilization}"
        else:
            # vLLM's 4 GiB, or a quarter of what the host has free if that is less
            budget = min(CPU_KV_CACHE_BYTES, _available_memory() // 4, useful)
            source = "the CPU default (set kv_cache_memory_bytes / --kv-cache-memory)"
        blocks = max(budget // self.block_bytes, 1)
        log.info(
            "llm: KV cache of %d blocks (%.1f MiB, %d tokens) from %s",
            blocks,
            blocks * self.block_bytes / 2**20,
            blocks * config.block_size,
            source,
        )
        return blocks

    @torch.inference_mode()
    def _profile_gpu(self) -> int:
        """The KV cache's bytes as vLLM sizes it: ``gpu_memory_utilization`` of the device
        less what is in use once the weights are loaded (this process's and any other's)
        and less the peak activation memory of one step of ``max_num_batched_tokens``
        tokens, measured by running it over a cache just large enough for it."""
        config, dev = self.config, self.device
        tokens = max(min(config.max_num_batched_tokens, config.max_model_len - 1), 1)
        blocks = -(-tokens // config.block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        self._allocate_cache(blocks)
        seq = Sequence("profile", [0] * tokens, SamplingParams(max_tokens=1, temperature=0.0))
        seq.block_table = list(range(blocks))
        out = SchedulerOutput([seq], [tokens])
        logits = self._eager(out, seq.token_ids, list(range(tokens)), [tokens - 1])
        sample(logits, [seq])
        torch.cuda.synchronize(dev)
        cache_bytes = self.kv_cache.numel() * self.kv_cache.element_size()
        peak = torch.cuda.max_memory_allocated(dev)
        del self.kv_cache, logits
        for attn in self.model.attention_layers():
            attn.k_cache = attn.v_cache = torch.empty(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        activations = max(peak - torch.cuda.memory_allocated(dev) - cache_bytes, 0)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activations
        log.info(
            "llm: GPU memory profile: %.2f GiB total, %.2f GiB in use after loading, "
            "%.2f GiB peak activations for %d tokens",
            total / 2**30,
            (total - free) / 2**30,
            activations / 2**30,
            tokens,
        )
        if budget < self.block_bytes:
            raise KilnError(
                f"llm backend: no GPU memory left for the KV cache: gpu_memory_utilization "
                f"{config.gpu_memory_utilization} of {total / 2**30:.1f} GiB is less than "
                f"the {(total - free + activations) / 2**30:.2f} GiB the weights, "
                "activations and other processes hold; raise gpu_memory_utilization or "
                "lower max_num_batched_tokens",
                Status.INVALID_ARG,
            )
        return budget

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: every layer's K and V of block ``src`` into block ``dst``."""
        if copies:
            src = torch.tensor([c[0] for c in copies], device=self.device)
            dst = torch.tensor([c[1] for c in copies], device=self.device)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> dict[int, SampledToken]:
        """Run the step; a sampled token (by ``seq_id``) for each sequence whose step reaches
        its end (its prompt is fully computed), none for a prompt chunk that does not. The
        samples waiting to be forked from a sequence draw from its logits too."""
        self.copy_blocks(out.copies)
        input_ids: list[int] = []
        positions: list[int] = []
        logit_index: list[int] = []
        samplers = []
        prompt_rows: list[tuple[Sequence, int]] = []  # (sequence, prompt token predicted)
        prompt_index: list[int] = []
        spec_index: list[int] = []
        spec_seqs: list[Sequence] = []
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            base = len(input_ids)
            ids = seq.token_ids[start : start + n]
            drafts = n - len(ids)
            if drafts:
                # the last token and its drafts: one logit row each, verified together
                assert drafts == len(seq.spec_token_ids)
                ids = ids + seq.spec_token_ids
                spec_index.extend(range(base, base + n))
                spec_seqs.append(seq)
            input_ids.extend(ids)
            positions.extend(range(start, start + n))
            if seq.wants_prompt_logprobs:
                # position p predicts prompt token p + 1: from the next one not yet known
                # (a recompute after preemption does not add them twice)
                assert seq.prompt_logprobs is not None
                first = max(start, len(seq.prompt_logprobs) - 1)
                for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_index.append(base + p - start)
                    prompt_rows.append((seq, p + 1))
            if start + n == seq.num_tokens:  # (a verifying sequence's n is larger)
                for target in (seq, *seq.forks):
                    logit_index.append(len(input_ids) - 1)
                    samplers.append(target)
        if self.lora is not None:
            self.lora.prepare(out.seqs, out.num_new_tokens, self.device)
        logits = None
        if self.graphs and not prompt_rows:
            logits = self.graphs.run(out, input_ids, positions)
        if logits is None:
            rows = logit_index + spec_index + prompt_index
            logits = self._eager(out, input_ids, positions, rows)
        verified = len(logit_index) + len(spec_index)
        if prompt_rows:
            prompt_logprobs(logits[verified:], prompt_rows)
        result = dict(
            zip(
                (s.seq_id for s in samplers),
                sample(logits[: len(logit_index)], samplers),
                strict=True,
            )
        )
        if spec_seqs:
            result.update(verify(logits[len(logit_index) : verified], spec_seqs))
        return result

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]], pooling_type: str) -> torch.Tensor:
        """One forward pass over ``prompts`` (each alone, causally, outside the KV cache);
        their pooled final hidden states [len(prompts), hidden], float32."""
        lengths = [len(p) for p in prompts]
        dev = self.device
        if self.lora is not None:
            self.lora.prepare([], [], dev)  # pooling runs the base model
        metas: StepMetadata = {w: DenseMetadata.build(lengths, dev, w) for w in self.windows}
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        rows = token_rows(lengths, pooling_type)
        if rows is None:
            hidden = self.model.hidden_states(ids, positions, metas)
            return hidden.float() if pooling_type == "ALL" else mean_pool(hidden, lengths)
        # LAST and CLS read one token each: the final norm runs on those rows alone
        hidden = self.model.hidden_states(ids, positions, metas, rows.to(dev))
        if self.args.num_labels:  # a classifier: its score head on the last token
            scores: torch.Tensor = self.model.score(hidden)
            return scores.float()
        return hidden.float()

    def _eager(
        self,
        out: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        logit_index: list[int],
        computed: list[int] | None = None,
    ) -> torch.Tensor:
        """``computed``: the tokens each sequence's cache already holds (default: its
        ``num_computed_tokens``; a draft model keeps its own count)."""
        if computed is None:
            computed = [s.num_computed_tokens for s in out.seqs]
        tables = [s.block_table for s in out.seqs]
        metas = self._metadata(tables, computed, out.num_new_tokens)
        dev = self.device
        logits: torch.Tensor = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            metas,
            torch.tensor(logit_index, dtype=torch.long, device=dev),
        )
        return logits

    def _metadata(
        self, tables: list[list[int]], computed: list[int], num_new_tokens: list[int]
    ) -> dict[int | None, AttentionMetadata | FlexMetadata]:
        """The step's attention metadata for each of the layers' windows."""
        metas: dict[int | None, AttentionMetadata | FlexMetadata] = {}
        for window in self.windows:
            if self.paged_flex:
                pages = self.kv_cache.shape[2]
                metas[window] = FlexMetadata.build(
                    tables,
                    computed,
                    num_new_tokens,
                    self.config.block_size,
                    pages,
                    self.device,
                    window=window,
                    triton_decode=self.attention_backend == "triton",
                )
            else:
                metas[window] = AttentionMetadata.build(
                    tables,
                    computed,
                    num_new_tokens,
                    self.config.block_size,
                    self.device,
                    self.args.num_key_value_heads,
                    self.workspace,
                    fused_decode=self.attention_backend == "cpu",
                    window=window,
                    every_row=self.config.batch_invariant,
                )
        return metas
