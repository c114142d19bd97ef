"""``ensemble_scheduling { max_inflight_requests }`` behind a real ``kiln serve``, driven by
tritonclient: a decoupled Python model that streams faster than the step after it can
take is paused in ``send`` (its memory stays bounded), a client that leaves lets a paused
model go, and a plain step holds at most that many requests across clients.

The models log what they see into files; every assertion is about counts and order, none
about durations."""

from __future__ import annotations

import json
import queue
import textwrap
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

COMMON = """
import json, os, time
import numpy as np
import triton_python_backend_utils as pb_utils

def logs(args):
    path = os.path.join(args["model_repository"], "..", "logs")
    os.makedirs(path, exist_ok=True)
    return path

def read_int(path):
    try:
        with open(path) as f:
            return int(f.read())
    except FileNotFoundError:
        return 0

def write(path, text):  # whole or not at all, for a reader in another process
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
"""

# Streams COUNT tokens as fast as it can; after each send it notes how many it has sent
# and how many the next step has finished, so the test sees how far ahead the producer ran.
BURST = (
    COMMON
    + """
class TritonPythonModel:
    def initialize(self, args):
        self.logs = logs(args)

    def execute(self, requests):
        for r in requests:
            tag = json.loads(r.parameters())["tag"]
            count = int(pb_utils.get_input_tensor_by_name(r, "COUNT").as_numpy()[0])
            sender = r.get_response_sender()
            seen = []
            for i in range(count):
                if sender.is_cancelled():
                    break
                token = pb_utils.Tensor("TOKEN", np.array([i], np.int32))
                sender.send(pb_utils.InferenceResponse([token]))
                seen.append([i + 1, read_int(os.path.join(self.logs, tag + ".done"))])
            result = {"seen": seen, "cancelled": sender.is_cancelled()}
            write(os.path.join(self.logs, tag + ".burst"), json.dumps(result))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""
)

# The slow step: counts what it finished; with "wait_for_producer" it first waits until
# the producer has sent everything (only possible when nothing pauses the producer).
SLOW = (
    COMMON
    + """
class TritonPythonModel:
    def initialize(self, args):
        self.logs = logs(args)

    def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            tag = params["tag"]
            if params.get("wait_for_producer"):
                burst = os.path.join(self.logs, tag + ".burst")
                for _ in range(3000):
                    if os.path.exists(burst):
                        break
                    time.sleep(0.01)
            time.sleep(float(params.get("sleep", 0.002)))
            done = os.path.join(self.logs, tag + ".done")
            write(done, str(read_int(done) + 1))
            token = pb_utils.get_input_tensor_by_name(r, "TOKEN").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", token * 10)]))
        return out
"""
)

# A plain step with three instances: notes how many of its requests run at once; with
# "barrier" each waits until that many have been running together.
OVERLAP = (
    COMMON
    + """
import fcntl

class TritonPythonModel:
    def initialize(self, args):
        self.logs = logs(args)

    def running(self, tag, delta):
        with open(os.path.join(self.logs, tag + ".running"), "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            now, peak = map(int, (f.read() or "0 0").split())
            now += delta
            peak = max(peak, now)
            f.seek(0)
            f.truncate()
            f.write(f"{now} {peak}")
        return peak

    def execute(self, requests):
        out = []
        for r in requests:
            params = json.loads(r.parameters())
            peak = self.running(params["tag"], 1)
            barrier = int(params.get("barrier", 0))
            for _ in range(3000):
                if peak >= barrier:
                    break
                time.sleep(0.01)
                peak = self.running(params["tag"], 0)
            time.sleep(0.02)
            self.running(params["tag"], -1)
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            out.append(pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)]))
        return out
"""
)

MODELS = {
    "burst": (
        BURST,
        """
        input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        model_transaction_policy { decoupled: true }""",
    ),
    "slow": (
        SLOW,
        """
        input [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]""",
    ),
    "overlap": (
        OVERLAP,
        """
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
        instance_group [ { count: 3 kind: KIND_CPU } ]""",
    ),
}

STREAMING = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
ensemble_scheduling {{
  {limit}
  step [
    {{ model_name: "burst" input_map {{ key: "COUNT" value: "COUNT" }}
       output_map {{ key: "TOKEN" value: "token" }} }},
    {{ model_name: "slow" input_map {{ key: "TOKEN" value: "token" }}
       output_map {{ key: "OUT" value: "OUT" }} }}
  ]
}}
"""

