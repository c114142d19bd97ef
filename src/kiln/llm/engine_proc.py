"""The server's side of an engine in its own process (vLLM V1's ``EngineCoreClient``).

``EngineProcClient`` offers what ``AsyncEngine`` offers (``generate``, ``pool``, ``abort``,
``close``, ``num_requests``), so the backend and ``EngineClient`` use either the same way.
A writer thread sends every command pending at once in one frame; a reader thread hands
each step's outputs to the event loops that wait for them, one cross-thread call per loop
per step.

The engine process dying (killed, out of memory, a crash in native code) fails the
requests it had with INTERNAL naming the model, as a Python-backend worker's death does,
and a new engine process loads the model; requests that arrive meanwhile wait for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import pickle
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

import kiln
from kiln.core.errors import KilnError, Status
from kiln.llm import engine_messages as msg
from kiln.llm.admission import Admission
from kiln.llm.async_engine import OutputCollector, _put_all, _Stream, outputs, stream_interval
from kiln.llm.config import EngineConfig, ModelArgs
from kiln.llm.engine import LLMEngine, RequestOutput
from kiln.llm.engine_core import EngineInit
from kiln.llm.kv_cache_metrics import KVCacheResidency
from kiln.llm.lora import LoRARequest
from kiln.llm.sequence import SamplingParams
from kiln.llm.spec_decode import SpecDecodeStats
from kiln.llm.stats import EngineStats, RequestHistograms
from kiln.llm.structured import GrammarCompiler
from kiln.llm.tokenizer import Tokenizer

log = logging.getLogger("kiln.llm")
_IDS = itertools.count()
#: how long a stopping engine process may take to exit before it is killed (seconds)
STOP_TIMEOUT = 10.0
#: the child's OpenMP settings unless the environment sets them: a waiting OpenMP thread
#: sleeps at once instead of spinning (GNU OpenMP spins up to 300k iterations by default),
#: so a partner descheduled by the frontend's work does not cost a spinning core
#: (docs/design/llm-engine-process.md has the measurement)
CHILD_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}
#: a model with at least this many parameters in its layers also gets ``SPIN_ENV``: its
#: matrix products are long enough that a short spin between back-to-back ones (instead of a
#: sleep and a wake-up each) pays; a small model's step leaves the cores to the frontend
SPIN_FROM_PARAMS = 40_000_000
#: ~0.1 ms of spinning before a waiting GNU OpenMP thread sleeps (it overrides PASSIVE's 0)
SPIN_ENV = {"GOMP_SPINCOUNT": "10000"}
#: how long ``add_lora`` waits for the engine process to read an adapter (seconds): it
#: reads between steps, and a step of a large prefill on a CPU takes seconds
LORA_LOAD_TIMEOUT = 300.0


def layer_params(folder: Path) -> int:
    """The parameters in a checkpoint's decoder layers, from its config.json (0 when there
    is none, e.g. a GGUF file): hidden x (4 hidden + 3 intermediate) x layers, attention and
    MLP projections at full width (an estimate: GQA and MoE change it little for this use)."""
    try:
        config = json.loads((folder / "config.json").read_text())
        config = config.get("text_config", config)
        hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        inner = int(config.get("intermediate_size") or 4 * hidden)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    return hidden * (4 * hidden + 3 * inner) * layers


def child_env(folder: Path) -> dict[str, str]:
    """The OpenMP settings the engine process starts with, before the environment's own."""
    if layer_params(folder) >= SPIN_FROM_PARAMS:
        return {**CHILD_ENV, **SPIN_ENV}
    return dict(CHILD_ENV)


