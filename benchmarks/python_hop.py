"""The Python backend's hop to its worker process, without a server in front.

``PythonBackend.start_requests`` is driven from an event loop in this process, as kiln's
schedulers drive it, with an identity model that also reports when its ``execute`` began
and ended (``time.monotonic_ns``, one clock for both processes). Two measurements:

- **timeline** (one request at a time): the median time from the call to the worker's
  ``execute`` starting, inside ``execute``, and from its end to the answer on the loop;
  with the loop busy-polling for the answer (kiln's default for a lone request,
  ``busy_poll_us``) and without;
- **load** (``--concurrency`` requests kept in flight): wall µs per request, this
  process's CPU µs per request (the loop's share of the hop) and the worker process's.

Usage::

    .venv/bin/python benchmarks/python_hop.py [--requests 6000] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.backends.base import InstanceSpec
from kiln.backends.python.backend import PythonBackend
from kiln.config.loader import parse_config_text

CONFIG = """
name: "hop"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 1024 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 1024 ] },
         { name: "T" data_type: TYPE_INT64 dims: [ 2 ] } ]
parameters { key: "busy_poll_us" value: { string_value: "%d" } }
"""

MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        began = time.monotonic_ns()
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            t = np.array([[began, time.monotonic_ns()]], np.int64)
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("OUTPUT0", x), pb_utils.Tensor("T", t)]))
        return responses
"""

SPEC = InstanceSpec(name="hop_0", kind="cpu", device_id=0, index=0, total_instances=1)
INPUT = np.ones((1, 1024), np.float32)


class Request:
    """What a scheduler hands a backend (``BackendRequest``), outside any sequence."""

    correlation_id = 0
    flags = 0

    def __init__(self) -> None:
        self.inputs = {"INPUT0": INPUT}
        self.output_names = ["OUTPUT0", "T"]
        self.parameters: dict[str, Any] = {}
        self.request_id = ""
        self.sink = None
        self.deadline_ns = 0


def backend(busy_poll_us: int, folder: Path) -> PythonBackend:
    version = folder / "hop" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.py").write_text(MODEL)
    return PythonBackend(parse_config_text(CONFIG % busy_poll_us), version, SPEC)


async def timeline(b: PythonBackend, n: int) -> dict[str, float]:
    rows = []
    for _ in range(n):
        t0 = time.monotonic_ns()
        future = b.start_requests([Request()])
        assert future is not None
        out = (await future)[0]
        t2 = time.monotonic_ns()
        assert isinstance(out, dict)
        began, ended = (int(v) for v in out["T"][0])
        rows.append((began - t0, ended - began, t2 - ended, t2 - t0))
    a = np.array(rows[n // 5 :]) / 1000  # past the warm-up
    med = np.median(a, axis=0)
    return {"to execute": med[0], "execute": med[1], "back to the loop": med[2], "total": med[3]}


def process_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(b: PythonBackend, n: int, concurrency: int) -> tuple[float, float, float]:
    async def client(count: int) -> None:
        for _ in range(count):
            future = b.start_requests([Request()])
            assert future is not None
            await future

    await asyncio.gather(*(client(n // concurrency // 5) for _ in range(concurrency)))
    pid = b.worker.pid
    assert pid is not None
    wall, cpu, worker = time.perf_counter(), time.process_time(), process_cpu(pid)
    await asyncio.gather(*(client(n // concurrency) for _ in range(concurrency)))
    done = n // concurrency * concurrency
    return (
        (time.perf_counter() - wall) / done * 1e6,
        (time.process_time() - cpu) / done * 1e6,
        (process_cpu(pid) - worker) / done * 1e6,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--concurrency", type=int, default=8, help="at most pipeline_depth (8)")
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for busy in (200, 0):
            b = backend(busy, Path(tmp) / str(busy))
            try:
                t = await timeline(b, opts.requests)
                parts = ", ".join(f"{k} {v:.1f}" for k, v in t.items())
                print(f"c=1, busy_poll_us={busy}: medians µs: {parts}")
                if busy == 0:
                    wall, cpu, worker = await load(b, opts.requests, opts.concurrency)
                    print(
                        f"c={opts.concurrency}: {wall:.1f} µs/request wall, CPU µs/request: "
                        f"{cpu:.1f} in the loop's process, {worker:.1f} in the worker"
                    )
            finally:
                b.close()


if __name__ == "__main__":
    try:
        import uvloop

        uvloop.install()  # what ``kiln serve`` runs on
    except ImportError:
        pass
    asyncio.run(main())
