"""Decoupled Python models written the way Triton's vLLM backend is: ``execute`` hands each
request to an asyncio loop of the model's own (or is itself ``async def``) and returns, and
the tokens stream from there. Behind a real ``kiln serve`` with one instance, several
clients' streams run at once (tritonclient gRPC and HTTP ``generate_stream``). Also: a
model making hundreds of BLS calls in one ``execute`` keeps its side arenas bounded.

Each model counts how many of its requests are generating at once; the assertions are
about those counts and the tokens, none about durations."""

from __future__ import annotations

import json
import os
import queue
import signal
import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.backends.python.worker_channel import RECLAIM_BYTES
from tests.conftest import KilnProcess

GENERATE = """
    async def generate(self, r):
        params = json.loads(r.parameters())
        barrier, count = int(params["barrier"]), int(params["count"])
        sender = r.get_response_sender()
        self.running += 1
        self.peak = max(self.peak, self.running)
        for _ in range(3000):  # until `barrier` requests generate at once (30 s at most)
            if self.peak >= barrier:
                break
            await asyncio.sleep(0.01)
        peak = self.peak
        prompt = pb_utils.get_input_tensor_by_name(r, "PROMPT").as_numpy()
        for i in range(count):
            await asyncio.sleep(0)
            token = np.array([int(prompt[0]) * 100 + i], np.int32)
            seen = np.array([peak], np.int32)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("TOKEN", token), pb_utils.Tensor("PEAK", seen)]))
        self.running -= 1
        if not self.running:
            self.peak = 0  # the next test's requests count from nothing
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Triton's vLLM backend's shape: a loop thread of the model's own, execute returns at once.
LOOP_THREAD = (
    """
import asyncio, json, threading
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.running = self.peak = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            asyncio.run_coroutine_threadsafe(self.generate(r), self.loop)
        return None
"""
    + GENERATE
)

# Triton 24.04+: a decoupled model's ``async def execute`` coroutines run side by side.
ASYNC_EXECUTE = (
    """
import asyncio, json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.running = self.peak = 0

    async def execute(self, requests):
        await asyncio.gather(*(self.generate(r) for r in requests))
        return None
"""
    + GENERATE
)

# One execute, CALLS BLS calls of 16 KiB each way on `echo`; answers whether every
# answer equalled its call, and how large the side arenas grew.
BLS_LOOP = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

CALLS = 300

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            good = 0
            for i in range(CALLS):
                x = np.full((4096,), i, np.float32)
                call = pb_utils.InferenceRequest(
                    model_name="echo", requested_output_names=["Y"],
                    inputs=[pb_utils.Tensor("X", x)])
                reply = call.exec()
                if reply.has_error():
                    raise RuntimeError(reply.error().message())
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                good += int(np.array_equal(x, y))
            channel = pb_utils._channel
            sizes = [os.stat(channel.side_in.path).st_size, os.stat(channel.side_out.path).st_size]
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("GOOD", np.array([good], np.int32)),
                pb_utils.Tensor("SIDE", np.array(sizes, np.int64))]))
        return out
"""

ECHO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor(
            "Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]) for r in requests]
"""

# Written the way Triton's decoupled examples are: initialize refuses a config that is not
# decoupled and takes the output's dtype from the config, execute starts a thread per request
# and returns, each thread sends IN responses of IN squared then the FINAL flag, and
# finalize waits for the threads still sending.
SQUARE = """
import json, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                "model {} must use the decoupled transaction policy".format(args["model_name"]))
        out = pb_utils.get_output_config_by_name(config, "OUT")
        self.out_dtype = pb_utils.triton_string_to_numpy(out["data_type"])
        self.lock = threading.Lock()
        self.inflight = 0

    def execute(self, requests):
        for request in requests:
            with self.lock:
                self.inflight += 1
            threading.Thread(target=self.respond, args=(request,), daemon=True).start()
        return None

    def respond(self, request):
        try:
            n = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()[0])
            sender = request.get_response_sender()
            for _ in range(n):
                out = pb_utils.Tensor("OUT", np.array([n * n], dtype=self.out_dtype))
                if out.triton_dtype() != pb_utils.numpy_to_triton_type(self.out_dtype):
                    raise RuntimeError("triton_dtype disagrees with numpy_to_triton_type")
                sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
                time.sleep(0.005)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.inflight -= 1

    def finalize(self):
        for _ in range(500):
            if not self.inflight:
                return
            time.sleep(0.01)
