"""GPU kernels in the Triton language (``attention_backend: triton``, the default on CUDA).

- ``decode_attention``: paged decode attention, one query token per sequence, reading K/V
  in place from the flex layout's pages through each sequence's block table (vLLM's Triton
  attention backend does the same), with GQA, sliding windows and soft-capping;
- ``elementwise``: RMSNorm (alone, and fused with the residual add as vLLM's
  ``fused_add_rms_norm``), SiLU-and-mul, and rotate-half RoPE in place on the fused q/k/v.

Triton ships with torch's CUDA builds; on a CPU-only install it is the ``test`` extra, and
``TRITON_INTERPRET=1`` runs the same kernels on CPU tensors (how they are tested without a
GPU). Nothing here imports triton until a kernel is called, so the metadata below is usable
on a machine without it.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch


def interpreting() -> bool:
    """Triton's interpreter runs the kernels on CPU tensors (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def problem(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on ``device`` (None: they can)."""
    if not available():
        return "needs triton (shipped with torch's CUDA builds)"
    if device.type != "cuda" and not interpreting():
        return f"runs on a CUDA GPU, not on {device.type} (TRITON_INTERPRET=1: CPU tests)"
    return None


def enable(model: torch.nn.Module) -> int:
    """Switch the model's norms, MLPs and attentions that have a Triton path to it (their
    ``use_triton`` attribute); returns how many modules were switched."""
    count = 0
    for module in model.modules():
        if hasattr(module, "use_triton"):
            setattr(module, "use_triton", True)  # noqa: B010 - an nn.Module's attribute
            count += 1
    return count


#: block tables of at most this many entries are built from a padded Python list (fewer
#: torch calls: 0.08 against 0.15 ms at batch 1, width 128); larger ones by a masked scatter
#: (0.6 against 0.8-1.5 ms at batch 64); benchmarks/llm_decode_metadata.py
SMALL_TABLE = 2048


@dataclass(slots=True)
class PagedDecode:
    """One decode step's sequences for ``decode_attention`` (a fixed shape under CUDA
    graphs: the width is the most pages a sequence can hold)."""

    #: [B] row of each sequence's query among the step's flat tokens
    token_index: torch.Tensor
    #: [B, width] int32 physical page of each logical page (padding: 0, never read)
    block_table: torch.Tensor
    #: [B] int32 tokens in each sequence's context, the new one included
    seq_lens: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.token_index, self.block_table, self.seq_lens]

    @classmethod
    def build(
        cls,
        tables: list[list[int]],
        computed: list[int],
        starts: list[int],
        block_size: int,
        device: torch.device,
        width: int = 0,
    ) -> PagedDecode:
        """``computed``: tokens already in each sequence's cache; ``width``: pad the block
        table to it (0: as wide as this step needs)."""
        used = [-(-(c + 1) // block_size) for c in computed]
        width = max(width, *used)
        if len(used) * width <= SMALL_TABLE:
            rows = [t[:n] + [0] * (width - n) for t, n in zip(tables, used, strict=True)]
            table = torch.tensor(rows, dtype=torch.int32)
        else:
            # the pages in use as one tensor, scattered into the padded rows: no Python list
            # of batch x width ints (a CUDA graph's width: the most pages a sequence holds)
            pages = [p for t, n in zip(tables, used, strict=True) for p in t[:n]]
            table = torch.zeros(len(used), width, dtype=torch.int32)
            counts = torch.tensor(used)
            table[torch.arange(width)[None, :] < counts[:, None]] = torch.tensor(
                pages, dtype=torch.int32
            )
        return cls(
            token_index=torch.tensor(starts, dtype=torch.long).to(device),
            block_table=table.to(device),
            seq_lens=torch.tensor([c + 1 for c in computed], dtype=torch.int32).to(device),
        )