class EngineView(LLMEngine):
    """The engine as the server process sees it: its resolved settings and model
    arguments, the request checks (``check_request``, ``check_n``, ``check_priority``), a
    grammar compiler to validate constraints with, and its counters as the engine process
    last sent them. Nothing is loaded here: ``LLMEngine.__init__`` is not called."""

    def __init__(self, config: EngineConfig, args: ModelArgs, grammars: GrammarCompiler) -> None:
        self.config = config
        self.args = args
        self.grammars = grammars
        self.stats = EngineStats(RequestHistograms.for_model(config.max_model_len))
        if config.observability.kv_cache_metrics:  # the histograms the snapshots fill
            self.stats.kv_residency = KVCacheResidency(config.observability.kv_cache_metrics_sample)
        spec = config.speculative_config
        self.spec_stats = None if spec is None else SpecDecodeStats(spec.num_speculative_tokens)
        self.counts = msg.Counts()
        self.failed = []

    def loras_in_use(self) -> tuple[str, str]:
        """As the engine process last counted them."""
        return self.counts.waiting_loras, self.counts.running_loras


@dataclass(slots=True)
class _Job:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[torch.Tensor]]
    epoch: int
    #: ``token_embed``: each prompt's length, to split the rows by (None: a row a prompt)
    lengths: list[int] | None = None


def _exit_text(proc: subprocess.Popen[bytes]) -> str:
    try:
        code = proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return "it closed its socket"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exit status {code}"


