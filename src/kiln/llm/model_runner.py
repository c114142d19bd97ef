"""Loads the weights, owns the KV-cache tensors, and runs one scheduled step."""

from __future__ import annotations

from pathlib import Path

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm import attention_cpu, cpu_ops
from kiln.llm.attention import AttentionMetadata, DenseMetadata, KVWorkspace, cache_shape
from kiln.llm.attention_flex import FlexMetadata, resolve_attention_backend
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.cuda_graphs import DecodeGraphs, capture_sizes
from kiln.llm.models.llama import LlamaForCausalLM, StepMetadata
from kiln.llm.pooling import mean_pool, token_rows
from kiln.llm.sampler import SampledToken, prompt_logprobs, sample
from kiln.llm.scheduler import SchedulerOutput
from kiln.llm.sequence import Sequence

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_weights(model: LlamaForCausalLM, folder: Path) -> None:
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise KilnError(f"llm backend: no *.safetensors file in {folder}", Status.INVALID_ARG)
    expected = set(model.state_dict())
    seen: set[str] = set()
    for path in files:
        tensors = load_file(str(path))
        unknown = set(tensors) - expected
        if unknown:
            raise KilnError(
                f"llm backend: {path.name} holds weights kiln's "
                f"{model.args.architecture} does not have: {sorted(unknown)[:5]}",
                Status.INVALID_ARG,
            )
        model.load_state_dict(tensors, strict=False)
        seen |= set(tensors)
    missing = expected - seen
    if model.args.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise KilnError(
            f"llm backend: weights missing from {folder}: {sorted(missing)[:5]}",
            Status.INVALID_ARG,
        )


class ModelRunner:
    def __init__(self, folder: Path, args: ModelArgs, config: EngineConfig) -> None:
        if config.dtype not in DTYPES:
            raise KilnError(
                f"llm backend: dtype '{config.dtype}' is not one of {sorted(DTYPES)}",
                Status.INVALID_ARG,
            )
        self.args = args
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        with torch.device("meta"):
            model = LlamaForCausalLM(args, config.max_model_len)
        model = model.to_empty(device=self.device)
        # rope tables are computed, not loaded: rebuild them off the meta device
        model.model.rotary_emb.rebuild(self.device)
        load_weights(model, folder)
        if args.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        self.model = model.to(self.dtype).eval()
        self.model.fuse()
        #: the layers' distinct sliding windows (None: full attention), a metadata each step
        self.windows = self.model.windows()
        self.block_bytes = (
            2
            * args.num_hidden_layers
            * config.block_size
            * args.num_key_value_heads
            * args.head_dim
            * self.dtype.itemsize
        )
        self.num_blocks = config.num_gpu_blocks or max(
            config.kv_cache_memory_bytes // self.block_bytes, 1
        )
        self.attention_backend = resolve_attention_backend(
            config.attention_backend, self.device, config.block_size, self.dtype
        )
        if self.attention_backend == "cpu":
            attention_cpu.warm_up()
        if self.device.type == "cpu" and self.dtype == torch.float32:
            cpu_ops.warm_up()
        # flex: one scratch page past the pool's, written only by CUDA graphs' dummy rows
        scratch = 1 if self.attention_backend == "flex" else 0
        pages = self.num_blocks + scratch
        bs, heads, dim = config.block_size, args.num_key_value_heads, args.head_dim
        # flex reads the whole pool as one key sequence, slot by slot ([pages, bs, Hkv, D]);
        # the portable backend gathers head by head ([pages, Hkv, bs, D], see attention.py)
        flex = self.attention_backend == "flex"
        layer = (pages, bs, heads, dim) if flex else cache_shape(pages, bs, heads, dim)
        # one allocation for all layers; each layer's attention gets views into it
        self.kv_cache = torch.zeros(
            2, args.num_hidden_layers, *layer, dtype=self.dtype, device=self.device
        )
        self.workspace = KVWorkspace()
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache = self.kv_cache[0, i]
            attn.v_cache = self.kv_cache[1, i]
        self.graphs: DecodeGraphs | None = None
        # graphs need the flex backend's fixed-shape metadata, and a GPU
        use_graphs = self.attention_backend == "flex" and not config.enforce_eager
        if use_graphs and self.device.type == "cuda" and torch.cuda.is_available():
            sizes = capture_sizes(config.max_num_seqs, config.cuda_graph_sizes)
            self.graphs = DecodeGraphs(self, sizes)

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
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            base = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            if seq.wants_prompt_logprobs:
                # position p predicts prompt token p + 1: from the next one not yet known
                # (a recompute after preemption does not add them twice)
                assert seq.prompt_logprobs is not None
                first = max(start, len(seq.prompt_logprobs) - 1)
                for p in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                    prompt_index.append(base + p - start)
                    prompt_rows.append((seq, p + 1))
            if start + n == seq.num_tokens:
                for target in (seq, *seq.forks):
                    logit_index.append(len(input_ids) - 1)
                    samplers.append(target)
        logits = None
        if self.graphs and not prompt_rows:
            logits = self.graphs.run(out, input_ids, positions)
        if logits is None:
            logits = self._eager(out, input_ids, positions, logit_index + prompt_index)
        if prompt_rows:
            prompt_logprobs(logits[len(logit_index) :], prompt_rows)
            logits = logits[: len(logit_index)]
        sampled = sample(logits, samplers)
        return dict(zip((s.seq_id for s in samplers), sampled, strict=True))

    @torch.inference_mode()
    def pool(self, prompts: list[list[int]], pooling_type: str) -> torch.Tensor:
        """One forward pass over ``prompts`` (each alone, causally, outside the KV cache);
        their pooled final hidden states [len(prompts), hidden], float32."""
        lengths = [len(p) for p in prompts]
        dev = self.device
        metas: StepMetadata = {w: DenseMetadata.build(lengths, dev, w) for w in self.windows}
        ids = torch.tensor([t for p in prompts for t in p], device=dev)
        positions = torch.cat([torch.arange(n) for n in lengths]).to(dev)
        rows = token_rows(lengths, pooling_type)
        if rows is None:
            return mean_pool(self.model.hidden_states(ids, positions, metas), lengths)
        # LAST and CLS read one token each: the final norm runs on those rows alone
        hidden = self.model.hidden_states(ids, positions, metas, rows.to(dev))
        return hidden.float()

    def _eager(
        self,
        out: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        logit_index: list[int],
    ) -> torch.Tensor:
        tables = [s.block_table for s in out.seqs]
        computed = [s.num_computed_tokens for s in out.seqs]
        metas: dict[int | None, AttentionMetadata | FlexMetadata] = {}
        for window in self.windows:
            if self.attention_backend == "flex":
                pages = self.kv_cache.shape[2]
                metas[window] = FlexMetadata.build(
                    tables,
                    computed,
                    out.num_new_tokens,
                    self.config.block_size,
                    pages,
                    self.device,
                    window=window,
                )
            else:
                metas[window] = AttentionMetadata.build(
                    tables,
                    computed,
                    out.num_new_tokens,
                    self.config.block_size,
                    self.device,
                    self.args.num_key_value_heads,
                    self.workspace,
                    fused_decode=self.attention_backend == "cpu",
                    window=window,
                )
        dev = self.device
        logits: torch.Tensor = self.model(
            torch.tensor(input_ids, device=dev),
            torch.tensor(positions, device=dev),
            metas,
            torch.tensor(logit_index, dtype=torch.long, device=dev),
        )
        return logits
