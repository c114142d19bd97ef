"""CUDA graphs for decode steps (vLLM's ``cuda_graph_sizes``; ``enforce_eager`` disables).

A decode step launches hundreds of small kernels whose CPU launch cost, not the GPU, bounds
small batches. For each capture size (1, 2, 4, 8, ... up to ``max_num_seqs``) the model's
forward pass is recorded once into a ``torch.cuda.CUDAGraph`` over static buffers: token
ids, positions and the flex backend's metadata (block tables padded to the most pages a
sequence can hold; one set per sliding window of the layers, the window itself a constant
of the graph). A pure-decode step of ``b`` sequences copies its inputs into the
buffers of the smallest size >= ``b`` and replays; the rows beyond ``b`` are dummy
sequences whose one-token context lives in a scratch page no real sequence owns. Anything
else (a prefill or chunk in the batch, a batch larger than every size) runs eagerly.

With the ``triton`` backend a decode step's whole input (token ids, positions, KV slots,
block tables, context lengths) is written by numpy into one pinned host buffer and reaches
the graphs' static buffers, views of one device buffer, in one asynchronous copy: building
a ``PagedDecode`` per step took a dozen blocking host-to-device copies, most of the host time
of an H200 batch-1 decode step (docs/design/llm-decode-staging.md).

``capture=False`` runs the same static-buffer path without recording a graph: how the
padding and in-place metadata updates are tested on a machine without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from kiln.llm.attention_flex import FlexMetadata

if TYPE_CHECKING:
    from kiln.llm.model_runner import ModelRunner
    from kiln.llm.scheduler import SchedulerOutput


def capture_sizes(max_num_seqs: int, configured: Seq[int] = ()) -> list[int]:
    """The batch sizes to capture, ascending: the configured ones up to ``max_num_seqs``,
    or powers of two up to it and ``max_num_seqs`` itself."""
    if configured:
        return sorted({s for s in configured if 0 < s <= max_num_seqs})
    sizes = {max_num_seqs}
    size = 1
    while size < max_num_seqs:
        sizes.add(size)
        size *= 2
    return sorted(sizes)


def pick_size(sizes: Seq[int], batch: int) -> int | None:
    """The smallest captured size that holds ``batch`` sequences (None: run eagerly)."""
    return next((s for s in sizes if s >= batch), None)


def is_pure_decode(out: SchedulerOutput) -> bool:
    """A step a decode graph can run: one new token per sequence, each sampled once."""
    return bool(out.seqs) and all(
        n == 1 and seq.num_computed_tokens + 1 == seq.num_tokens and not seq.forks
        for seq, n in zip(out.seqs, out.num_new_tokens, strict=True)
    )


def pad_decode_batch(
    tables: list[list[int]], computed: list[int], size: int, scratch_page: int
) -> tuple[list[list[int]], list[int]]:
    """Block tables and context offsets of ``size`` rows: the real ones, then dummies whose
    single token sits at position 0 of the scratch page."""
    pad = size - len(tables)
    return tables + [[scratch_page]] * pad, computed + [0] * pad


@dataclass(slots=True)
class _Graph:
    #: by the layers' sliding windows (None: full attention)
    metas: dict[int | None, FlexMetadata]
    logits: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None


class _Staging:
    """A decode step's inputs for the ``triton`` backend: one pinned host buffer written by
    numpy, one device buffer whose views the graphs read, one copy between them per step.

    Layout (bytes): int64 rows ``[4, biggest]`` (token ids, positions, KV slots, each row's
    token index), int32 ``[biggest]`` context lengths, int32 ``[biggest, width]`` block
    tables; a step of ``size`` rows copies the prefix up to its last table row."""

    def __init__(self, biggest: int, width: int, device: torch.device) -> None:
        self.biggest, self.width = biggest, width
        self.tables_at = 4 * biggest * 8 + 4 * biggest
        nbytes = self.tables_at + 4 * biggest * width
        pinned = device.type == "cuda" and torch.cuda.is_available()
        self.host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.device = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_rows, self.host_lens, self.host_tables = self._views(self.host)
        self.rows, self.lens, self.tables = self._views(self.device)
        self.np_rows = self.host_rows.numpy()
        self.np_lens = self.host_lens.numpy()
        self.np_tables = self.host_tables.numpy()
        self.np_rows[3] = np.arange(biggest)  # decode rows: one token each, in order
        self.device.copy_(self.host)
        #: recorded after each copy: the host buffer is rewritten only once it has been read
        self.copied = torch.cuda.Event() if pinned else None  # type: ignore[no-untyped-call]

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, w = self.biggest, self.width
        rows = buf[: 4 * b * 8].view(torch.int64).view(4, b)
        lens = buf[4 * b * 8 : self.tables_at].view(torch.int32)
        tables = buf[self.tables_at :].view(torch.int32).view(b, w)
        return rows, lens, tables

    def write(
        self,
        input_ids: list[int],
        positions: list[int],
        tables: list[list[int]],
        computed: list[int],
        size: int,
        block_size: int,
        scratch_page: int,
    ) -> None:
        """Fill rows ``0 .. size-1`` (``len(input_ids)`` real ones, then dummies whose one
        token sits at slot 0 of the scratch page) and queue their copy."""
        if self.copied is not None:
            self.copied.synchronize()
        batch = len(input_ids)
        rows, lens, pages = self.np_rows, self.np_lens, self.np_tables
        rows[0, :batch] = input_ids
        rows[1, :batch] = positions
        rows[2, :batch] = [t[c // block_size] * block_size + c % block_size
                           for t, c in zip(tables, computed, strict=True)]  # fmt: skip
        lens[:batch] = computed
        lens[:batch] += 1
        for r, (t, c) in enumerate(zip(tables, computed, strict=True)):
            used = c // block_size + 1  # entries past a row's length are never read
            pages[r, :used] = t[:used]
        rows[:3, batch:size] = 0
        rows[2, batch:size] = scratch_page * block_size
        lens[batch:size] = 1
        pages[batch:size, 0] = scratch_page
        end = self.tables_at + 4 * size * self.width
        self.device[:end].copy_(self.host[:end], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, sizes: list[int], capture: bool = True) -> None:
        self.runner = runner
        self.sizes = sizes
        self.capture = capture
        self.block_size = runner.config.block_size
        self.scratch_page = runner.num_blocks
        self.max_pages = -(-runner.config.max_model_len // self.block_size)
        biggest = max(sizes)
        dev = runner.device
        self.logit_index = torch.arange(biggest, device=dev)
        #: decode steps served from the static buffers (replayed, or run over them uncaptured)
        self.num_replays = 0
        self.graphs = {size: _Graph(self._metadata([], [], size)) for size in sizes}
        self.staging: _Staging | None = None
        if runner.attention_backend == "triton":
            self.staging = _Staging(biggest, self.max_pages, dev)
            self.input_ids, self.positions = self.staging.rows[0], self.staging.rows[1]
            for size, entry in self.graphs.items():
                for meta in entry.metas.values():
                    assert meta.decode is not None and not meta.groups
                    meta.slot_mapping = self.staging.rows[2, :size]
                    meta.decode.token_index = self.staging.rows[3, :size]
                    meta.decode.seq_lens = self.staging.lens[:size]
                    meta.decode.block_table = self.staging.tables[:size]
        else:
            self.input_ids = torch.zeros(biggest, dtype=torch.long, device=dev)
            self.positions = torch.zeros(biggest, dtype=torch.long, device=dev)
        if capture:
            self._capture_all()

    def _metadata(
        self, tables: list[list[int]], computed: list[int], size: int
    ) -> dict[int | None, FlexMetadata]:
        tables, computed = pad_decode_batch(tables, computed, size, self.scratch_page)
        return {
            window: FlexMetadata.build(
                tables,
                computed,
                [1] * size,
                self.block_size,
                self.scratch_page + 1,
                self.runner.device,
                max_pages_per_seq=self.max_pages,
                window=window,
                triton_decode=self.runner.attention_backend == "triton",
            )
            for window in self.runner.windows
        }

    def _forward(self, size: int) -> torch.Tensor:
        model = self.runner.model
        logits: torch.Tensor = model(
            self.input_ids[:size],
            self.positions[:size],
            self.graphs[size].metas,
            self.logit_index[:size],
        )
        return logits

    @torch.inference_mode()
    def _capture_all(self) -> None:
        # The streams, the pool and the capture are the current device's: make it the
        # model's (an instance on cuda:1 runs on a thread whose current device is 0).
        with torch.cuda.device(self.runner.device):
            # Largest first, all in one memory pool: smaller graphs reuse the larger ones'.
            pool = torch.cuda.graph_pool_handle()
            # torch.cuda.graph's own capture stream is made once per process, on whichever
            # device was current then: capture on a stream of this device, the same for all
            # sizes (as its docs ask of captures sharing a pool)
            capture = torch.cuda.Stream()  # type: ignore[no-untyped-call]
            for size in sorted(self.sizes, reverse=True):
                # Warm up on a side stream (as PyTorch's docs ask): the first calls compile
                # the flex kernels and let allocators settle, none of which may happen in
                # capture. The dummy rows only ever write the scratch page.
                side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self._forward(size)
                torch.cuda.current_stream().wait_stream(side)
                entry = self.graphs[size]
                entry.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(entry.graph, pool=pool, stream=capture):
                    entry.logits = self._forward(size)
            torch.cuda.synchronize()

    def run(
        self, out: SchedulerOutput, input_ids: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        """Logits [len(out.seqs), vocab] from a graph, or None when the step must run
        eagerly."""
        if not is_pure_decode(out):
            return None
        batch = len(out.seqs)
        size = pick_size(self.sizes, batch)
        if size is None:
            return None
        entry = self.graphs[size]
        tables = [s.block_table for s in out.seqs]
        computed = [s.num_computed_tokens for s in out.seqs]
        if self.staging is not None:
            self.staging.write(
                input_ids, positions, tables, computed, size, self.block_size, self.scratch_page
            )
        else:
            pad = [0] * (size - batch)
            self.input_ids[:size].copy_(torch.tensor(input_ids + pad), non_blocking=True)
            self.positions[:size].copy_(torch.tensor(positions + pad), non_blocking=True)
            step = self._metadata(tables, computed, size)
            for window, meta in entry.metas.items():
                meta.copy_(step[window])
        self.num_replays += 1
        if entry.graph is None:
            logits = self._forward(size)
        else:
            # replay launches on the current device's current stream: the model's, where the
            # copies above were queued
            with torch.cuda.device(self.runner.device):
                entry.graph.replay()
            assert entry.logits is not None
            logits = entry.logits
        # a copy: the next replay overwrites the graph's output buffer
        return logits[:batch].clone()
