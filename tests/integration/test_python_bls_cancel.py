"""Cancelling a decoupled BLS call from the calling model (Triton's
``ResponseIterator.cancel()``), behind a real ``kiln serve``: the callee sees
``is_cancelled()`` and stops, the caller's iteration ends with a CANCELLED error, and a
cancel after the stream ended changes nothing."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import KilnProcess

# Sends a response every 10 ms, up to COUNT, until its request is cancelled; then writes
# how far it got next to the repository and ends with the FINAL flag.
TICKER = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "..", "ticker.log")

    def execute(self, requests):
        for r in requests:
            count = int(pb_utils.get_input_tensor_by_name(r, "COUNT").as_numpy()[0])
            sender = r.get_response_sender()
            for n in range(count):
                if sender.is_cancelled():
                    with open(self.marker, "w") as f:
                        f.write(f"cancelled after {n}")
                    break
                sender.send(pb_utils.InferenceResponse(
                    [pb_utils.Tensor("TICK", np.array([n], np.int32))]))
                time.sleep(0.01)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Asks the ticker for COUNT responses and cancels the call once it has READ of them (or,
# with READ < 0, after the stream ended), then reads on to the end. Answers how many
# responses carried a tick, and the last response's error code and message.
CALLER = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            count = pb_utils.get_input_tensor_by_name(r, "COUNT").as_numpy()
            read = int(pb_utils.get_input_tensor_by_name(r, "READ").as_numpy()[0])
            call = pb_utils.InferenceRequest(
                model_name="ticker", requested_output_names=["TICK"],
                inputs=[pb_utils.Tensor("COUNT", count)])
            responses = call.exec(decoupled=True)
            ticks, last = 0, None
            for response in responses:
                last = response
                if response.output_tensors():
                    ticks += 1
                if ticks == read:
                    responses.cancel()
            if read < 0:
                responses.cancel()  # over already: nothing happens
            error = last.error() if last is not None and last.has_error() else None
            code = error.code() if error is not None else -1
            message = error.message() if error is not None else ""
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("TICKS", np.array([ticks], np.int32)),
                pb_utils.Tensor("CODE", np.array([code], np.int32)),
                pb_utils.Tensor("MESSAGE", np.array([message.encode()], dtype=object))]))
        return out
"""

MODELS = {
    "ticker": (
        TICKER,
        """
        input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "TICK" data_type: TYPE_INT32 dims: [ 1 ] } ]
        model_transaction_policy { decoupled: true }""",
    ),
    "caller": (
        CALLER,
        """
        input [ { name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] },
                { name: "READ" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "TICKS" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "CODE" data_type: TYPE_INT32 dims: [ 1 ] },
                 { name: "MESSAGE" data_type: TYPE_STRING dims: [ 1 ] } ]""",
    ),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("bls_cancel") / "models"
    for name, (source, io) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(source)
        config = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n' + textwrap.dedent(io)
        (repo / name / "config.pbtxt").write_text(config)
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _call(server: KilnProcess, count: int, read: int) -> tuple[int, int, str]:
    client = httpclient.InferenceServerClient(server.http_url)
    inputs = []
    for name, value in (("COUNT", count), ("READ", read)):
        tensor = httpclient.InferInput(name, [1], "INT32")
        tensor.set_data_from_numpy(np.array([value], np.int32))
        inputs.append(tensor)
    result = client.infer("caller", inputs)
    client.close()
    message = result.as_numpy("MESSAGE")[0]
    return (
        int(result.as_numpy("TICKS")[0]),
        int(result.as_numpy("CODE")[0]),
        message.decode() if isinstance(message, bytes) else str(message),
    )


def _marker(server: KilnProcess) -> Path:
    return server.repository / "ticker.log"


def test_a_cancelled_bls_stream_stops_the_callee_and_ends_cancelled(server: KilnProcess) -> None:
    marker = _marker(server)
    marker.unlink(missing_ok=True)
    ticks, code, message = _call(server, count=1000, read=3)
    assert 3 <= ticks < 1000  # the rest of the thousand never came
    assert code == 7  # TritonError.CANCELLED
    assert message == "BLS request to model 'ticker' was cancelled by the calling model"
    deadline = time.monotonic() + 30
    while not marker.exists():  # the ticker saw is_cancelled() and stopped
        assert time.monotonic() < deadline, "the callee never saw the cancellation"
        time.sleep(0.02)
    stopped_at = int(marker.read_text().split()[-1])
    assert stopped_at < 1000


def test_a_cancel_after_the_stream_ended_changes_nothing(server: KilnProcess) -> None:
    assert _call(server, count=4, read=-1) == (4, -1, "")
    assert _call(server, count=2, read=-1) == (2, -1, "")  # the worker goes on