PLAIN = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "Y" data_type: TYPE_INT32 dims: [ 1 ] }} ]
ensemble_scheduling {{
  {limit}
  step [ {{ model_name: "overlap" input_map {{ key: "X" value: "X" }}
            output_map {{ key: "Y" value: "Y" }} }} ]
}}
"""

LIMIT = 2


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("inflight") / "models"
    for name, (source, io) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        config = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n' + textwrap.dedent(io)
        (repo / name / "config.pbtxt").write_text(config)
    limit = f"max_inflight_requests: {LIMIT}"
    for name, template, text in (
        ("limited", STREAMING, limit),
        ("unlimited", STREAMING, ""),
        ("plain_limited", PLAIN, "max_inflight_requests: 1"),
        ("plain", PLAIN, ""),
    ):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "config.pbtxt").write_text(template.format(name=name, limit=text))
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _log(server: KilnProcess, tag: str, suffix: str) -> Any:
    return json.loads((server.repository / "logs" / f"{tag}{suffix}").read_text())


def _stream(
    server: KilnProcess, model: str, count: int, params: dict[str, Any], leave_after: int = 0
) -> list[Any]:
    """The stream's messages until the final one (or ``leave_after`` of them, then the
    client cancels the stream and leaves)."""
    got: queue.Queue[Any] = queue.Queue()
    items = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    tensor = grpcclient.InferInput("COUNT", [1], "INT32")
    tensor.set_data_from_numpy(np.array([count], np.int32))
    client.async_stream_infer(model, [tensor], parameters=params, enable_empty_final_response=True)
    while True:
        item = got.get(timeout=60)
        items.append(item)
        if isinstance(item, InferenceServerException):
            break
        if leave_after and len(items) == leave_after:
            client.stop_stream(cancel_requests=True)
            client.close()
            return items
        if item.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    return items


def test_a_fast_decoupled_step_is_paused_until_the_slow_step_takes_its_responses(
    server: KilnProcess,
) -> None:
    count = 40
    items = _stream(server, "limited", count, {"tag": "limited"})
    assert not any(isinstance(i, InferenceServerException) for i in items), items
    *responses, final = items
    assert final.get_response().outputs == []
    assert sorted(int(r.as_numpy("OUT")[0]) for r in responses) == [10 * i for i in range(count)]
    seen = _log(server, "limited", ".burst")["seen"]
    assert len(seen) == count
    # When a send returned, the producer was never further ahead of what the slow step had
    # finished than its window (responses untaken in its stream), the slow step's places,
    # one response read and waiting for a place, and the one just sent.
    ahead = [sent - done for sent, done in seen]
    assert max(ahead) <= 2 * LIMIT + 1, ahead


def test_without_the_limit_the_producer_runs_ahead_of_the_slow_step(server: KilnProcess) -> None:
    # The slow step waits until the producer has sent everything, which only an unpaused
    # producer can do: the responses wait in the server's memory meanwhile.
    params = {"tag": "unlimited", "wait_for_producer": True}
    count = 40
    items = _stream(server, "unlimited", count, params)
    assert len(items) == count + 1
    seen = _log(server, "unlimited", ".burst")["seen"]
    assert [done for _, done in seen] == [0] * count


def test_a_client_leaving_lets_the_paused_producer_see_it_and_stop(server: KilnProcess) -> None:
    params = {"tag": "leaving", "sleep": 0.02}
    items = _stream(server, "limited", 100_000, params, leave_after=3)
    assert not any(isinstance(i, InferenceServerException) for i in items), items
    burst = server.repository / "logs" / "leaving.burst"
    for _ in range(600):  # the producer writes its log once it stops (no time asserted)
        if burst.exists():
            break
        threading.Event().wait(0.05)
    result = _log(server, "leaving", ".burst")
    assert result["cancelled"] is True
    assert len(result["seen"]) < 100_000
    # the worker is free again: the next stream runs to its end
    again = _stream(server, "limited", 3, {"tag": "after_leaving"})
    assert sorted(int(r.as_numpy("OUT")[0]) for r in again[:-1]) == [0, 10, 20]


def _plain(server: KilnProcess, model: str, params: dict[str, Any]) -> list[int]:
    results: list[int] = []

    def one(x: int) -> None:
        client = httpclient.InferenceServerClient(server.http_url)
        tensor = httpclient.InferInput("X", [1], "INT32")
        tensor.set_data_from_numpy(np.array([x], np.int32))
        results.append(int(client.infer(model, [tensor], parameters=params).as_numpy("Y")[0]))

    threads = [threading.Thread(target=one, args=(x,)) for x in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return sorted(results)


def test_a_plain_step_runs_at_most_max_inflight_requests_at_once(server: KilnProcess) -> None:
    # Unlimited, the three requests meet at the model's three instances...
    assert _plain(server, "plain", {"tag": "plain", "barrier": 3}) == [0, 1, 2]
    assert (server.repository / "logs" / "plain.running").read_text() == "0 3"
    # ...limited to one in flight at the step, they pass one at a time.
    assert _plain(server, "plain_limited", {"tag": "plain_limited"}) == [0, 1, 2]
    assert (server.repository / "logs" / "plain_limited.running").read_text() == "0 1"


def test_the_limit_is_in_the_served_config(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    config = client.get_model_config("limited")
    assert config["ensemble_scheduling"]["max_inflight_requests"] == LIMIT
