"""A request's own chat template (vLLM's ``chat_template`` field, served with
``--trust-request-chat-template``) renders in a worker process bounded in memory and time.

Jinja's sandbox keeps a template from Python's internals, and kiln's checks bound ``range``,
``*`` and ``**`` before they allocate; but a template allocates in more ways than single
operations can be checked for (a printf or ``format`` width, ``ljust``, ``center``, a join
or a concatenation in a loop) and it can loop for hours. In its own process its address
space is capped (:data:`MAX_MEMORY` past what the worker holds idle) and its render timed
(:data:`MAX_SECONDS`): a template past either bound ends the worker, which is started
again for the next one, and its request gets a 400; the server and its other clients are
not touched. One worker renders one template at a time.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kiln.llm.params import InvalidField

#: bytes of address space a render may take beyond the idle worker's
MAX_MEMORY = 512 << 20
#: seconds a render may take
MAX_SECONDS = 5.0
#: the longest error message a template's exception passes on
_MAX_MESSAGE = 1000


def _refused(message: str) -> InvalidField:
    return InvalidField("chat_template", f"chat template: {message}")


class _Worker:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None

    def render(self, source: str, messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
        with self._lock:
            conn = self._connection()
            try:
                conn.send((source, messages, variables))
                if not conn.poll(MAX_SECONDS):
                    self._stop()
                    raise _refused(
                        f"the request's template rendered for more than {MAX_SECONDS:g} seconds"
                    )
                kind, value = conn.recv()
            except (EOFError, OSError):
                self._stop()  # ended by its memory bound in a way Python could not report
                kind, value = "memory", ""
        if kind == "ok":
            return str(value)
        if kind == "memory":
            raise _refused(
                f"the request's template needs more than {MAX_MEMORY >> 20} MiB of memory"
            )
        raise _refused(str(value))

    def _connection(self) -> Connection:
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn
        self._stop()
        ours, theirs = socket.socketpair()
        env = dict(os.environ)
        # the worker imports kiln from wherever this process imported it
        src = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
        cmd = [sys.executable, "-m", "kiln.llm.request_template", str(theirs.fileno())]
        try:
            self._proc = subprocess.Popen(
                cmd, pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL
            )
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        return self._conn

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._proc = None

    def close(self) -> None:
        with self._lock:
            self._stop()


_WORKER = _Worker()
atexit.register(_WORKER.close)


def render(source: str, messages: list[dict[str, Any]], variables: dict[str, Any]) -> str:
    """``source`` rendered with ``messages`` and ``variables`` in the bounded worker;
    :class:`InvalidField` (``chat_template``) for any error of the template's, a render
    past :data:`MAX_MEMORY` or :data:`MAX_SECONDS` included."""
    return _WORKER.render(source, messages, variables)


def _address_space() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _serve(conn: Connection) -> None:
    """The worker: one render per message, until the server closes its end."""
    import resource

    from kiln.llm.tokenizer import _compiled as compiled

    try:
        compiled("{{ 1 }}", request=True).render()  # Jinja's imports, before the cap
        limit = _address_space() + MAX_MEMORY
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (OSError, ValueError):  # no /proc (not Linux): the time bound still holds
        pass
    while True:
        try:
            source, messages, variables = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple[str, str] = (
                "ok",
                compiled(source, request=True).render(messages=messages, **variables),
            )
        except MemoryError:
            reply = ("memory", "")
        except Exception as exc:
            reply = ("error", str(exc)[:_MAX_MESSAGE] or type(exc).__name__)
        try:
            conn.send(reply)
        except MemoryError:
            conn.send(("memory", ""))
        except (EOFError, OSError):
            return


if __name__ == "__main__":
    _serve(Connection(int(sys.argv[1])))