class EngineProcClient:
    def __init__(self, init: EngineInit, tokenizer: Tokenizer) -> None:
        self.name = init.name
        self._init = init
        self._lock = threading.Lock()
        self._streams: dict[str, tuple[_Stream, int]] = {}  # id -> (stream, epoch)
        self._jobs: dict[int, _Job] = {}
        self._pooling = 0  # prompts of pooling jobs not yet answered
        #: ``add_lora`` calls waiting for the engine process's answer, by token
        self._loading: dict[int, concurrent.futures.Future[None]] = {}
        #: development operations waiting for the engine process's answer, by token
        self._controls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[Any]]] = {}
        #: (epoch, command); None ends the writer
        self._outbox: queue.SimpleQueue[tuple[int, msg.Command] | None] = queue.SimpleQueue()
        #: bumped when the engine process dies: commands of the old one are dropped
        self._epoch = 0
        self._closed = False
        self._broken: str | None = None  # why no engine process runs (a restart failed)
        self._ready = threading.Condition(self._lock)
        self._conn: Connection | None
        self._proc, self._conn, config, args = self._start()
        grammars = GrammarCompiler(tokenizer, args.vocab_size, args.eos_token_ids)
        self.view = EngineView(config, args, grammars)
        #: vLLM's --max-num-queued-reqs and --max-num-queued-tokens
        self.admission = Admission(config.max_num_queued_reqs, config.max_num_queued_tokens)
        self.restarts = 0
        self._reader = threading.Thread(target=self._read, name=f"kiln-llm-rx-{self.name}",
                                        daemon=True)  # fmt: skip
        self._writer = threading.Thread(target=self._write, name=f"kiln-llm-tx-{self.name}",
                                        daemon=True)  # fmt: skip
        self._reader.start()
        self._writer.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- the engine process ----------------------------------------------------------------
    def _start(
        self,
    ) -> tuple[subprocess.Popen[bytes], Connection, EngineConfig, ModelArgs]:
        ours, theirs = socket.socketpair()
        env = {**child_env(self._init.folder), **os.environ}
        # the engine process imports kiln from wherever this server imported it
        src = str(Path(kiln.__file__).resolve().parents[1])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "kiln.llm.engine_core", "--fd", str(theirs.fileno()),
               "--parent", str(os.getpid())]  # fmt: skip
        try:
            proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        try:
            conn.send_bytes(pickle.dumps(self._init))
            while not conn.poll(0.5):
                if proc.poll() is not None:
                    raise EOFError
            reply = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            conn.close()
            raise KilnError(
                f"model '{self.name}': the engine process stopped while loading the model "
                f"({_exit_text(proc)})",
                Status.INTERNAL,
            ) from None
        if reply[0] == "error":
            conn.close()
            proc.wait()
            raise KilnError(reply[1], Status[reply[2]])
        _, config, args, _pid = reply
        return proc, conn, config, args

    def _write(self) -> None:
        """Every command pending is sent in one frame: under load, one write for many
        requests and aborts."""
        while True:
            item = self._outbox.get()
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._outbox.get_nowait())
            with self._lock:
                while self._conn is None and not self._closed and self._broken is None:
                    self._ready.wait()
                conn, epoch = self._conn, self._epoch
            commands = [c for e, c in (b for b in batch if b is not None) if e == epoch]
            if commands and conn is not None:
                # a dead process: the reader sees it gone and fails its requests
                with contextlib.suppress(OSError):
                    conn.send_bytes(msg.ENCODER.encode(msg.Commands(commands)))
            if None in batch:
                return

    def _read(self) -> None:
        while True:
            conn = self._conn
            try:
                assert conn is not None
                frame = conn.recv_bytes()
            except (EOFError, OSError, AssertionError):
                if self._closed or not self._restart():
                    return
                continue
            self._deliver(msg.STEP.decode(frame))

    def _restart(self) -> bool:
        """The engine process died: fail what it had, start another."""
        proc = self._proc
        reason = _exit_text(proc)
        with self._lock:
            if self._closed:
                return False
            self._epoch += 1
            streams = [s for s, _ in self._streams.values()]
            jobs = list(self._jobs.values())
            self._jobs.clear()
            loading = list(self._loading.values())
            self._loading.clear()
            controls = list(self._controls.values())
            self._controls.clear()
            if self._conn is not None:
                self._conn.close()
            self._conn = None
        error = KilnError(
            f"model '{self.name}': the engine process stopped ({reason}) with "
            f"{len(streams) + len(jobs)} requests in flight; they failed, and the model is "
            "being reloaded in a new engine process",
            Status.INTERNAL,
        )
        log.error("%s", error.message)
        for stream in streams:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                stream.put(error)
        for job in jobs:
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(_fail_future, job.future, error)
        for waiting in loading:
            _fail_load(waiting, error)
        for loop, future in controls:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail_future, future, error)
        try:
            new_proc, conn, _, _ = self._start()
        except KilnError as exc:
            log.error("model '%s': the engine process could not be restarted: %s", self.name,
                      exc.message)  # fmt: skip
            with self._lock:
                self._broken = exc.message
                self._ready.notify_all()
            return False
        with self._lock:
            if self._closed:  # closed while loading: this one goes too
                conn.close()
                _stop(new_proc, 0)
                return False
            self._proc, self._conn = new_proc, conn
            self.restarts += 1
            self._ready.notify_all()
        log.info("model '%s': the engine process was restarted (pid %d)", self.name,
                 new_proc.pid)  # fmt: skip
        return True

    def _deliver(self, step: msg.Step) -> None:
        if step.snapshot is not None:
            view = self.view
            view.counts = step.snapshot.counts
            msg.apply_snapshot(step.snapshot, view.stats, view.spec_stats)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[OutputCollector, RequestOutput]]] = {}
        streams = self._streams
        for out in step.outputs:
            entry = streams.get(out.request_id)
            if entry is not None:
                stream = entry[0]
                batches.setdefault(stream.loop, []).append((stream.collector, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(_put_all, items)
        for failed in step.failed:
            entry = streams.get(failed.request_id)
            if entry is not None:
                with contextlib.suppress(RuntimeError):
                    entry[0].put(KilnError(failed.message, Status[failed.status]))
        for loaded in step.loras:
            with self._lock:
                waiting = self._loading.pop(loaded.token, None)
            if waiting is None:
                continue
            if loaded.message:
                _fail_load(waiting, KilnError(loaded.message, Status[loaded.status]))
            elif not waiting.done():
                waiting.set_result(None)
        for done in step.controls:
            with self._lock:
                waiter = self._controls.pop(done.token, None)
            if waiter is not None:
                answer: object = done.result
                if done.message:
                    answer = KilnError(done.message, Status[done.status])
                with contextlib.suppress(RuntimeError):
                    waiter[0].call_soon_threadsafe(_settle, waiter[1], answer)
        for pooled in step.pooled:
            job = self._jobs.pop(pooled.job_id, None)
            if job is None:
                continue
            if pooled.error:
                result: list[torch.Tensor] | KilnError = KilnError(
                    f"llm engine: {pooled.error}", Status.INTERNAL
                )
            else:
                rows = torch.frombuffer(bytearray(pooled.data), dtype=torch.float32)
                table = rows.view(pooled.rows, -1)
                parts = table.split_with_sizes(job.lengths) if job.lengths else table.unbind(0)
                result = list(parts)
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(_settle, job.future, result)

    # ---- requests ----------------------------------------------------------------------------
    def _send(self, epoch: int, command: msg.Command) -> None:
        self._outbox.put((epoch, command))

    def _admit(self, n: int, what: str = "requests", adding: int = 1) -> int:
        """Under the lock: refuse when closed, broken, or when ``adding`` more would
        overfill the queue (``n`` ``what`` in flight already); the current epoch."""
        if self._closed:
            raise KilnError(f"model '{self.name}' is unloaded", Status.UNAVAILABLE)
        if self._broken is not None:
            raise KilnError(
                f"model '{self.name}': no engine process runs ({self._broken})",
                Status.UNAVAILABLE,
            )
        config = self.view.config
        if n + adding > config.max_waiting + config.max_num_seqs:
            raise KilnError(
                f"llm engine: {n} {what} in flight, the queue is full", Status.UNAVAILABLE
            )
        return self._epoch

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As ``AsyncEngine.generate``; ``lora_request`` travels with the request (the
        engine process reads its folder again when it has not got the adapter)."""
        arrival = time.monotonic()  # CLOCK_MONOTONIC: the engine process reads the same
        self.view.check_request(len(prompt), params, priority, lora_request)
        with self._lock:
            epoch = self._admit(len(self._streams))
            ticket = self.admission.admit(params.n, len(prompt))
            rid = request_id or f"req-{next(_IDS)}"
            loop = asyncio.get_running_loop()
            interval = stream_interval(params, self.view.config.stream_interval)
            stream = _Stream(loop, OutputCollector(loop, interval))
            self._streams[rid] = (stream, epoch)
        try:
            add = msg.Add(rid, prompt, msg.params_to(params), priority, arrival,
                          None if lora_request is None else msg.lora_to(lora_request))  # fmt: skip
            self._send(epoch, add)
            abort = lambda: self._send(epoch, msg.Abort(rid))  # noqa: E731
            async with contextlib.aclosing(outputs(stream.collector, params.n, abort)) as items:
                async for item in items:
                    if ticket.prefill_tokens:
                        self.admission.prefilled(ticket)
                    yield item
        finally:
            self.admission.release(ticket)
            with self._lock:
                self._streams.pop(rid, None)

    async def pool(
        self, prompts: list[list[int]], priority: int = 0, tokens: bool = False
    ) -> list[torch.Tensor]:
        """As ``AsyncEngine.pool``."""
        loop = asyncio.get_running_loop()
        with self._lock:
            epoch = self._admit(self._pooling, "pooling prompts", len(prompts))
            ticket = self.admission.admit_prompts(len(prompts), sum(map(len, prompts)))
            self._pooling += len(prompts)
            job_id = next(_IDS)
            job = _Job(loop, loop.create_future(), epoch)
            job.lengths = [len(p) for p in prompts] if tokens else None
            self._jobs[job_id] = job
        self._send(epoch, msg.Pool(job_id, priority, prompts, tokens))
        try:
            return await job.future
        finally:
            self.admission.release(ticket)
            with self._lock:
                self._pooling -= len(prompts)
                left = self._jobs.pop(job_id, None)
            if left is not None:  # its client left: the engine drops what is not computed
                self._send(epoch, msg.CancelPool(job_id))

    def add_lora(self, request: LoRARequest) -> None:
        """``LLMEngine.add_lora`` in the engine process: blocks (call it off the event
        loop) until the engine has read and checked the adapter; its refusal raises here."""
        waiting: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            epoch = self._admit(0, "adapter loads")
            token = next(_IDS)
            self._loading[token] = waiting
        self._send(epoch, msg.LoadLoRA(token, msg.lora_to(request)))
        try:
            waiting.result(LORA_LOAD_TIMEOUT)
        except TimeoutError:
            raise KilnError(
                f"model '{self.name}': LoRA adapter '{request.lora_name}' was not read by the "
                f"engine process within {LORA_LOAD_TIMEOUT:g} s",
                Status.UNAVAILABLE,
            ) from None
        finally:
            with self._lock:
                self._loading.pop(token, None)

    async def control(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """A development operation (``engine_control``) in the engine process, between two
        steps; awaits its answer (a ``wait`` pause: until the engine drained). An engine
        process that dies meanwhile fails it, and the new one starts awake."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            epoch = self._admit(0, "operations")
            token = next(_IDS)
            self._controls[token] = (loop, future)
        self._send(epoch, msg.Control(token, op, args))
        try:
            result: dict[str, Any] = await future
        finally:
            with self._lock:
                self._controls.pop(token, None)
        return result

    def remove_lora(self, lora_int_id: int) -> None:
        """``LLMEngine.remove_lora`` in the engine process (requests running with the
        adapter finish with it)."""
        self._send(self._epoch, msg.UnloadLoRA(lora_int_id))

    def abort(self, request_id: str, index: int | None = None, reason: str = "abort") -> None:
        entry = self._streams.get(request_id)
        epoch = self._epoch if entry is None else entry[1]
        self._send(epoch, msg.Abort(request_id, index, reason))

    def close(self) -> None:
        """Stop the engine process (it exits on its own; killed if it has not within
        ``STOP_TIMEOUT``) and end every stream still open with the unload's error."""
        with self._lock:
            self._closed = True
            streams = [s for s, _ in self._streams.values()]
            jobs = list(self._jobs.values())
            loading = list(self._loading.values())
            self._loading.clear()
            controls = list(self._controls.values())
            self._controls.clear()
            epoch = self._epoch
            self._ready.notify_all()
        self._send(epoch, msg.Shutdown())
        self._outbox.put(None)
        self._writer.join(timeout=STOP_TIMEOUT)
        _stop(self._proc, STOP_TIMEOUT)
        if self._conn is not None:
            self._conn.close()
        self._reader.join(timeout=STOP_TIMEOUT)
        error = KilnError(
            f"model '{self.name}' was unloaded before the request finished (its in-flight "
            "requests did not end within the unload's drain timeout, --exit-timeout-secs)",
            Status.UNAVAILABLE,
        )
        for stream in streams:
            with contextlib.suppress(RuntimeError):
                stream.put(error)
        for job in jobs:
            with contextlib.suppress(RuntimeError):
                job.loop.call_soon_threadsafe(_fail_future, job.future, error)
        for waiting in loading:
            _fail_load(waiting, error)
        for loop, future in controls:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_fail_future, future, error)


def _stop(proc: subprocess.Popen[bytes], timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=timeout)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _settle(future: asyncio.Future[Any], result: object) -> None:
    if future.done():
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


def _fail_future(future: asyncio.Future[Any], error: KilnError) -> None:
    if not future.done():
        future.set_exception(error)


def _fail_load(future: concurrent.futures.Future[None], error: KilnError) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        future.set_exception(KilnError(error.message, error.status))
