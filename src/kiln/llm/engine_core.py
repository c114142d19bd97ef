"""The engine process (vLLM V1's EngineCore): scheduler, block manager, model runner,
sampler, grammar matchers, speculative decoding and pooling, in a process of their own.

    python -m kiln.llm.engine_core --fd N

``engine_proc.EngineProcClient`` starts it with one end of a socketpair; the first frame
is the pickled ``EngineInit``, the answer the engine's resolved settings. From then on the
frames are ``engine_messages``: ``Commands`` in, one ``Step`` out per step.

The server process keeps HTTP, tokenization, detokenization and streaming: on two cores
this process computes while the other runs the frontends, and neither holds the other's
GIL. When the server dies, the socket reads end-of-file (and a watcher thread sees the
parent gone, mid-step too) and this process exits: never an orphan holding the model's
memory.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection
from pathlib import Path

from kiln.core.errors import KilnError, Status
from kiln.core.heap import freeze_startup_heap
from kiln.llm import engine_messages as msg
from kiln.llm.config import EngineConfig
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.engine_control import PENDING, EngineControl, held_ends
from kiln.llm.structured import GrammarCompiler
from kiln.llm.tokenizer import Tokenizer

log = logging.getLogger("kiln.llm.engine_core")
#: a snapshot of the counters at least this often while the engine runs (seconds)
SNAPSHOT_INTERVAL = 0.1


@dataclass(slots=True)
class EngineInit:
    """What the engine process needs to build the engine (sent once, pickled)."""

    name: str
    folder: Path
    tokenizer: Path
    settings: EngineConfig
    #: end-of-turn ids beyond config.json's: the tokenizer's, generation_config.json's
    extra_eos: tuple[int | None, ...] = ()
    #: torch's intra-op threads (0: one per CPU this process may run on)
    threads: int = 0


def build_engine(
    folder: Path, tokenizer: Tokenizer, settings: EngineConfig, extra_eos: Sequence[int | None]
) -> LLMEngine:
    """The engine with the model's end-of-turn ids and its structured-output compiler
    (the same in the server's thread and in the engine process)."""
    engine = LLMEngine(folder, settings)
    eos = engine.args.eos_token_ids
    for token in extra_eos:
        if token is not None and token not in eos:
            eos = (*eos, token)
    engine.args = replace(engine.args, eos_token_ids=eos)
    engine.grammars = GrammarCompiler(tokenizer, engine.args.vocab_size, eos)
    return engine


@dataclass(order=True, slots=True)
class _Job:
    """A pooling request: its prompts run in batches between the steps."""

    priority: int
    job_id: int
    prompts: list[list[int]] = field(compare=False)
    done: int = field(default=0, compare=False)  # prompts computed
    rows: list[bytes] = field(default_factory=list, compare=False)
    tokens: bool = field(default=False, compare=False)  # every token's state


class EngineCore:
    def __init__(self, engine: LLMEngine, conn: Connection) -> None:
        self.engine = engine
        self.conn = conn
        self.jobs: list[_Job] = []
        #: requests whose grammar compiles off this loop, by id
        self.compiling: dict[str, tuple[msg.Add, concurrent.futures.Future[object]]] = {}
        self.compiler = concurrent.futures.ThreadPoolExecutor(1, "kiln-grammar")
        self.failed: list[msg.Failed] = []
        self.pooled: list[msg.Pooled] = []
        self.loaded: list[msg.LoRALoaded] = []  # LoadLoRA answers not sent yet
        #: pause, sleep and the rest of vLLM's development operations
        self.control = EngineControl(engine)
        self.controls: list[msg.ControlDone] = []  # their answers not sent yet
        self.ends: list[RequestOutput] = []  # requests aborted by them, to send
        self.dirty = False  # counters changed since the last snapshot sent
        self.last_snapshot = 0.0

    # ---- the loop --------------------------------------------------------------------
    def run(self) -> None:
        engine = self.engine
        control = self.control
        while True:
            stepping = engine.has_work() and control.may_step()
            pooling = bool(self.jobs) and control.may_step() and not control.holds_requests
            busy = stepping or pooling or bool(self.compiling)
            # idle: block until the server sends something; busy: take what is there
            timeout = 0.0 if busy else None
            if self.compiling and not stepping and not pooling:
                timeout = 0.005
            while self.conn.poll(timeout):
                timeout = 0.0
                try:
                    frame = self.conn.recv_bytes()
                except (EOFError, OSError):
                    return  # the server is gone
                if not self._apply(msg.COMMANDS.decode(frame).commands):
                    return
            self._admit_compiled()
            if self.jobs and control.may_step() and not control.holds_requests:
                self._pool_batch()
            self._controlled()
            outputs: list[RequestOutput] = []
            if engine.has_work() and control.may_step():
                try:
                    outputs = engine.step()
                except Exception as exc:  # outside the model run: the engine's own bug
                    log.exception("llm engine step failed")
                    self._fail_all(f"llm engine step failed: {exc}")
                for rid, error in engine.failed:
                    self._fail(rid, f"llm engine step failed: {error}", Status.INTERNAL)
                self.dirty = True
            self._controlled()
            if self.ends:
                outputs, self.ends = [*self.ends, *outputs], []
            self._send(outputs)

    def _send(self, outputs: list[RequestOutput]) -> None:
        pending = self.failed or self.pooled or self.loaded or self.controls
        if not (outputs or pending or self.dirty):
            return
        now = time.monotonic()
        snap = None
        ended = self.failed or self.pooled or any(o.finished for o in outputs)
        idle = not self.engine.has_work()
        # with every request that ends (the client reads the figures once it has its
        # answer), when the engine goes idle, and every SNAPSHOT_INTERVAL in between
        if self.dirty and (ended or idle or now - self.last_snapshot >= SNAPSHOT_INTERVAL):
            snap = msg.snapshot(self.engine)
            self.dirty, self.last_snapshot = False, now
        if not (outputs or pending or snap):
            return
        step = msg.Step(outputs, self.failed, self.pooled, snap, self.loaded, self.controls)
        self.failed, self.pooled, self.loaded, self.controls = [], [], [], []
        self.conn.send_bytes(msg.ENCODER.encode(step))

    # ---- commands ----------------------------------------------------------------------
    def _apply(self, commands: list[msg.Command]) -> bool:
        for command in commands:
            if isinstance(command, msg.Add):
                self._add(command)
            elif isinstance(command, msg.Abort):
                rid = command.request_id
                if self.compiling.pop(rid, None) is None and not (
                    command.index is None and self.control.drop_held(rid)
                ):
                    self.engine.abort(rid, command.index, command.reason)
                self.dirty = True
            elif isinstance(command, msg.Control):
                self._control(command)
            elif isinstance(command, msg.Pool):
                job = _Job(command.priority, command.job_id, command.prompts)
                job.tokens = command.tokens
                self.jobs.append(job)
            elif isinstance(command, msg.CancelPool):
                self.jobs = [j for j in self.jobs if j.job_id != command.job_id]
            elif isinstance(command, msg.LoadLoRA):
                self._load_lora(command)
            elif isinstance(command, msg.UnloadLoRA):
                self.engine.remove_lora(command.lora_int_id)
            else:
                self._shutdown()
                return False
        return True

    def _add(self, add: msg.Add) -> None:
        try:
            params = msg.params_from(add.params)
        except Exception as exc:
            self._fail(add.request_id, f"llm engine: bad request: {exc}", Status.INTERNAL)
            return
        grammars = self.engine.grammars
        spec = params.structured_outputs
        if spec is not None and grammars is not None:
            # a compile holds this loop for as long as it takes: it runs on a thread, and
            # the request joins once it is done (the server compiled it too: the check)
            future: concurrent.futures.Future[object] = self.compiler.submit(grammars.compile, spec)
            self.compiling[add.request_id] = (add, future)
            return
        self._admit(add)

    def _admit_compiled(self) -> None:
        for rid, (add, future) in list(self.compiling.items()):
            if future.done():
                del self.compiling[rid]
                self._admit(add)  # a compile error is raised again, and reported, there

    def _load_lora(self, load: msg.LoadLoRA) -> None:
        """Read and check an adapter (a few megabytes, size-checked before it is read:
        between two steps, as vLLM's engine core does its ``add_lora``)."""
        request = msg.lora_from(load.lora)
        assert request is not None
        try:
            self.engine.add_lora(request)
        except KilnError as exc:
            self.loaded.append(msg.LoRALoaded(load.token, exc.message, exc.status.name))
        except Exception as exc:
            log.exception("llm engine: LoRA adapter '%s' could not be read", request.lora_name)
            self.loaded.append(
                msg.LoRALoaded(
                    load.token,
                    f"LoRA adapter '{request.lora_name}' could not be read: "
                    f"{type(exc).__name__}: {exc}",
                    Status.INVALID_ARG.name,
                )
            )
        else:
            self.loaded.append(msg.LoRALoaded(load.token))

    # ---- development operations --------------------------------------------------------
    def _control(self, command: msg.Control) -> None:
        op, args = command.op, command.args
        aborts_all = op == "abort" and args.get("request_ids") is None
        aborts_all |= op in ("pause", "sleep") and args.get("mode", "abort") == "abort"
        try:
            result = self.control.run(command.token, op, args)
            # requests still compiling their grammar end too
            ids = list(self.compiling) if aborts_all else []
            if op == "abort" and not aborts_all:
                ids = [rid for rid in map(str, args["request_ids"]) if rid in self.compiling]
            for rid in ids:
                add = self.compiling.pop(rid)[0]
                self.ends += held_ends(rid, add.params.get("n", 1), len(add.prompt))
        except KilnError as exc:
            self.controls.append(msg.ControlDone(command.token, {}, exc.message, exc.status.name))
        except Exception as exc:
            log.exception("llm engine: %s failed", op)
            self.controls.append(msg.ControlDone(
                command.token, {}, f"llm engine: {op} failed: {exc}", Status.INTERNAL.name
            ))  # fmt: skip
        else:
            if result is not PENDING:
                self.controls.append(msg.ControlDone(command.token, result))
        self.dirty = True

    def _controlled(self) -> None:
        control = self.control
        for token, result in control.poll():
            assert isinstance(token, int)
            self.controls.append(msg.ControlDone(token, result))
        if control.finished:
            self.ends += control.finished
            control.finished = []
        if control.released:
            released, control.released = control.released, []
            for item in released:
                assert isinstance(item, msg.Add)
                self._admit(item)

    def _admit(self, add: msg.Add) -> None:
        if self.control.holds_requests:  # paused or asleep: it joins at the resume
            n = add.params.get("n", 1)
            self.control.hold(add.request_id, n, len(add.prompt), add)
            return
        try:
            self.engine.add_request(
                add.request_id,
                add.prompt,
                msg.params_from(add.params),
                add.priority,
                add.arrival_time,
                lora_request=msg.lora_from(add.lora),
            )
        except KilnError as exc:
            self._fail(add.request_id, exc.message, exc.status)
        except Exception as exc:
            log.exception("llm engine: request %s could not be added", add.request_id)
            self._fail(add.request_id, f"llm engine: the request could not be added: {exc}",
                       Status.INTERNAL)  # fmt: skip

    def _fail(self, rid: str, message: str, status: Status) -> None:
        self.failed.append(msg.Failed(rid, message, status.name))
        self.dirty = True

    def _fail_all(self, message: str) -> None:
        rids = {s.request_id for q in (self.engine.scheduler.running,
                                       self.engine.scheduler.waiting) for s in q}  # fmt: skip
        for rid in rids:
            self.engine.abort(rid, reason="error")
            self._fail(rid, message, Status.INTERNAL)

    def _shutdown(self) -> None:
        self.compiler.shutdown(wait=False, cancel_futures=True)

    # ---- pooling -----------------------------------------------------------------------
    def _pool_batch(self) -> None:
        """One forward pass over the next waiting prompts, up to ``max_num_batched_tokens``
        tokens (always at least one prompt), from one or more jobs by (priority, arrival)."""
        budget = self.engine.config.max_num_batched_tokens
        batch: list[tuple[_Job, int]] = []
        tokens = 0
        for job in sorted(self.jobs):
            if batch and job.tokens != batch[0][0].tokens:
                break  # a batch is of one kind: pooled, or every token's states
            end = job.done
            while end < len(job.prompts) and (
                (not batch and end == job.done) or tokens + len(job.prompts[end]) <= budget
            ):
                tokens += len(job.prompts[end])
                end += 1
            if end > job.done:
                batch.append((job, end - job.done))
            if end < len(job.prompts):
                break
        self._run_pool(batch)
        self.jobs = [j for j in self.jobs if j.done < len(j.prompts) and j.job_id >= 0]

    def _run_pool(self, batch: list[tuple[_Job, int]]) -> None:
        """When the batch fails, each job's part runs alone: one job's failure is its own."""
        prompts = [p for job, n in batch for p in job.prompts[job.done : job.done + n]]
        tokens = batch[0][0].tokens
        try:
            pooled = self.engine.pool(prompts, tokens).float().cpu().contiguous().numpy()
        except Exception as exc:
            if len(batch) > 1:
                for part in batch:
                    self._run_pool([part])
                return
            log.exception("llm engine: a pooling batch failed")
            for job, _ in batch:
                self.pooled.append(msg.Pooled(job.job_id, error=f"pooling failed: {exc}"))
                job.job_id = -1  # dropped
            return
        at = 0
        for job, n in batch:
            taken = job.prompts[job.done : job.done + n]
            count = sum(len(p) for p in taken) if tokens else n  # rows of this job's part
            job.rows.append(pooled[at : at + count].tobytes())
            job.done += n
            at += count
            if job.done == len(job.prompts):
                rows = sum(len(p) for p in job.prompts) if tokens else len(job.prompts)
                self.pooled.append(msg.Pooled(job.job_id, b"".join(job.rows), rows))
        self.dirty = True


def _watch_parent(parent: int) -> None:
    """Exit as soon as the server process is gone, even in the middle of a long step (its
    socket's end of file is read between steps only). Not Linux's PR_SET_PDEATHSIG: that
    fires when the *thread* that started this process ends, and the server starts it from
    a loading thread."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()


def _threads(wanted: int) -> int:
    if wanted > 0:
        return wanted
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln.llm.engine_core")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--parent", type=int, default=0, help="the server's pid")
    args = parser.parse_args(argv)
    if args.parent:
        _watch_parent(args.parent)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    conn = Connection(socket.socket(fileno=args.fd).detach())
    try:
        init: EngineInit = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return 1
    import torch

    torch.set_num_threads(_threads(init.threads))
    try:
        tokenizer = Tokenizer.load(init.tokenizer, init.settings.chat_template)
        engine = build_engine(init.folder, tokenizer, init.settings, init.extra_eos)
    except BaseException as exc:  # the server reports it as the load's error
        status = exc.status if isinstance(exc, KilnError) else Status.INTERNAL
        message = exc.message if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
        conn.send_bytes(pickle.dumps(("error", message, status.name)))
        return 1
    frozen = freeze_startup_heap()  # the engine's loop pauses for no full pass over them
    log.debug("gc.freeze: %d startup objects out of the collector's passes", frozen)
    conn.send_bytes(pickle.dumps(("ready", engine.config, engine.args, os.getpid())))
    try:
        EngineCore(engine, conn).run()
    finally:
        engine.close()  # a tensor-parallel model's workers
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's finalization: nothing is left to release, and
    # extension modules torch imports print pages of warnings at it (triton's bindings
    # report every type and function as "leaked").
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
