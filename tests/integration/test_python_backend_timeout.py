"""A hung Python model behind a real ``kiln serve``: the request's own ``timeout`` bounds
its execution (HTTP and gRPC), the worker is replaced, and nothing else is held up; the
failures show in the statistics extension and /metrics as Triton counts them."""

from __future__ import annotations

import os
import textwrap
import threading
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository, reference_outputs
from tests.conftest import KilnProcess

# On "sleep" it leaves a marker file (so the test knows it hangs now), then sleeps far
# longer than any request's timeout. execute_timeout_secs alone would allow 60 s.
HANG_MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "hanging")

    def execute(self, requests):
        responses = []
        for request in requests:
            if pb_utils.get_input_tensor_by_name(request, "ACTION").as_numpy()[0] == b"sleep":
                with open(self.marker, "w") as f:
                    f.write(str(os.getpid()))
                time.sleep(30)
            pid = np.array([os.getpid()], dtype=np.int64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]))
        return responses
"""

HANG_CONFIG = """
name: "py_hang"
backend: "python"
max_batch_size: 0
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
dynamic_batching { default_queue_policy { allow_timeout_override: true } }
parameters { key: "execute_timeout_secs" value { string_value: "60" } }
"""

# Far below the model's 30 s sleep: a client still waiting then has its answer missing.
CLIENT_TIMEOUT_S = 20.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("hangrepo") / "models"
    build_example_repository(repo, ["mlp"])
    (repo / "py_hang" / "1").mkdir(parents=True)
    (repo / "py_hang" / "1" / "model.py").write_text(textwrap.dedent(HANG_MODEL))
    (repo / "py_hang" / "config.pbtxt").write_text(textwrap.dedent(HANG_CONFIG))
    proc = KilnProcess(repo).start()
    yield proc
    proc.stop()


def _http(server: KilnProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, network_timeout=CLIENT_TIMEOUT_S)


def _action(action: str) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("ACTION", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([action.encode()], dtype=object))
    return [tensor]


def _grpc_action(action: str) -> list[grpcclient.InferInput]:
    tensor = grpcclient.InferInput("ACTION", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([action.encode()], dtype=object))
    return [tensor]


def _pid(server: KilnProcess) -> int:
    return int(_http(server).infer("py_hang", _action("ok")).as_numpy("PID")[0])


def _fail_count(server: KilnProcess) -> int:
    stats = _http(server).get_inference_statistics("py_hang")["model_stats"][0]
    return int(stats["inference_stats"]["fail"]["count"])


def _rejected_metric(server: KilnProcess) -> float:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        ours = 'model="py_hang"' in line and 'reason="REJECTED"' in line
        if line.startswith("nv_inference_request_failure{") and ours:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no REJECTED failure counter for py_hang")


def _assert_restarted(server: KilnProcess, old: int) -> None:
    assert _pid(server) != old  # a new, re-initialized worker answers
    with pytest.raises(ProcessLookupError):
        os.kill(old, 0)  # the hung one is gone


def test_request_timeout_bounds_a_hung_execute_http_and_grpc(server: KilnProcess) -> None:
    fails, rejected = _fail_count(server), _rejected_metric(server)

    pid = _pid(server)
    with pytest.raises(InferenceServerException) as http_err:
        _http(server).infer("py_hang", _action("sleep"), timeout=200_000)
    assert http_err.value.status() == "503"
    assert http_err.value.message().startswith("Request timeout expired: model 'py_hang'")
    assert "Python worker was killed" in http_err.value.message()
    _assert_restarted(server, pid)

    pid = _pid(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as grpc_err:
            client.infer(
                "py_hang",
                _grpc_action("sleep"),
                timeout=200_000,
                client_timeout=CLIENT_TIMEOUT_S,
            )
    finally:
        client.close()
    assert grpc_err.value.status() == "StatusCode.UNAVAILABLE"
    assert grpc_err.value.message().startswith("Request timeout expired: model 'py_hang'")
    _assert_restarted(server, pid)

    # Both count as failed requests, with Triton's reason for a request timeout.
    assert _fail_count(server) == fails + 2
    assert _rejected_metric(server) == rejected + 2


def test_hang_holds_up_neither_other_models_nor_queued_requests(server: KilnProcess) -> None:
    marker = server.repository / "py_hang" / "hanging"
    marker.unlink(missing_ok=True)
    pid = _pid(server)
    x = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
    with ThreadPoolExecutor(2) as pool:
        hung = pool.submit(_http(server).infer, "py_hang", _action("sleep"), timeout=2_000_000)
        for _ in range(300):  # until the worker is inside the sleeping execute
            if marker.exists():
                break
            threading.Event().wait(0.05)
        assert int(marker.read_text()) == pid
        # Queued behind the hung request on the model's only instance, with no timeout.
        queued = pool.submit(_pid, server)
        mlp_in = httpclient.InferInput("INPUT", list(x.shape), "FP32")
        mlp_in.set_data_from_numpy(x)
        logits = _http(server).infer("mlp", [mlp_in]).as_numpy("LOGITS")
        np.testing.assert_allclose(
            logits, reference_outputs("mlp", {"INPUT": x})["LOGITS"], rtol=1e-4
        )
        with pytest.raises(
            InferenceServerException, match=r"\[503\] Request timeout expired: model 'py_hang'"
        ):
            hung.result(timeout=CLIENT_TIMEOUT_S)
        # It runs on the replacement worker: it neither hung nor failed.
        assert queued.result(timeout=CLIENT_TIMEOUT_S) not in (pid, 0)


def test_validation_errors_are_not_counted_as_failures(server: KilnProcess) -> None:
    # As in Triton, a request refused before it reaches the model's scheduler is in no
    # model's statistics: only requests the model (or its queue) failed are.
    fails, rejected = _fail_count(server), _rejected_metric(server)
    wrong = httpclient.InferInput("ACTION", [1], "INT32")
    wrong.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException, match="ACTION") as err:
        _http(server).infer("py_hang", [wrong])
    assert err.value.status() == "400"
    assert _fail_count(server) == fails
    assert _rejected_metric(server) == rejected
    _pid(server)  # and the model keeps serving