"""

# Under the sequence batcher: a sequence's first request hands its stream to a thread of
# the model's, which sends 1, then holds the FINAL flag until the sequence's next request
# has run (20 s at most), then sends 3 if it did, -1 if not. The next request answers 2.
SEQ_HANDOFF = """
import threading
import numpy as np
import triton_python_backend_utils as pb_utils

def _out(value):
    return pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([value], np.int32))])

class TritonPythonModel:
    def initialize(self, args):
        self.next_ran = {}  # sequence id -> set once the sequence's next request ran

    def execute(self, requests):
        for r in requests:
            corrid = r.correlation_id()
            if r.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                ran = self.next_ran[corrid] = threading.Event()
                threading.Thread(target=self.first, args=(r, ran), daemon=True).start()
            else:
                r.get_response_sender().send(
                    _out(2), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                self.next_ran.pop(corrid).set()
        return None

    def first(self, request, ran):
        sender = request.get_response_sender()
        sender.send(_out(1))
        seen = ran.wait(20)
        sender.send(_out(3 if seen else -1), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# Under the sequence batcher, not decoupled: sleeps X seconds, answers its worker's pid.
# Before a sleep it writes the sequence id to a file `sleeping` in its model's folder.
SEQ_PID = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "sleeping")

    def execute(self, requests):
        out = []
        for r in requests:
            seconds = float(pb_utils.get_input_tensor_by_name(r, "X").as_numpy()[0])
            if seconds:
                with open(self.marker, "w") as f:
                    f.write(str(r.correlation_id()))
            time.sleep(seconds)
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUT", np.array([os.getpid()], np.int32))]))
        return out
"""

SQUARE_IO = """
input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

GENERATOR_IO = """
input [ { name: "PROMPT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] },
         { name: "PEAK" data_type: TYPE_INT32 dims: [ 1 ] } ]
model_transaction_policy { decoupled: true }
"""

MODELS = {
    "square": (SQUARE, SQUARE_IO + "model_transaction_policy { decoupled: true }\n"),
    "square_unary": (SQUARE, SQUARE_IO),  # refused by its own initialize
    "loop_thread": (LOOP_THREAD, GENERATOR_IO),
    "async_execute": (ASYNC_EXECUTE, GENERATOR_IO),
    "seq_handoff": (
        SEQ_HANDOFF,
        """
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        model_transaction_policy { decoupled: true }
        sequence_batching { }""",
    ),
    "seq_pid": (
        SEQ_PID,
        """
        input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        sequence_batching { }""",
    ),
    "bls_loop": (
        BLS_LOOP,
        """
        input [ { name: "GO" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "GOOD" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "SIDE" data_type: TYPE_INT64 dims: [ 2 ] } ]""",
    ),
    "echo": (
        ECHO,
        """
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 4096 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 4096 ] } ]""",
    ),
}

COUNT = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("detached") / "models"
    for name, (source, io) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        # one instance: concurrency can only come from execute returning early
        config = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n' + textwrap.dedent(io)
        config += "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        (repo / name / "config.pbtxt").write_text(config)
    proc = KilnProcess(repo, ["--no-strict-readiness"]).start()  # square_unary fails
    yield proc
    proc.stop()


def _grpc_streams(server: KilnProcess, model: str, prompts: list[int]) -> dict[str, list[Any]]:
    """One gRPC stream carrying a request per prompt; each request's responses by id."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    params = {"barrier": len(prompts), "count": COUNT}
    for prompt in prompts:
        tensor = grpcclient.InferInput("PROMPT", [1], "INT32")
        tensor.set_data_from_numpy(np.array([prompt], np.int32))
        client.async_stream_infer(
            model,
            [tensor],
            request_id=str(prompt),
            parameters=params,
            enable_empty_final_response=True,  # the FINAL flag comes alone
        )
    answers: dict[str, list[Any]] = {str(p): [] for p in prompts}
    finals = 0
    while finals < len(prompts):
        item = got.get(timeout=60)
        assert not isinstance(item, Exception), item
        response = item.get_response()
        if response.parameters["triton_final_response"].bool_param:
            finals += 1
            continue
        answers[response.id].append((int(item.as_numpy("TOKEN")[0]), int(item.as_numpy("PEAK")[0])))
    client.stop_stream()
    client.close()
    return answers


@pytest.mark.parametrize("model", ["loop_thread", "async_execute"])
def test_one_instance_streams_to_several_clients_at_once(server: KilnProcess, model: str) -> None:
    """Four requests on one instance generate at the same time: each waits until all
    four have started, which a server that ran them one after another would not allow
    (the first would give up waiting and report a peak of 1)."""
    prompts = [1, 2, 3, 4]
    answers = _grpc_streams(server, model, prompts)
    for prompt in prompts:
        tokens = [token for token, _ in answers[str(prompt)]]
        assert tokens == [prompt * 100 + i for i in range(COUNT)]
        assert {peak for _, peak in answers[str(prompt)]} == {len(prompts)}


def _sse(server: KilnProcess, model: str, prompt: int, barrier: int) -> list[dict[str, Any]]:
    body = {"PROMPT": prompt, "parameters": {"barrier": barrier, "count": COUNT}}
    url = f"http://{server.http_url}/v2/models/{model}/generate_stream"
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
    return events


def test_generate_stream_clients_share_one_instance(server: KilnProcess) -> None:
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: _sse(server, "async_execute", p, 3), [7, 8, 9]))
    for prompt, events in zip([7, 8, 9], results, strict=True):
        assert [e["TOKEN"] for e in events] == [prompt * 100 + i for i in range(COUNT)]
        assert {e["PEAK"] for e in events} == {3}


def test_a_client_that_leaves_does_not_hold_the_instance(server: KilnProcess) -> None:
    """A stream whose client leaves before the others come: the model goes on with the
    next request (its barrier of 1 met at once)."""
    done = threading.Event()

    def leave() -> None:
        client = grpcclient.InferenceServerClient(server.grpc_url)
        client.start_stream(callback=lambda result, error: None)
        tensor = grpcclient.InferInput("PROMPT", [1], "INT32")
        tensor.set_data_from_numpy(np.array([5], np.int32))
        # barrier 2: it waits for a second request that comes only after it left
        client.async_stream_infer(
            "loop_thread", [tensor], parameters={"barrier": 2, "count": COUNT}
        )
        client.stop_stream(cancel_requests=True)
        client.close()
        done.set()

    leave()
    assert done.wait(30)
    answers = _grpc_streams(server, "loop_thread", [6])
    assert [t for t, _ in answers["6"]] == [600 + i for i in range(COUNT)]


def test_a_sequence_s_next_request_runs_while_the_one_before_still_streams(
    server: KilnProcess,
) -> None:
    """As on Triton, the sequence batcher gives a decoupled model the sequence's next
    request once ``execute`` has returned for the one before, not once that request's
    FINAL flag has gone out: here the first request's stream ends only after the second
    request ran (a batcher that waited for the FINAL flag would have the model's thread
    give up after 20 s and send -1)."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    for value, start, end in ((0, True, False), (0, False, True)):
        tensor = grpcclient.InferInput("X", [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        client.async_stream_infer(
            "seq_handoff", [tensor], request_id="first" if start else "next",
            sequence_id=41, sequence_start=start, sequence_end=end)  # fmt: skip
    answers: dict[str, list[int]] = {"first": [], "next": []}
    for _ in range(3):
        item = got.get(timeout=60)
        assert not isinstance(item, Exception), item
        answers[item.get_response().id].append(int(item.as_numpy("OUT")[0]))
    client.stop_stream()
    client.close()
    assert answers == {"first": [1, 3], "next": [2]}


def test_a_sequence_outlives_its_worker_s_death(server: KilnProcess) -> None:
    """The worker is killed while it executes a sequence's first request: that request
    fails naming the model, and the sequence's next request, waiting behind it, is
    answered by the restarted worker."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=2)

    def send(seconds: int, sequence: int, start: bool, end: bool) -> Any:
        x = httpclient.InferInput("X", [1], "INT32")
        x.set_data_from_numpy(np.array([seconds], np.int32))
        return client.async_infer(
            "seq_pid", [x], sequence_id=sequence, sequence_start=start, sequence_end=end
        )

    pid = int(send(0, 50, True, True).get_result(timeout=60).as_numpy("OUT")[0])
    marker = server.repository / "seq_pid" / "sleeping"
    first = send(30, 51, True, False)  # sleeps in execute until killed
    for _ in range(3000):  # until it is inside execute (30 s at most)
        if marker.exists() and marker.read_text() == "51":
            break
        threading.Event().wait(0.01)
    second = send(0, 51, False, True)  # waits for the first: same sequence
    threading.Event().wait(0.3)  # let it reach the sequence batcher (it must wait either way)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(InferenceServerException, match="seq_pid"):
        first.get_result(timeout=60)
    answer = int(second.get_result(timeout=60).as_numpy("OUT")[0])
    assert answer not in (0, pid)  # a new worker's pid
    client.close()


def test_hundreds_of_bls_calls_in_one_execute_keep_the_side_arenas_bounded(
    server: KilnProcess,
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    go = httpclient.InferInput("GO", [1], "INT32")
    go.set_data_from_numpy(np.array([1], np.int32))
    result = client.infer("bls_loop", [go])
    assert int(result.as_numpy("GOOD")[0]) == 300  # every answer equalled its call
    side_in, side_out = result.as_numpy("SIDE").tolist()
    # 300 calls of 16 KiB each way (4.7 MiB) went through without growing past the mark
    assert side_in <= 2 * RECLAIM_BYTES
    assert side_out <= 2 * RECLAIM_BYTES
    client.close()


def test_a_model_written_like_triton_s_decoupled_examples_runs_unchanged(
    server: KilnProcess,
) -> None:
    """Three requests on one stream, answered from the model's threads: IN responses of
    IN squared each, in the config's dtype, and for IN=0 only the FINAL flag."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    for n in (3, 5, 0):
        tensor = grpcclient.InferInput("IN", [1], "INT32")
        tensor.set_data_from_numpy(np.array([n], np.int32))
        client.async_stream_infer(
            "square", [tensor], request_id=str(n), enable_empty_final_response=True
        )
    answers: dict[str, list[int]] = {"3": [], "5": [], "0": []}
    finals = 0
    while finals < 3:
        item = got.get(timeout=30)
        assert not isinstance(item, Exception), item
        response = item.get_response()
        if response.parameters["triton_final_response"].bool_param:
            finals += 1
            assert response.outputs == []
            continue
        out = item.as_numpy("OUT")
        assert out.dtype == np.int32
        answers[response.id].append(int(out[0]))
    client.stop_stream()
    client.close()
    assert answers == {"3": [9] * 3, "5": [25] * 5, "0": []}


def test_the_example_s_own_check_refuses_a_config_that_is_not_decoupled(
    server: KilnProcess,
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["square_unary"]["state"] == "UNAVAILABLE"
    assert (
        "model square_unary must use the decoupled transaction policy"
        in index["square_unary"]["reason"]
    )
    client.close()
