"""The server's handle on one worker process: start it, talk to it, kill it.

The worker is a plain ``python -m kiln.backends.python.worker`` subprocess (not a
multiprocessing fork: the server's threads and event loop must not be copied into it),
connected by a socketpair that ``wire.Wire`` frames. When the worker dies the socket
closes, so a waiting ``recv`` wakes with EOF instead of hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.backends.python.arena import SHM_DIR, Arena
from kiln.backends.python.env import ExecutionEnv
from kiln.backends.python.wire import Wire

#: Pairs of arenas per worker by default: as many as batches in its pipe (the backend's
#: ``pipeline_depth``).
ARENA_SLOTS = 8

# Every worker's private folder still on disk: removed by ``remove_private_dirs`` when the
# server exits without closing its workers (``os._exit`` at the exit timeout).
_PRIVATE_DIRS: set[Path] = set()


def private_shm_dir(label: str) -> Path:
    """A 0700 folder of its own under /dev/shm for one worker's arenas: a client's system
    shared memory key names a file directly in /dev/shm and cannot hold a '/', so it can
    never name a file in here (the server would open it for the client otherwise)."""
    path = Path(tempfile.mkdtemp(prefix=f"kiln-py-{label}-", dir=SHM_DIR))  # mode 0700
    _PRIVATE_DIRS.add(path)
    return path


def remove_private_dirs() -> None:
    """Remove every worker's folder (and its arenas): for an exit that skips ``close``."""
    for path in list(_PRIVATE_DIRS):
        shutil.rmtree(path, ignore_errors=True)
        _PRIVATE_DIRS.discard(path)


atexit.register(remove_private_dirs)


class WorkerDied(Exception):
    """The worker exited (crash, SIGKILL, OOM) while the server waited on it."""


class WorkerTimeout(Exception):
    """The worker did not answer within the allowed time."""


class WorkerProcess:
    def __init__(
        self,
        model_path: Path,
        label: str,
        slots: int = ARENA_SLOTS,
        env: ExecutionEnv | None = None,
    ) -> None:
        """``env``: the model's own Python environment (``EXECUTION_ENV_PATH``)."""
        self.model_path = model_path
        self.env = env
        self.label = label  # names the arena folder, so a stray one says whose it was
        self.private_dir = private_shm_dir(label)
        here = str(self.private_dir)
        # One (inbound, outbound) pair per batch that may be in the pipe at once (the
        # backend's pipeline_depth): a batch's tensors stay put while the next is written.
        self.arenas = [
            (Arena.create(f"in{i}-", directory=here), Arena.create(f"out{i}-", directory=here))
            for i in range(slots)
        ]
        # Traffic not tied to one batch: a decoupled model's responses and every BLS call
        # (a model's threads may send them after its execute returned, while the next
        # batch uses the slots), reclaimed as the worker asks
        # (``worker_channel.Channel._reclaim_if_due``).
        self.side_in = Arena.create("side-in-", directory=here)  # BLS answers
        self.side_out = Arena.create("side-out-", directory=here)  # responses, BLS calls
        # One cancellation byte per request the worker has (``cancel.FlagPool``).
        self.flags = Arena.create("flags-", size=1 << 16, directory=here)
        # custom metrics (custom_metrics.py): written by the worker, read at scrape time
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="metrics-", dir=here))
        self.proc: subprocess.Popen[bytes] | None = None
        self.conn: Wire | None = None
        self._send_lock = threading.RLock()  # reentrant: see ``sending``

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ) if self.env is None else self.env.environ(dict(os.environ))
        # The worker imports kiln from wherever this server imported it.
        src = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        python = sys.executable if self.env is None else str(self.env.python)
        cmd = [
            python, "-m", "kiln.backends.python.worker",
            "--fd", str(theirs.fileno()),
            *(arg for inbound, _ in self.arenas for arg in ("--inbound", inbound.path)),
            *(arg for _, outbound in self.arenas for arg in ("--outbound", outbound.path)),
            "--side-in", self.side_in.path,
            "--side-out", self.side_out.path,
            "--flags", self.flags.path,
            "--model", str(self.model_path),
            "--metrics-dir", str(self.metrics_dir),
        ]  # fmt: skip
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=env)
        finally:
            theirs.close()
        self.conn = Wire(ours)
        for arena in self._all_arenas():
            arena.reset()

    def _all_arenas(self) -> list[Arena]:
        return [*(a for pair in self.arenas for a in pair), self.side_in, self.side_out, self.flags]

    def send(self, message: tuple[Any, ...], conn: Wire | None = None) -> None:
        """``conn``: the pipe the caller reads the answer from (None: the current one).
        ``WorkerDied`` when the worker was restarted since the caller took it: a batch
        meant for the old worker must not reach the new one, which may not have run its
        ``initialize`` yet and would answer the batch in its place."""
        try:
            # A BLS answer goes out from a helper thread while the loop may be sending the
            # next batch: one message's bytes must not interleave with another's.
            with self.sending(conn):
                if self.conn is None:
                    raise WorkerDied("the worker was restarted")
                self.conn.send(message)
        except OSError as exc:
            raise WorkerDied(self.exit_text()) from exc

    @contextlib.contextmanager
    def sending(self, conn: Wire | None) -> Iterator[None]:
        """Hold the send lock for a write into the arenas and the message that names it;
        ``WorkerDied`` when ``conn`` (None: any) is no longer this worker's pipe (it was
        restarted): what was meant for the old one must not reach the new one."""
        with self._send_lock:
            if conn is not None and self.conn is not conn:
                raise WorkerDied("the worker was restarted")
            yield

    def recv(self, deadline: float | None, conn: Wire | None = None) -> Any:
        """The next message on ``conn`` (None: the current pipe); ``deadline`` is a
        ``time.monotonic()`` value or None (wait). A pipe closed by a restart reads as
        ``WorkerDied``, never as the new worker's messages."""
        wire = self.conn if conn is None else conn
        if wire is None:
            raise WorkerDied("the worker was restarted")
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            if timeout is not None and not wire.poll(timeout):
                raise WorkerTimeout()
            return wire.recv()
        except (EOFError, OSError, ValueError) as exc:  # ValueError: a closed socket's fd
            raise WorkerDied(self.exit_text()) from exc

    def exit_text(self) -> str:
        if self.proc is None:
            return "the worker was never started"
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "the worker closed its pipe"
        if code < 0:
            return f"the worker process was killed by signal {-code}"
        return f"the worker process exited with status {code}"

    def kill(self, grace: float = 0.0) -> None:
        """End the process: SIGTERM and up to ``grace`` seconds to go, then SIGKILL."""
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None and grace > 0:
            proc.terminate()
            # Still there after the grace: it ignores SIGTERM (a handler of the model's own).
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
        if proc.poll() is None:
            proc.kill()
        proc.wait()

    def stop(self, timeout: float) -> None:
        """Ask the model to finalize, then make sure the process is gone."""
        if self.proc is not None and self.proc.poll() is None and self.conn is not None:
            deadline = time.monotonic() + timeout
            try:
                self.send(("finalize",))
                # A model's own threads may still send (a stream whose client left):
                # the answer is "finalized" (or "error": finalize raised).
                while self.recv(deadline)[0] not in ("finalized", "error"):
                    pass
            except (WorkerDied, WorkerTimeout):
                pass
        self.kill()

    def close(self, timeout: float = 10.0) -> None:
        self.stop(timeout)
        for arena in self._all_arenas():
            arena.close()
        shutil.rmtree(self.private_dir, ignore_errors=True)
        _PRIVATE_DIRS.discard(self.private_dir)
