"""``--rate-limit=execution_count`` behind a real ``kiln serve``: two Python models whose
instance groups each need the one copy of resource R never execute at the same time, while
the same models without the rate limiter do; and the flags' mistakes are refused."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tests.conftest import KilnProcess

MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "..", "executions.log")

    def execute(self, requests):
        begin = time.monotonic()
        time.sleep(0.15)
        with open(self.log, "a") as f:
            f.write(f"{begin} {time.monotonic()}\\n")
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", np.ones(1, np.float32))])
                for _ in requests]
"""

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1
  rate_limiter {{ resources [ {{ name: "R" count: 1 }} ] priority: 1 }} }} ]
"""


def repository(root: Path) -> Path:
    repo = root / "models"
    for name in ("first", "second"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(MODEL))
        (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name))
    return repo


def overlaps(repo: Path, args: list[str]) -> int:
    """Send two requests to each model at once; how many pairs of executions overlapped."""
    log = repo / "executions.log"  # the models write it (their folder's parent)
    log.unlink(missing_ok=True)
    server = KilnProcess(repo, args).start()
    try:
        x = httpclient.InferInput("X", [1], "FP32")
        x.set_data_from_numpy(np.zeros(1, np.float32))

        def call(model: str) -> None:
            client = httpclient.InferenceServerClient(server.http_url)
            assert client.infer(model, [x]).as_numpy("Y").tolist() == [1.0]

        with ThreadPoolExecutor(4) as pool:
            list(pool.map(call, ["first", "second", "first", "second"]))
    finally:
        server.stop()
    spans = sorted(tuple(map(float, line.split())) for line in log.read_text().splitlines())
    assert len(spans) == 4
    return sum(1 for a, b in pairwise(spans) if b[0] < a[1])


def test_models_sharing_one_copy_of_a_resource_take_turns(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    assert overlaps(repo, ["--rate-limit", "execution_count"]) == 0
    # the same models, the same requests, no rate limiter: the two models run side by side
    assert overlaps(repo, []) > 0


def test_rate_limit_flags_are_checked(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    base = [sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo)]
    for extra, says in (
        (["--rate-limit-resource", "R"], "expected NAME:COUNT or NAME:COUNT:DEVICE"),
        (["--rate-limit-resource", "R:2"], "add --rate-limit=execution_count"),
    ):
        done = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        assert says in done.stderr


def test_an_instance_needing_more_than_the_server_gives_fails_its_load(tmp_path: Path) -> None:
    repo = repository(tmp_path)
    args = ["--rate-limit", "execution_count", "--rate-limit-resource", "R:0",
            "--no-strict-readiness"]  # fmt: skip
    server = KilnProcess(repo, args).start()
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        index = {row["name"]: row for row in client.get_model_repository_index()}
        assert index["first"]["state"] == "UNAVAILABLE"
        assert (
            "model 'first' instance first_0 #0 needs 1 of rate limiter resource 'R' (the CPU), "
            "but --rate-limit-resource gives 0" in index["first"]["reason"]
        )
    finally:
        server.stop()
