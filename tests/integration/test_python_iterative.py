"""Request rescheduling and iterative sequences (Triton's ``set_release_flags`` with
``TRITONSERVER_REQUEST_RELEASE_RESCHEDULE`` and ``sequence_batching { iterative_sequence:
true }``) behind a real ``kiln serve``, driven by tritonclient and the HTTP
``generate_stream`` endpoint: a decoupled model streams a countdown across several
``execute`` calls, a unary model answers once after several, requests join a batch while
others are still running, and every misuse gets a clear error naming the model."""

from __future__ import annotations

import json
import queue
import textwrap
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

# Each request counts down from IN: one response per execute, the last one FINAL; each
# response also says how many requests the execute held (BATCH) and what the request's
# flags and correlation id were in that execute. Between executes the request is
# rescheduled: it keeps its sequence slot.
COUNTDOWN_MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.remaining = {}

    def execute(self, requests):
        time.sleep(0.02)  # long enough for a burst of requests to arrive meanwhile
        for request in requests:
            corr = request.correlation_id()
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                start = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
                self.remaining[corr] = int(start.reshape(-1)[0])
            self.remaining[corr] -= 1
            left = self.remaining[corr]
            if request.is_cancelled():
                left = 0  # the client went away: stop here
            outputs = [
                pb_utils.Tensor("OUT", np.array([left], np.int32)),
                pb_utils.Tensor("BATCH", np.array([len(requests)], np.int32)),
                pb_utils.Tensor("FLAGS", np.array([request.flags()], np.int32)),
                pb_utils.Tensor("CORR", np.array([int(corr)], np.uint64)),
            ]
            response = pb_utils.InferenceResponse(output_tensors=outputs)
            sender = request.get_response_sender()
            if left <= 0:
                del self.remaining[corr]
                sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                sender.send(response)
        return None
"""

COUNTDOWN_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: {max_batch_size}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "FLAGS" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "CORR" data_type: TYPE_UINT64 dims: [ 1 ] }} ]
sequence_batching {{ iterative_sequence: true }}
model_transaction_policy {{ decoupled: true }}
"""

# Not decoupled: a request runs IN times, answering None while rescheduled, then once
# with how many executes it took and the flags each saw.
UNARY_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.seen = {}

    def execute(self, requests):
        responses = []
        for request in requests:
            corr = request.correlation_id()
            key = (corr, request.request_id())
            self.seen.setdefault(key, []).append(request.flags())
            want = int(pb_utils.get_input_tensor_by_name(request, "IN").as_numpy().reshape(-1)[0])
            if len(self.seen[key]) < want:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                responses.append(None)
                continue
            flags = self.seen.pop(key)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("RUNS", np.array([len(flags)], np.int32)),
                pb_utils.Tensor("FLAGS", np.array(flags, np.int32)),
                pb_utils.Tensor("CORR", np.array([int(corr)], np.uint64)),
            ]))
        return responses
"""

UNARY_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "RUNS" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "FLAGS" data_type: TYPE_INT32 dims: [ -1 ] }},
         {{ name: "CORR" data_type: TYPE_UINT64 dims: [ 1 ] }} ]
{scheduling}
"""

# Rescheduled on its first run, it tries to send on that run's sender from a thread once
# execute has returned: refused, since the request now belongs to its next run.
LATE_SEND_MODEL = """
import os, threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.log = os.path.join(args["model_repository"], "..", "late_send.log")

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            out = pb_utils.InferenceResponse([pb_utils.Tensor("OUT", np.array([0], np.int32))])
            if request.flags() & pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START:
                request.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
                threading.Thread(target=self._late, args=(sender, out)).start()
            else:
                time.sleep(0.3)  # the late send happens while this run goes on
                sender.send(out, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def _late(self, sender, out):
        time.sleep(0.1)  # execute has returned by now
        try:
            sender.send(out)
            text = "sent"
        except pb_utils.TritonModelException as exc:
            text = str(exc)
        with open(self.log, "w") as f:
            f.write(text)
"""

