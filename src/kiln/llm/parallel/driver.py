"""Rank 0: the engine's model runner when ``tensor_parallel_size`` > 1. It runs in the
engine's process, starts ranks 1..N-1 as ``python -m kiln.llm.parallel.worker`` processes,
sends each step's inputs to them before computing its own shard, and samples from the
logits it alone computes."""

from __future__ import annotations

import logging
import os
import pickle
import select
import subprocess
import sys
import time
import weakref

import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from kiln.core.errors import KilnError, Status
from kiln.llm.checkpoint import Checkpoint
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.encoder_runner import EncoderRunner
from kiln.llm.model_runner import ModelRunner
from kiln.llm.parallel import comm, shard
from kiln.llm.parallel.rank import RankRunner
from kiln.llm.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

#: how long a stopping worker may take before it is killed
STOP_TIMEOUT_S = 10.0


def create_runner(
    checkpoint: Checkpoint, args: ModelArgs, config: EngineConfig
) -> ModelRunner | EncoderRunner:
    """The model runner for ``config``: one device's, or rank 0 of a tensor-parallel group
    (refused first, naming the reason, when the model cannot be split that way)."""
    if args.is_encoder:
        return EncoderRunner(checkpoint, args, config)
    if config.tensor_parallel_size == 1:
        return ModelRunner(checkpoint, args, config)
    shard.check(args, config, checkpoint.config(), checkpoint.path)
    return DriverRunner(checkpoint, args, config)


def _stop(workers: list[subprocess.Popen[bytes]]) -> None:
    """Ask every worker to stop, then kill whoever has not within the timeout (also run
    at garbage collection and interpreter exit: no worker outlives its engine)."""
    for proc in workers:
        if proc.poll() is None and proc.stdin is not None:
            try:
                comm.write_frame(proc.stdin, comm.encode_stop())
                proc.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in workers:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()


def _exit_text(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"


class DriverRunner(RankRunner):
    def __init__(self, checkpoint: Checkpoint, args: ModelArgs, config: EngineConfig) -> None:
        n = config.tensor_parallel_size
        self.name = config.served_model_name or checkpoint.path.name
        self.workers: list[subprocess.Popen[bytes]] = []
        #: steps go to the workers once the load is done (the load's own collectives,
        #: a GPU's profiling step, run in lockstep on every rank without a message)
        self._live = False
        #: set once a worker died or a step failed half way: the ranks are out of step
        self._broken: KilnError | None = None
        self._lines: dict[int, bytes] = {}
        device = torch.device(config.device)
        store = TCPStore("127.0.0.1", 0, n, is_master=True, wait_for_workers=False)
        self._finalizer = weakref.finalize(self, _stop, self.workers)
        try:
            # rank 0's own threads keep their count; each worker takes a share of the cores
            threads = max(torch.get_num_threads() // n, 1)
            for rank in range(1, n):
                self.workers.append(self._spawn(rank, checkpoint, config, store.port, threads))
            self._expect("hello")
            if device.type == "cuda":
                torch.cuda.set_device(device)
            group = comm.new_group(store, 0, n, device)
            super().__init__(checkpoint, args, config, 0, group, lambda: self._expect("loaded"))
        except BaseException:
            self.close()
            raise
        self._store = store
        self._live = True
        log.info(
            "model '%s': tensor parallel over %d ranks (%s), worker pids %s",
            self.name,
            n,
            "NCCL" if device.type == "cuda" else "gloo",
            [p.pid for p in self.workers],
        )

    def _spawn(
        self, rank: int, checkpoint: Checkpoint, config: EngineConfig, port: int, threads: int
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.llm.parallel.worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,  # the worker's replies: hello, loaded or error
        )
        assert proc.stdin is not None
        init = {
            "path": str(checkpoint.path),
            "config": config,
            "rank": rank,
            "port": port,
            "threads": threads,
        }
        # once, at start: the steps are int64 arrays (comm.encode_step)
        comm.write_frame(proc.stdin, pickle.dumps(init))
        return proc

    def _expect(self, word: str) -> None:
        """Wait for every worker's ``word``; a worker that reports an error or exits fails
        the load with its reason."""
        for rank, proc in enumerate(self.workers, start=1):
            line = self._read_line(rank, proc)
            if line.startswith("error "):
                raise KilnError(
                    f"model '{self.name}': tensor-parallel rank {rank} failed to load: "
                    f"{line.removeprefix('error ')}",
                    Status.INVALID_ARG,
                )
            if line != word:
                raise KilnError(
                    f"model '{self.name}': tensor-parallel rank {rank} answered {line!r} "
                    f"instead of {word!r}",
                    Status.INTERNAL,
                )

    def _read_line(self, rank: int, proc: subprocess.Popen[bytes]) -> str:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        buffer = self._lines.get(rank, b"")
        while b"\n" not in buffer:
            ready, _, _ = select.select([fd], [], [], 1.0)
            chunk = os.read(fd, 4096) if ready else b""
            if ready and not chunk:
                code = proc.wait()
                raise KilnError(
                    f"model '{self.name}': tensor-parallel rank {rank} {_exit_text(code)} "
                    "while loading (its log is above)",
                    Status.INTERNAL,
                )
            buffer += chunk
        line, _, rest = buffer.partition(b"\n")
        self._lines[rank] = rest
        return line.decode(errors="replace")

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers]

    def close(self) -> None:
        self._live = False
        self._finalizer()

    def _dead_worker(self) -> KilnError | None:
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                return KilnError(
                    f"model '{self.name}': tensor-parallel worker rank {rank} of "
                    f"{self.config.tensor_parallel_size} {_exit_text(code)}; the model's "
                    "requests fail until it is loaded again",
                    Status.UNAVAILABLE,
                )
        return None

    def _send(self, msg: bytes) -> None:
        if self._broken is None:
            self._broken = self._dead_worker()
        if self._broken is not None:
            raise self._broken
        try:
            for proc in self.workers:
                assert proc.stdin is not None
                comm.write_frame(proc.stdin, msg)
        except OSError as exc:
            raise self._fail(exc) from exc

    def _fail(self, exc: BaseException) -> KilnError:
        """The error of a step that failed with the ranks in it: they are out of step (a
        collective half done), so every later step fails too, until a reload."""
        time.sleep(0.1)  # a worker's exit is what usually broke the collective
        self._broken = self._dead_worker() or KilnError(
            f"model '{self.name}': a tensor-parallel step failed ({exc}); the ranks are out "
            "of step and the model's requests fail until it is loaded again",
            Status.INTERNAL,
        )
        return self._broken

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies and self._live:
            self._send(comm.encode_copies(copies))
        super().copy_blocks(copies)

    def _eager(
        self,
        out: SchedulerOutput,
        input_ids: list[int],
        positions: list[int],
        logit_index: list[int],
        computed: list[int] | None = None,
    ) -> torch.Tensor:
        if not self._live:
            return super()._eager(out, input_ids, positions, logit_index, computed)
        if computed is None:
            computed = [s.num_computed_tokens for s in out.seqs]
        tables = [s.block_table for s in out.seqs]
        self._send(comm.encode_step(tables, computed, out.num_new_tokens, input_ids, positions))
        try:
            return super()._eager(out, input_ids, positions, logit_index, computed)
        except Exception as exc:
            raise self._fail(exc) from exc
