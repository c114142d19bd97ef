"""Ranks 1..N-1 of a tensor-parallel model: ``python -m kiln.llm.parallel.worker``, started
by rank 0 (``driver.py``). It loads its shard, then computes every step rank 0 sends it,
up to the last layer (rank 0 alone computes the logits and samples).

stdin: frames from rank 0 (the start settings once, then steps, copies, stop). The
original stdout: one line per stage (``hello``, ``loaded``, or ``error <reason>``); the
process's own stdout goes to stderr, so a library's print cannot garble those lines.
End-of-file on stdin (rank 0 closed it, or died) ends the worker, as does a parent that
is gone (a rank stuck in a collective reads no stdin).
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from kiln.llm.checkpoint import open_checkpoint
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.parallel import comm
from kiln.llm.parallel.rank import RankRunner
from kiln.llm.scheduler import SchedulerOutput

log = logging.getLogger("kiln.llm.parallel.worker")


class WorkerRunner(RankRunner):
    def handle(self, msg: bytes) -> None:
        kind = comm.kind(msg)
        if kind == comm.COPY:
            self.copy_blocks(comm.decode_copies(msg))
        elif kind == comm.STEP:
            tables, computed, new, ids, positions = comm.decode_step(msg)
            self._forward(tables, computed, new, ids, positions)
        else:
            raise ValueError(f"unknown message kind {kind}")

    @torch.inference_mode()
    def _forward(
        self,
        tables: list[list[int]],
        computed: list[int],
        num_new_tokens: list[int],
        input_ids: list[int],
        positions: list[int],
    ) -> torch.Tensor:
        metas = self._metadata(tables, computed, num_new_tokens)
        dev = self.device
        hidden, _ = self.model._layers(
            torch.tensor(input_ids, device=dev), torch.tensor(positions, device=dev), metas
        )
        return hidden

    def _eager(
        self,
        out: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        logit_index: list[int],
        computed: list[int] | None = None,
    ) -> torch.Tensor:
        # only the load's GPU profiling step comes here (steps come through ``handle``)
        if computed is None:
            computed = [s.num_computed_tokens for s in out.seqs]
        tables = [s.block_table for s in out.seqs]
        hidden = self._forward(tables, computed, out.num_new_tokens, input_ids, positions)
        return hidden[torch.tensor(logit_index, device=hidden.device)]


def _watch_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def _load(init: dict[str, Any], replies: IO[str]) -> WorkerRunner:
    rank: int = init["rank"]
    config: EngineConfig = init["config"]
    n = config.tensor_parallel_size
    device = torch.device(config.device)
    if device.type == "cuda":  # rank r on the r-th GPU after rank 0's
        device = torch.device("cuda", (device.index or 0) + rank)
        config = replace(config, device=str(device))
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(init["threads"])
    store = TCPStore("127.0.0.1", init["port"], n, is_master=False)
    replies.write("hello\n")
    group = comm.new_group(store, rank, n, device)
    checkpoint = open_checkpoint(Path(init["path"]))
    args = ModelArgs.from_dict(checkpoint.config())

    def loaded() -> None:
        replies.write("loaded\n")

    return WorkerRunner(checkpoint, args, config, rank, group, loaded)


def main() -> int:
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    frame = comm.read_frame(stdin)
    if frame is None:
        return 1
    init = pickle.loads(frame)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        format=f"%(asctime)s tp-rank{init['rank']} %(levelname)s %(name)s: %(message)s",
    )
    _watch_parent()
    try:
        runner = _load(init, replies)
    except Exception as exc:
        log.exception("tensor-parallel rank %d failed to load", init["rank"])
        replies.write("error " + " ".join(str(exc).split()) + "\n")
        return 1
    while True:
        msg = comm.read_frame(stdin)
        if msg is None or comm.kind(msg) == comm.STOP:
            return 0
        runner.handle(msg)


if __name__ == "__main__":
    try:
        code = main()
    except BaseException:
        log.exception("tensor-parallel worker failed")
        code = 1
    logging.shutdown()
    sys.stdout.flush()
    # no process-group teardown: a peer may be gone already, and gloo's could wait on it
    os._exit(code)
