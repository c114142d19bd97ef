"""A ``kiln serve`` process's children, read from ``/proc``: its engine process (the LLM
engine in a process of its own) and whether a process has ended."""

from __future__ import annotations

import time
from pathlib import Path

from tests.conftest import KilnProcess


def children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def engine_pid(server: KilnProcess) -> int:
    assert server.proc is not None
    [pid] = [c for c in children(server.proc.pid) if b"kiln.llm.engine_core" in cmdline(c)]
    return pid


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""


def gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0]
        except FileNotFoundError:
            return True
        if state == "Z":  # exited; its parent has not reaped it (yet)
            return True
        time.sleep(0.1)
    return False
