"""Speculative decoding's draft model (vLLM's ``method: draft_model``): a smaller model
with the target's vocabulary proposes ``k`` tokens a step, one forward pass per token.

It shares the target's paged layout: the same block size and block tables, its own K/V
tensors with as many blocks. Each sequence's ``num_draft_computed`` counts the leading
tokens whose draft K/V is in those blocks; a proposal first catches up on the tokens the
target accepted since (or the whole prompt, the first time), then drafts one token per
pass. The slots it writes are the ones the scheduler reserved for the step's drafts.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from kiln.core.errors import KilnError, Status
from kiln.llm.checkpoint import open_checkpoint, torch_dtype_name
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.model_runner import ModelRunner, resolve_dtype
from kiln.llm.sampler import _argmax, _exponentials, apply_logit_bias, filtered_probs
from kiln.llm.scheduler import SchedulerOutput
from kiln.llm.sequence import Sequence

log = logging.getLogger(__name__)


class DraftProposer:
    def __init__(
        self, path: Path, target: ModelArgs, config: EngineConfig, num_blocks: int
    ) -> None:
        checkpoint = open_checkpoint(path)
        raw = checkpoint.config()
        args = ModelArgs.from_dict(raw)
        if args.vocab_size != target.vocab_size:
            raise KilnError(
                f"llm backend: speculative_config: the draft model {path} has a vocabulary "
                f"of {args.vocab_size} tokens, the target {target.vocab_size}: a draft must "
                "share the target's tokenizer and vocabulary",
                Status.INVALID_ARG,
            )
        dtype = resolve_dtype("auto", torch_dtype_name(raw), torch.device(config.device))
        if config.device.startswith("cuda"):
            dtype = config.dtype  # K/V and logits in the target's dtype
        draft_config = replace(
            config,
            dtype=dtype,
            num_gpu_blocks=num_blocks,
            enforce_eager=True,  # its chunks and single tokens run eagerly
            speculative_config=None,
            lora_config=None,  # adapters are the target's: drafts come from the base draft
        )
        self.runner = ModelRunner(checkpoint, args, draft_config)
        self.args = args
        log.info(
            "llm: draft model %s (%d layers, hidden %d) proposes for the target",
            path,
            args.num_hidden_layers,
            args.hidden_size,
        )

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, rooms: dict[int, int]) -> None:
        """Set ``spec_token_ids`` (and, for sampled requests, ``spec_probs``) of the
        sequences of ``out`` given room (``rooms``: drafts by ``seq_id``)."""
        runner = self.runner
        runner.copy_blocks(out.copies)  # copy-on-write copies apply to the draft's K/V too
        seqs = [s for s in out.seqs if rooms.get(s.seq_id, 0) > 0]
        for seq in seqs:
            seq.spec_token_ids = []
        probs: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        step = 0
        while seqs:
            input_ids: list[int] = []
            positions: list[int] = []
            logit_index: list[int] = []
            computed: list[int] = []
            lengths: list[int] = []
            for seq in seqs:
                context = seq.token_ids + seq.spec_token_ids
                start = seq.num_draft_computed
                input_ids.extend(context[start:])
                positions.extend(range(start, len(context)))
                logit_index.append(len(input_ids) - 1)
                computed.append(start)
                lengths.append(len(context) - start)
            chunk = SchedulerOutput(list(seqs), lengths)
            logits = runner._eager(chunk, input_ids, positions, logit_index, computed)
            tokens, rows = self._draw(logits, seqs)
            for seq, token, row in zip(seqs, tokens, rows, strict=True):
                seq.num_draft_computed = seq.num_tokens + len(seq.spec_token_ids)
                seq.spec_token_ids.append(token)
                if row is not None:
                    probs[seq.seq_id].append(row)
            step += 1
            seqs = [s for s in seqs if rooms[s.seq_id] > step]
        for seq in out.seqs:
            rows_ = probs.get(seq.seq_id)
            seq.spec_probs = torch.stack(rows_) if rows_ else None

    def _draw(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Each sequence's draft token, drawn as the target would draw (its bias,
        temperature, min-p, top-k, top-p), and the distribution it came from (None:
        greedy, where verification compares with the target's argmax)."""
        logits = logits.float()
        if any(s.params.logit_bias for s in seqs):
            logits = apply_logit_bias(logits, seqs)
        tokens = _argmax(logits)
        if not any(s.params.temperature > 0 for s in seqs):
            return [int(t) for t in tokens.tolist()], [None] * len(seqs)
        probs = filtered_probs(logits, seqs)
        drawn = _argmax(probs / _exponentials(probs, seqs))
        greedy = torch.tensor([s.params.temperature == 0 for s in seqs], device=logits.device)
        tokens = torch.where(greedy.to(tokens.device), tokens, drawn.to(tokens.device))
        rows: list[torch.Tensor | None] = [
            None if s.params.temperature == 0 else probs[i] for i, s in enumerate(seqs)
        ]
        return [int(t) for t in tokens.tolist()], rows