MODELS = {
    "py_late_send": (
        LATE_SEND_MODEL,
        """
        name: "py_late_send"
        backend: "python"
        max_batch_size: 0
        input [ { name: "IN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        sequence_batching { iterative_sequence: true }
        model_transaction_policy { decoupled: true }
        """,
    ),
    "py_countdown": (
        COUNTDOWN_MODEL, COUNTDOWN_CONFIG.format(name="py_countdown", max_batch_size=4)
    ),
    # one slot: a second request waits until the first is released
    "py_countdown_one": (
        COUNTDOWN_MODEL, COUNTDOWN_CONFIG.format(name="py_countdown_one", max_batch_size=0)
    ),
    "py_iter_unary": (
        UNARY_MODEL,
        UNARY_CONFIG.format(name="py_iter_unary",
                            scheduling="sequence_batching { iterative_sequence: true }"),
    ),
    # rescheduling where the scheduler cannot take the request back
    "py_resched_plain": (UNARY_MODEL, UNARY_CONFIG.format(name="py_resched_plain", scheduling="")),
    "py_resched_dynamic": (
        UNARY_MODEL,
        UNARY_CONFIG.format(name="py_resched_dynamic", scheduling="dynamic_batching { }"),
    ),
    "py_resched_sequence": (
        UNARY_MODEL,
        UNARY_CONFIG.format(name="py_resched_sequence", scheduling="sequence_batching { }"),
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("iterative") / "models"
    for name, (source, config) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _countdown_input(n: int, batched: bool = True) -> list[grpcclient.InferInput]:
    shape = [1, 1] if batched else [1]
    tensor = grpcclient.InferInput("IN", shape, "INT32")
    tensor.set_data_from_numpy(np.array([n], np.int32).reshape(shape))
    return [tensor]


def _collect(results: queue.Queue[Any], result: Any, error: Any) -> None:
    results.put(error if error is not None else result)


def _stream(
    server: KilnProcess, model: str, counts: list[int], batched: bool = True
) -> dict[str, list[dict[str, Any]]]:
    """Send one request per count on one gRPC stream; every response, per request id."""
    results: queue.Queue[Any] = queue.Queue()
    got: dict[str, list[dict[str, Any]]] = {str(i): [] for i in range(len(counts))}
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=partial(_collect, results))
        for i, n in enumerate(counts):
            client.async_stream_infer(model, _countdown_input(n, batched), request_id=str(i))
        while any(not r or not r[-1]["final"] for r in got.values()):
            item = results.get(timeout=30)
            if isinstance(item, InferenceServerException):
                raise item
            response = item.get_response()
            got[response.id].append(
                {
                    "out": int(item.as_numpy("OUT").reshape(-1)[0]),
                    "batch": int(item.as_numpy("BATCH").reshape(-1)[0]),
                    "flags": int(item.as_numpy("FLAGS").reshape(-1)[0]),
                    "corr": int(item.as_numpy("CORR").reshape(-1)[0]),
                    "final": response.parameters["triton_final_response"].bool_param,
                }
            )
        client.stop_stream()
    return got


def test_a_rescheduled_decoupled_request_streams_across_executes(server: KilnProcess) -> None:
    got = _stream(server, "py_countdown", [3])["0"]
    assert [r["out"] for r in got] == [2, 1, 0]
    assert [r["final"] for r in got] == [False, False, True]
    # START on its first execute only; one sequence id for all three, named by kiln
    assert [r["flags"] for r in got] == [1, 0, 0]
    assert len({r["corr"] for r in got}) == 1 and got[0]["corr"] > 0


def test_requests_join_a_batch_while_others_iterate(server: KilnProcess) -> None:
    counts = [5, 2, 4, 1, 3, 6]
    got = _stream(server, "py_countdown", counts)
    for i, n in enumerate(counts):
        mine = got[str(i)]
        assert [r["out"] for r in mine] == list(range(n - 1, -1, -1)), f"request {i}"
        assert mine[0]["flags"] == 1 and all(r["flags"] == 0 for r in mine[1:])
    # six requests, four slots (max_batch_size 4): executes held several requests at once,
    # never more than the slots, and each request kept its own sequence id
    batches = [r["batch"] for mine in got.values() for r in mine]
    assert max(batches) > 1
    assert max(batches) <= 4
    ids = [{r["corr"] for r in mine} for mine in got.values()]
    assert all(len(s) == 1 for s in ids)
    assert len(set.union(*ids)) == len(counts)


def test_generate_stream_sse_streams_the_countdown(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/py_countdown/generate_stream"
    with requests.post(url, json={"IN": 2}, stream=True, timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        events = [
            json.loads(line[len(b"data: ") :])
            for line in resp.iter_lines()
            if line.startswith(b"data: ")
        ]
    assert [e["OUT"] for e in events] == [1, 0]  # one element: a bare value, as Triton


def test_a_unary_request_is_answered_once_after_its_last_execute(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([4], np.int32))
    first = client.infer("py_iter_unary", [inp])
    second = client.infer("py_iter_unary", [inp])
    assert first.as_numpy("RUNS").tolist() == [4]
    assert first.as_numpy("FLAGS").tolist() == [1, 0, 0, 0]  # START, then continuations
    assert first.as_numpy("CORR")[0] != second.as_numpy("CORR")[0]  # a sequence each


def test_a_client_sequence_id_is_kept_and_may_be_rescheduled(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("IN", [1], "INT32")
    inp.set_data_from_numpy(np.array([3], np.int32))
    result = client.infer(
        "py_iter_unary", [inp], sequence_id=4242, sequence_start=True, sequence_end=True
    )
    assert result.as_numpy("CORR").tolist() == [4242]
    # START and END on the first run; a continuation keeps END, not START
    assert result.as_numpy("FLAGS").tolist() == [3, 2, 2]


@pytest.mark.parametrize(
    "model, kwargs",
    [
        ("py_resched_plain", {}),
        ("py_resched_dynamic", {}),
        ("py_resched_sequence", {"sequence_id": 7, "sequence_start": True, "sequence_end": True}),
    ],
)
def test_rescheduling_without_iterative_sequence_is_an_error(
    server: KilnProcess, model: str, kwargs: dict[str, Any]
) -> None:
    for proto, client in (
        ("http", httpclient.InferenceServerClient(server.http_url)),
        ("grpc", grpcclient.InferenceServerClient(server.grpc_url)),
    ):
        mod = httpclient if proto == "http" else grpcclient
        inp = mod.InferInput("IN", [1], "INT32")
        inp.set_data_from_numpy(np.array([2], np.int32))
        with pytest.raises(InferenceServerException) as info:
            client.infer(model, [inp], request_id=f"{proto}-twice", **kwargs)
        text = str(info.value)
        # Triton's words first (clients match on them), then which model and what it needs
        assert "Request is released with TRITONSERVER_REQUEST_RELEASE_RESCHEDULE" in text
        assert f"'{model}'" in text and "iterative_sequence" in text
        # the model and the server keep serving: a request that needs one run succeeds
        inp.set_data_from_numpy(np.array([1], np.int32))
        once = client.infer(model, [inp], request_id=f"{proto}-once", **kwargs)
        assert once.as_numpy("RUNS").tolist() == [1]


def test_a_cancelled_iterative_request_frees_its_slot(server: KilnProcess) -> None:
    """One slot: a request counting down from a large number holds it; its client goes
    away; the next request gets the slot and completes."""
    results: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=partial(_collect, results))
    client.async_stream_infer("py_countdown_one", _countdown_input(100_000, batched=False))
    first = results.get(timeout=30)
    assert not isinstance(first, InferenceServerException), first
    client.stop_stream(cancel_requests=True)
    client.close()
    got = _stream(server, "py_countdown_one", [2], batched=False)["0"]
    assert [r["out"] for r in got] == [1, 0]


def test_a_send_on_a_rescheduled_run_s_sender_is_refused(server: KilnProcess) -> None:
    """Triton asks a decoupled model to reschedule before execute returns: the sender of
    that run is closed then, so a late send cannot reach the request's next run."""
    results: queue.Queue[Any] = queue.Queue()
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=partial(_collect, results))
        client.async_stream_infer("py_late_send", _countdown_input(1, batched=False))
        item = results.get(timeout=30)  # the second run's one response, FINAL
        assert not isinstance(item, InferenceServerException), item
        client.stop_stream()
    log = server.repository / "late_send.log"
    for _ in range(200):  # the model's thread writes it (no duration is asserted)
        if log.exists() and log.read_text():
            break
        time.sleep(0.05)
    text = log.read_text()
    assert "the request was rescheduled (TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)" in text
