"""What client-stream backpressure costs a client that keeps up: responses per second of
a decoupled Python model flooding one gRPC ``ModelStreamInfer`` client, for kiln source
trees given on the command line (e.g. this tree and a worktree of a commit before it).

The model sends ``--count`` responses of 256 float32 as fast as it can; tritonclient reads
them on its stream (``start_stream``), four rounds per tree, trees interleaved. The
in-process limit is not the question here (``decoupled_streams.py`` compares with it):
the question is whether the window (``core/stream.CLIENT_STREAM_WINDOW``) and the
outbox's water marks slow a fast client down. Usage::

    git worktree add /tmp/before <commit>
    .venv/bin/python benchmarks/stream_backpressure.py src /tmp/before/src [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient

WIDTH = 256
MODEL = textwrap.dedent(
    """
    import numpy as np
    import triton_python_backend_utils as pb_utils

    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                count = int(pb_utils.get_input_tensor_by_name(request, "COUNT").as_numpy()[0])
                sender = request.get_response_sender()
                block = np.zeros((WIDTH,), np.float32)
                for _ in range(count):
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", block)]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
    """
).replace("WIDTH", str(WIDTH))
CONFIG = f"""name: "flood"
backend: "python"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
"""


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rates(src: str, count: int, rounds: int = 4) -> list[float]:
    """Responses/s of each round for the kiln tree at ``src``."""
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "models"
        (repo / "flood" / "1").mkdir(parents=True)
        (repo / "flood" / "config.pbtxt").write_text(CONFIG)
        (repo / "flood" / "1" / "model.py").write_text(MODEL)
        http, grpc = _port(), _port()
        cmd = [
            sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
            "--http-port", str(http), "--grpc-port", str(grpc),
            "--metrics-port", str(_port()), "--log-level", "warning",
        ]  # fmt: skip
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONPATH=str(Path(src).resolve())))
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    url = f"http://127.0.0.1:{http}/v2/health/ready"
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"kiln from {src} did not become ready") from None
                    time.sleep(0.1)
            got: queue.Queue[Any] = queue.Queue()
            client = grpcclient.InferenceServerClient(f"127.0.0.1:{grpc}")
            client.start_stream(callback=lambda result, error: got.put(error or result))
            out = []
            for _ in range(rounds):
                n = grpcclient.InferInput("COUNT", [1], "INT32")
                n.set_data_from_numpy(np.array([count], np.int32))
                start = time.perf_counter()
                client.async_stream_infer("flood", [n])
                received = 0
                while received < count:
                    item = got.get(timeout=60)
                    if isinstance(item, Exception):
                        raise item
                    received += item.as_numpy("OUT") is not None
                out.append(count / (time.perf_counter() - start))
            client.stop_stream()
            client.close()
            return out
        finally:
            proc.terminate()
            proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trees", nargs="+", help="kiln src folders")
    parser.add_argument("--count", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved runs per tree")
    opts = parser.parse_args()
    seen: dict[str, list[float]] = {t: [] for t in opts.trees}
    for _ in range(opts.rounds):
        for tree in opts.trees:
            r = rates(tree, opts.count)
            seen[tree] += r
            print(f"{tree}: {', '.join(f'{x:,.0f}' for x in r)} responses/s", flush=True)
    for tree, values in seen.items():
        print(f"{tree}: median {statistics.median(values):,.0f} responses/s "
              f"({min(values):,.0f}-{max(values):,.0f})")  # fmt: skip


if __name__ == "__main__":
    main()
