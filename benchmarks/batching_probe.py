"""Measurements around one load window for ``batching.py``: raw onnxruntime per batch size,
per-thread server CPU from ``/proc``, and the batches a server formed (its statistics).
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

BATCH_SIZES = (1, 2, 4, 8, 16, 32)
# (caller threads, intra-op threads each): one kiln instance, and two instances.
RAW_LAYOUTS = ((1, 2), (2, 1))


@dataclass(slots=True)
class RawPoint:
    callers: int
    intra: int
    batch: int
    calls: int
    seconds: float

    @property
    def inferences_per_s(self) -> float:
        return self.calls * self.batch / self.seconds

    @property
    def compute_ms(self) -> float:
        """Mean time of one ``run`` at this batch size (each caller runs back to back)."""
        return self.seconds * self.callers / self.calls * 1000


def raw_sweep(model: Path, seconds: float) -> list[RawPoint]:
    """Closed loop of ``session.run`` from C threads at every batch size, kiln's ORT options
    (intra-op threads = cores / instances, spinning off)."""
    points = []
    rng = np.random.default_rng(0)
    for callers, intra in RAW_LAYOUTS:
        options = ort.SessionOptions()
        options.intra_op_num_threads = intra
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions = [
            ort.InferenceSession(str(model), options, providers=["CPUExecutionProvider"])
            for _ in range(callers)
        ]
        for batch in BATCH_SIZES:
            feed = {"INPUT": rng.standard_normal((batch, 64), dtype=np.float32)}
            for s in sessions:
                for _ in range(20):  # warm-up
                    s.run(None, feed)
            counts = [0] * callers
            stop = time.perf_counter() + seconds

            start = time.perf_counter()
            threads = [
                threading.Thread(target=_loop, args=(s, feed, stop, counts, i))
                for i, s in enumerate(sessions)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            points.append(RawPoint(callers, intra, batch, sum(counts), time.perf_counter() - start))
    return points


def _loop(session: ort.InferenceSession, feed: dict[str, np.ndarray], stop: float,
          counts: list[int], i: int) -> None:  # fmt: skip
    while time.perf_counter() < stop:
        session.run(None, feed)
        counts[i] += 1


def compute_ms_at(points: list[RawPoint], batch: float) -> float:
    """One instance's compute time for a batch of ``batch`` (linear between measured sizes)."""
    single = sorted((p.batch, p.compute_ms) for p in points if p.callers == 1)
    xs, ys = zip(*single, strict=True)
    return float(np.interp(batch, xs, ys))


def _tree(root: int) -> list[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except OSError:
                continue
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(child for child, parent in parents.items() if parent == pid)
    return pids


def _group(root: int, pid: int, tid: int, process: str, thread: str) -> str:
    """Thread name without its trailing numbers; a child process's threads are prefixed."""
    name = "<main thread>" if tid == pid else re.sub(r"([-_ ]?\d+)+$", "", thread) or thread
    return name if pid == root else f"{process}: {name}"


def thread_cpu(root: int) -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (group, utime+stime seconds) for every thread of ``root``'s tree."""
    ticks = os.sysconf("SC_CLK_TCK")
    out = {}
    for pid in _tree(root):
        try:
            process = Path(f"/proc/{pid}/comm").read_text().strip()
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                text = (task / "stat").read_text()
            except OSError:  # the thread ended while we looked
                continue
            thread = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / ticks
            out[(pid, int(task.name))] = (_group(root, pid, int(task.name), process, thread), cpu)
    return out


def thread_split(
    before: dict[tuple[int, int], tuple[str, float]],
    after: dict[tuple[int, int], tuple[str, float]],
) -> dict[str, float]:
    """CPU seconds per thread group between two snapshots (threads born in between count
    from zero; threads that ended in between are lost, which a steady server does not do)."""
    split: dict[str, float] = {}
    for key, (group, cpu) in after.items():
        delta = cpu - before.get(key, (group, 0.0))[1]
        split[group] = split.get(group, 0.0) + delta
    return dict(sorted(split.items(), key=lambda kv: -kv[1]))


@dataclass(slots=True)
class Counts:
    """Cumulative statistics of one model: requests, batches, and per-request server time."""

    inferences: int
    executions: int
    success: int
    queue_ns: int
    compute_ns: int  # compute_input + compute_infer + compute_output, summed per request

    def minus(self, before: Counts) -> Counts:
        return Counts(*(getattr(self, f) - getattr(before, f) for f in self.__slots__))


def batch_counts(http_port: int, model: str) -> Counts | None:
    """The KServe statistics extension's counters (kiln and Triton), or None (MLServer)."""
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/stats"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            stats = json.loads(resp.read())["model_stats"][0]
        inf = stats["inference_stats"]
        compute = sum(
            int(inf[k]["ns"]) for k in ("compute_input", "compute_infer", "compute_output")
        )
        return Counts(int(stats["inference_count"]), int(stats["execution_count"]),
                      int(inf["success"]["count"]), int(inf["queue"]["ns"]), compute)  # fmt: skip
    except (OSError, KeyError, IndexError, ValueError):
        return None
