"""The Python backend behind a real ``kiln serve``: tritonclient HTTP and gRPC, decoupled
streams, BLS, and each fault a user model can cause."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import signal
import socket
import textwrap
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository, reference_outputs, reference_responses
from tests.conftest import KilnProcess

FAULTS_MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        action = pb_utils.get_input_tensor_by_name(requests[0], "ACTION").as_numpy()[0]
        x = pb_utils.get_input_tensor_by_name(requests[0], "INPUT").as_numpy()
        if action == b"raise":
            raise ValueError("boom from execute")
        if action == b"sleep":
            time.sleep(30)
        if action == b"wrong_count":
            return []
        if action == b"wrong_dtype":
            x = x.astype(np.float64)
        outputs = [pb_utils.Tensor("PID", np.array([os.getpid()], dtype=np.int64))]
        if action != b"missing":
            outputs.append(pb_utils.Tensor("OUTPUT", x * 2))
        return [pb_utils.InferenceResponse(output_tensors=outputs) for _ in requests]
"""

FAULTS_CONFIG = """
name: "py_faults"
backend: "python"
max_batch_size: 0
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ -1 ] },
         { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
parameters { key: "execute_timeout_secs" value { string_value: "3" } }
"""

INIT_FAILS_MODEL = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("cannot open weights file missing.bin")

    def execute(self, requests):
        return []
"""

BLS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT")
            names = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()
            target = names.reshape(-1)[0].decode()
            call = pb_utils.InferenceRequest(
                model_name=target, requested_output_names=["LOGITS"],
                inputs=[pb_utils.Tensor("INPUT", x.as_numpy())])
            first = call.exec()
            if first.has_error():
                error = pb_utils.TritonError("BLS failed: " + first.error().message())
                responses.append(pb_utils.InferenceResponse(error=error))
                continue
            second = await call.async_exec()
            a = pb_utils.get_output_tensor_by_name(first, "LOGITS").as_numpy()
            b = pb_utils.get_output_tensor_by_name(second, "LOGITS").as_numpy()
            assert np.array_equal(a, b)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("LOGITS", a)]))
        return responses
"""

BLS_CONFIG = """
name: "py_bls"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 64 ] },
        { name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "LOGITS" data_type: TYPE_FP32 dims: [ 10 ] } ]
"""

AUTO_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(4)
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [2]})
        config.add_output({"name": "Y", "data_type": "TYPE_INT32", "dims": [2]})
        return config

    def execute(self, requests):
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y",
                pb_utils.get_input_tensor_by_name(r, "X").as_numpy() + 1)]) for r in requests]
"""

UNTIL_CANCELLED_MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]

    def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        tag = pb_utils.get_input_tensor_by_name(request, "TAG").as_numpy().reshape(-1)[0]
        for i in range(6000):  # 30 s of responses unless the client goes away
            if sender.is_cancelled():
                # what the test reads: this request saw its client go, after i responses
                with open(os.path.join(self.folder, tag.decode() + ".cancelled"), "w") as f:
                    f.write(str(i))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("N", np.array([i], np.int32))]))
            time.sleep(0.005)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

UNTIL_CANCELLED_CONFIG = """
name: "py_until_cancelled"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "TAG" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "N" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

UNARY_UNTIL_CANCELLED_MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.folder = args["model_repository"]

    def execute(self, requests):
        request = requests[0]
        x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
        tag = str(int(x[0]))  # each test its own X: its own files
        open(os.path.join(self.folder, "started." + tag), "w").close()
        for i in range(6000):  # 30 s unless the client goes away
            if request.is_cancelled():
                with open(os.path.join(self.folder, "cancelled." + tag), "w") as f:
                    f.write(str(i))
                break
            time.sleep(0.005)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("Y", x)])]
"""

UNARY_UNTIL_CANCELLED_CONFIG = """
name: "py_unary_until_cancelled"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
"""

BLS_FIELDS_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        mode = pb_utils.get_input_tensor_by_name(request, "MODE").as_numpy().reshape(-1)[0]
        if mode == b"sequence":  # three steps of one sequence, by correlation_id and flags
            flags = [pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START, 0,
                     pb_utils.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END]
            totals = []
            for value, flag in zip([1, 2, 3], flags):
                call = pb_utils.InferenceRequest(
                    model_name="simple_sequence_state", requested_output_names=["OUTPUT"],
                    inputs=[pb_utils.Tensor("INPUT", np.array([[value]], np.int32))],
                    correlation_id=4242, flags=flag)
                response = call.exec()
                if response.has_error():
                    raise pb_utils.TritonModelException(response.error().message())
                out = pb_utils.get_output_tensor_by_name(response, "OUTPUT").as_numpy()
                totals.append(int(out.reshape(-1)[0]))
            result = np.array(totals, np.int32)
        else:  # a 0.1 s timeout in a queue that holds a lone request for 30 s
            call = pb_utils.InferenceRequest(
                model_name="py_slow_queue", requested_output_names=["Y"],
                inputs=[pb_utils.Tensor("X", np.array([[1]], np.int32))], timeout=100000)
            response = call.exec()
            if response.has_error():
                error = pb_utils.TritonError("BLS failed: " + response.error().message())
                return [pb_utils.InferenceResponse(error=error)]
            result = np.array([-1], np.int32)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("TOTALS", result)])]
"""

BLS_FIELDS_CONFIG = """
name: "py_bls_fields"
backend: "python"
max_batch_size: 0
input [ { name: "MODE" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "TOTALS" data_type: TYPE_INT32 dims: [ -1 ] } ]
"""

SLOW_QUEUE_MODEL = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())])
            for r in requests]
"""

SLOW_QUEUE_CONFIG = """
name: "py_slow_queue"
backend: "python"
max_batch_size: 8
input [ { name: "X" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "Y" data_type: TYPE_INT32 dims: [ 1 ] } ]
dynamic_batching {
  preferred_batch_size: [ 8 ]
  max_queue_delay_microseconds: 30000000
  default_queue_policy { allow_timeout_override: true }
}
"""

BLS_STREAM_MODEL = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        import json
        self.decoupled = json.loads(args["model_config"]).get(
            "model_transaction_policy", {}).get("decoupled", False)

    def execute(self, requests):
        request = requests[0]
        values = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        target = pb_utils.get_input_tensor_by_name(request, "TARGET").as_numpy()
        call = pb_utils.InferenceRequest(
            model_name=target.reshape(-1)[0].decode(), requested_output_names=["OUT", "IDX"],
            inputs=[pb_utils.Tensor("IN", values)])
        if self.decoupled:  # relay each response as it comes, doubled
            sender = request.get_response_sender()
            for response in call.exec(decoupled=True):
                if response.has_error():
                    sender.send(pb_utils.InferenceResponse(error=response.error()))
                elif response.output_tensors():
                    out = pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out * 2)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None
        if len(values) > 3:  # take the first response only and leave the rest unread
            first = next(iter(call.exec(decoupled=True)))
            out = pb_utils.get_output_tensor_by_name(first, "OUT").as_numpy()
            return [pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)])]
        outs, empty_final = [], 0
        for response in call.exec(decoupled=True):
            if response.has_error():
                error = pb_utils.TritonError("BLS failed: " + response.error().message())
                return [pb_utils.InferenceResponse(error=error)]
            if not response.output_tensors():
                empty_final += 1
                continue
            outs.append(int(pb_utils.get_output_tensor_by_name(response, "OUT").as_numpy()[0]))
        # the responses' values, then how many empty final responses came (1, as Triton)
        return [pb_utils.InferenceResponse(
            [pb_utils.Tensor("OUT", np.array(outs + [empty_final], np.int32))])]
"""

BLS_STREAM_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
{policy}
input [ {{ name: "IN" data_type: TYPE_INT32 dims: [ -1 ] }},
        {{ name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] }} ]
"""

SLOW_REPEAT_MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        sender = requests[0].get_response_sender()
        values = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        for index, value in enumerate(values.reshape(-1)):
            time.sleep(0.05)
            sender.send(pb_utils.InferenceResponse([
                pb_utils.Tensor("OUT", np.full(4096, value, np.int32)),
                pb_utils.Tensor("IDX", np.array([index], np.uint32))]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

SLOW_REPEAT_CONFIG = """
name: "py_slow_repeat"
backend: "python"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [ { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_INT32 dims: [ -1 ] },
         { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] } ]
"""

DLPACK_MODEL = """
import numpy as np
import torch
import torch.utils.dlpack as tdl
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            given = pb_utils.get_input_tensor_by_name(request, "X")
            x = tdl.from_dlpack(given.to_dlpack())  # a view of the shared memory
            shared = x.data_ptr() == given.as_numpy().ctypes.data
            y = torch.softmax(x, dim=-1)
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor.from_dlpack("Y", tdl.to_dlpack(y)),
                pb_utils.Tensor.from_dlpack("SHARED", torch.tensor([shared])),
            ]))
        return responses
"""

DLPACK_CONFIG = """
name: "py_torch_dlpack"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1, -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1, -1 ] },
         { name: "SHARED" data_type: TYPE_BOOL dims: [ 1 ] } ]
"""

PARAMS_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = json.loads(args["model_config"]).get(
            "model_transaction_policy", {}).get("decoupled", False)

    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "X").as_numpy()
            target = pb_utils.get_input_tensor_by_name(r, "TARGET")
            if target is not None:  # BLS: relay the callee's parameters, add our own
                name = target.as_numpy()[0].decode()
                reply = pb_utils.InferenceRequest(
                    model_name=name, requested_output_names=["Y"],
                    inputs=[pb_utils.Tensor("X", x)]).exec()
                params = json.loads(reply.parameters())
                params["via"] = "bls"
                y = pb_utils.get_output_tensor_by_name(reply, "Y").as_numpy()
                out.append(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("Y", y)], parameters=params))
                continue
            if self.decoupled:
                sender = r.get_response_sender()
                for i in range(2):
                    sender.send(pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor("Y", x + i)], parameters={"index": i}))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            out.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor("Y", x + 1)],
                parameters={"count": int(x.size), "label": "ok", "exact": True, "scale": 0.5}))
        return None if self.decoupled else out
"""

PARAMS_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X" data_type: TYPE_FP32 dims: [ -1 ] }},
        {{ name: "TARGET" data_type: TYPE_STRING dims: [ 1 ] optional: true }} ]
output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ -1 ] }} ]
{policy}
"""

CONTROL_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

TRIPLE = ("import triton_python_backend_utils as pb_utils\\n"
          "class TritonPythonModel:\\n"
          "    def execute(self, requests):\\n"
          "        return [pb_utils.InferenceResponse([pb_utils.Tensor('Y', 3 * "
          "pb_utils.get_input_tensor_by_name(r, 'X').as_numpy())]) for r in requests]\\n")
CONFIG = {"backend": "python", "max_batch_size": 0,
          "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],
          "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}]}

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            action = pb_utils.get_input_tensor_by_name(r, "ACTION").as_numpy()[0].decode()
            name = pb_utils.get_input_tensor_by_name(r, "NAME").as_numpy()[0].decode()
            try:
                if action == "load":
                    pb_utils.load_model(name)
                elif action == "load_files":
                    pb_utils.load_model(name, config=json.dumps(CONFIG),
                                        files={"file:1/model.py": TRIPLE.encode()})
                elif action == "unload":
                    pb_utils.unload_model(name)
                elif action == "unload_dependents":
                    pb_utils.unload_model(name, unload_dependents=True)
                ready = np.array([pb_utils.is_model_ready(name)])
                out.append(pb_utils.InferenceResponse([pb_utils.Tensor("READY", ready)]))
            except pb_utils.TritonModelException as exc:
                out.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return out
"""

CONTROL_CONFIG = """
name: "py_control"
backend: "python"
max_batch_size: 0
input [ { name: "ACTION" data_type: TYPE_STRING dims: [ 1 ] },
        { name: "NAME" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "READY" data_type: TYPE_BOOL dims: [ 1 ] } ]
"""

SEQ_MODEL = """
import json
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.decoupled = json.loads(args["model_config"]).get(
            "model_transaction_policy", {}).get("decoupled", False)
        self.totals = {}

    def execute(self, requests):
        out = []
        for r in requests:
            given = pb_utils.get_input_tensor_by_name(r, "INPUT").as_numpy()
            start = int(pb_utils.get_input_tensor_by_name(r, "START").as_numpy().reshape(-1)[0])
            corrid = int(pb_utils.get_input_tensor_by_name(r, "CORRID").as_numpy().reshape(-1)[0])
            x = int(given.reshape(-1)[0])
            total = x if start else self.totals.get(corrid, 0) + x
            self.totals[corrid] = total
            tensors = [pb_utils.Tensor("OUTPUT", np.array([[total]], np.int32)),
                       pb_utils.Tensor("REQUESTS", np.array([[len(requests)]], np.int32)),
                       pb_utils.Tensor("ROWS", np.array([[given.shape[0]]], np.int32))]
            if self.decoupled:
                sender = r.get_response_sender()
                sender.send(pb_utils.InferenceResponse(tensors))
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor(
                    "OUTPUT", np.array([[total * 10]], np.int32))] + tensors[1:]),
                    flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                out.append(pb_utils.InferenceResponse(tensors))
        return None if self.decoupled else out
"""

SEQ_CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 2
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "REQUESTS" data_type: TYPE_INT32 dims: [ 1 ] }},
         {{ name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
sequence_batching {{
  direct {{ max_queue_delay_microseconds: {delay} minimum_slot_utilization: {fill} }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }},
    {{ name: "CORRID" control [ {{ kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 }} ] }}
  ]
}}
{policy}
"""

LOADED = ["mlp", "python_preprocess", "repeat_int32", "py_faults", "py_bls", "py_auto",
          "py_until_cancelled", "py_unary_until_cancelled", "simple_sequence_state",
          "py_bls_fields", "py_slow_queue", "py_bls_stream", "py_bls_relay",
          "py_slow_repeat", "py_torch_dlpack", "py_params", "py_params_callee",
          "py_params_stream", "py_control", "py_seq", "py_seq_stream"]  # fmt: skip


def _python_model(repo: Path, name: str, source: str, config: str | None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
    if config is not None:
        (repo / name / "config.pbtxt").write_text(textwrap.dedent(config))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("pyrepo") / "models"
    build_example_repository(
        repo, ["mlp", "python_preprocess", "repeat_int32", "simple_sequence_state", "simple"]
    )  # `simple` is not loaded: py_control loads it
    _python_model(repo, "py_faults", FAULTS_MODEL, FAULTS_CONFIG)
    _python_model(repo, "py_init_fails", INIT_FAILS_MODEL, 'backend: "python"\n')
    _python_model(repo, "py_bls", BLS_MODEL, BLS_CONFIG)
    _python_model(repo, "py_auto", AUTO_MODEL, None)
    _python_model(repo, "py_until_cancelled", UNTIL_CANCELLED_MODEL, UNTIL_CANCELLED_CONFIG)
    _python_model(
        repo, "py_unary_until_cancelled", UNARY_UNTIL_CANCELLED_MODEL, UNARY_UNTIL_CANCELLED_CONFIG
    )
    _python_model(repo, "py_bls_fields", BLS_FIELDS_MODEL, BLS_FIELDS_CONFIG)
    _python_model(repo, "py_slow_queue", SLOW_QUEUE_MODEL, SLOW_QUEUE_CONFIG)
    _python_model(repo, "py_slow_repeat", SLOW_REPEAT_MODEL, SLOW_REPEAT_CONFIG)
    _python_model(
        repo, "py_bls_stream", BLS_STREAM_MODEL,
        BLS_STREAM_CONFIG.format(name="py_bls_stream", policy=""),
    )  # fmt: skip
    _python_model(
        repo, "py_bls_relay", BLS_STREAM_MODEL,
        BLS_STREAM_CONFIG.format(
            name="py_bls_relay", policy="model_transaction_policy { decoupled: true }"),
    )  # fmt: skip
    _python_model(repo, "py_torch_dlpack", DLPACK_MODEL, DLPACK_CONFIG)
    _python_model(repo, "py_control", CONTROL_MODEL, CONTROL_CONFIG)
    # a batch waits (up to 10 s) until both slots are filled: the test sends in pairs
    seq_config = SEQ_CONFIG.format(name="py_seq", delay=10_000_000, fill=1.0, policy="")
    _python_model(repo, "py_seq", SEQ_MODEL, seq_config)
    _python_model(
        repo, "py_seq_stream", SEQ_MODEL,
        SEQ_CONFIG.format(name="py_seq_stream", delay=0, fill=0.0,
                          policy="model_transaction_policy { decoupled: true }"),
    )  # fmt: skip
    for name in ("py_params", "py_params_callee"):
        _python_model(repo, name, PARAMS_MODEL, PARAMS_CONFIG.format(name=name, policy=""))
    _python_model(
        repo, "py_params_stream", PARAMS_MODEL,
        PARAMS_CONFIG.format(
            name="py_params_stream", policy="model_transaction_policy { decoupled: true }"),
    )  # fmt: skip
    args = ["--model-control-mode", "explicit"]
    for name in LOADED:
        args += ["--load-model", name]
    proc = KilnProcess(repo, args).start()
    yield proc
    proc.stop()


@pytest.fixture
def http(server: KilnProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url)


@pytest.fixture
def grpc(server: KilnProcess) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    yield client
    client.close()


def _faults_inputs(action: str, x: np.ndarray) -> list[httpclient.InferInput]:
    a = httpclient.InferInput("ACTION", [1], "BYTES")
    a.set_data_from_numpy(np.array([action.encode()], dtype=object))
    i = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return [a, i]


def _pid(http: httpclient.InferenceServerClient) -> int:
    x = np.arange(3, dtype=np.float32)
    result = http.infer("py_faults", _faults_inputs("ok", x))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT"), x * 2)
    return int(result.as_numpy("PID")[0])


# ---- plain inference ---------------------------------------------------------------------


def test_python_preprocess_http_and_grpc(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    images = np.random.default_rng(3).integers(0, 256, (3, 28, 28, 1), dtype=np.uint8)
    want = reference_outputs("python_preprocess", {"IMAGE": images})["NORMALIZED"]
    hi = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
    hi.set_data_from_numpy(images, binary_data=True)
    np.testing.assert_allclose(http.infer("python_preprocess", [hi]).as_numpy("NORMALIZED"), want)
    gi = grpcclient.InferInput("IMAGE", list(images.shape), "UINT8")
    gi.set_data_from_numpy(images)
    got = grpc.infer("python_preprocess", [gi]).as_numpy("NORMALIZED")
    np.testing.assert_allclose(got, want)


def test_a_torch_model_passes_tensors_through_dlpack(
    http: httpclient.InferenceServerClient,
) -> None:
    """Triton's to_dlpack / from_dlpack: the model reads its input as a torch tensor that
    views the shared memory, and returns torch tensors."""
    x = np.random.default_rng(5).normal(size=(3, 4)).astype(np.float32)
    given = httpclient.InferInput("X", list(x.shape), "FP32")
    given.set_data_from_numpy(x)
    result = http.infer("py_torch_dlpack", [given])
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(result.as_numpy("Y"), e / e.sum(axis=1, keepdims=True), rtol=1e-6)
    assert result.as_numpy("SHARED").tolist() == [True]


def _params_inputs(module: Any, target: str | None = None) -> list[Any]:
    x = module.InferInput("X", [3], "FP32")
    x.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    if target is None:
        return [x]
    t = module.InferInput("TARGET", [1], "BYTES")
    t.set_data_from_numpy(np.array([target.encode()], dtype=object))
    return [x, t]


PARAMS = {"count": 3, "label": "ok", "exact": True, "scale": 0.5}


def test_response_parameters_reach_http_and_grpc_clients(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    """A Python model's InferenceResponse(parameters=...) is the response's parameters on
    the wire, with each value's type (bool, int, float, str)."""
    result = http.infer("py_params", _params_inputs(httpclient))
    assert result.as_numpy("Y").tolist() == [2, 3, 4]
    assert result.get_response()["parameters"] == PARAMS
    got = grpc.infer("py_params", _params_inputs(grpcclient)).get_response().parameters
    assert got["count"].int64_param == 3 and got["label"].string_param == "ok"
    assert got["exact"].bool_param is True and got["scale"].double_param == 0.5


def test_a_bls_caller_reads_the_callee_s_response_parameters(
    http: httpclient.InferenceServerClient,
) -> None:
    result = http.infer("py_params", _params_inputs(httpclient, target="py_params_callee"))
    assert result.as_numpy("Y").tolist() == [2, 3, 4]
    assert result.get_response()["parameters"] == {**PARAMS, "via": "bls"}


def test_decoupled_responses_carry_their_own_parameters(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    grpc.async_stream_infer(
        "py_params_stream", _params_inputs(grpcclient), enable_empty_final_response=True
    )
    seen = []
    while True:
        result, error = results.get(timeout=30)
        assert error is None, error
        params = result.get_response().parameters
        if params["triton_final_response"].bool_param:
            assert "index" not in params  # the FINAL flag came alone
            break
        seen.append((params["index"].int64_param, result.as_numpy("Y").tolist()))
    grpc.stop_stream()
    assert seen == [(0, [1, 2, 3]), (1, [2, 3, 4])]


def _control(http: httpclient.InferenceServerClient, action: str, name: str) -> bool:
    inputs = []
    for key, value in (("ACTION", action), ("NAME", name)):
        tensor = httpclient.InferInput(key, [1], "BYTES")
        tensor.set_data_from_numpy(np.array([value.encode()], dtype=object))
        inputs.append(tensor)
    return bool(http.infer("py_control", inputs).as_numpy("READY")[0])


def test_a_python_model_loads_and_unloads_models(http: httpclient.InferenceServerClient) -> None:
    """Triton's model loading API from a model (explicit mode): pb_utils.load_model,
    unload_model and is_model_ready act on the server that runs the model."""
    assert _control(http, "ready", "simple") is False
    assert _control(http, "load", "simple") is True
    assert http.is_model_ready("simple")
    a = httpclient.InferInput("INPUT0", [1, 16], "INT32")
    a.set_data_from_numpy(np.ones((1, 16), np.int32))
    b = httpclient.InferInput("INPUT1", [1, 16], "INT32")
    b.set_data_from_numpy(np.ones((1, 16), np.int32))
    assert http.infer("simple", [a, b]).as_numpy("OUTPUT0").tolist() == [[2] * 16]
    assert _control(http, "unload", "simple") is False
    assert not http.is_model_ready("simple")


def test_a_python_model_loads_a_model_from_files_it_supplies(
    http: httpclient.InferenceServerClient,
) -> None:
    assert _control(http, "load_files", "py_from_files") is True
    x = httpclient.InferInput("X", [2], "FP32")
    x.set_data_from_numpy(np.array([1, 2], np.float32))
    assert http.infer("py_from_files", [x]).as_numpy("Y").tolist() == [3, 6]
    assert _control(http, "unload", "py_from_files") is False


@pytest.mark.parametrize(
    ("action", "name", "says"),
    [
        ("load", "no_such_model", "no_such_model"),
        ("unload", "py_control", "cannot unload itself"),
        ("unload_dependents", "py_control", "cannot unload itself"),
    ],
)
def test_model_control_from_a_model_fails_with_the_reason(
    http: httpclient.InferenceServerClient, action: str, name: str, says: str
) -> None:
    with pytest.raises(InferenceServerException, match=says):
        _control(http, action, name)
    assert _control(http, "ready", "py_control") is True  # the caller still serves
    assert http.is_model_ready("mlp")


def _seq_input(module: Any, value: int) -> list[Any]:
    tensor = module.InferInput("INPUT", [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], np.int32))
    return [tensor]


def test_a_sequence_batch_reaches_a_python_model_as_separate_requests(
    server: KilnProcess,
) -> None:
    """As on Triton, the sequence batcher hands a Python model each request of a batch on
    its own (its own control values, batch dimension 1), not one merged tensor: two
    sequences step together, each batch holds one request of each."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=2)
    totals: list[list[int]] = [[], []]
    for n, (start, end) in enumerate([(True, False), (False, False), (False, True)]):
        running = [
            client.async_infer(
                "py_seq", _seq_input(httpclient, (n + 1) * (i + 1)), sequence_id=100 + i,
                sequence_start=start, sequence_end=end)
            for i in (0, 1)
        ]  # fmt: skip
        for i, pending in enumerate(running):
            result = pending.get_result(timeout=60)
            assert result.as_numpy("REQUESTS").tolist() == [[2]]  # both in one execute
            assert result.as_numpy("ROWS").tolist() == [[1]]  # each its own request
            totals[i].append(int(result.as_numpy("OUTPUT")[0, 0]))
    client.close()
    assert totals == [[1, 3, 6], [2, 6, 12]]  # each sequence kept its own running total


def test_a_decoupled_python_model_streams_under_the_sequence_batcher(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    got = []
    for value, start, end in ((2, True, False), (5, False, True)):
        grpc.async_stream_infer(
            "py_seq_stream", _seq_input(grpcclient, value), sequence_id=7,
            sequence_start=start, sequence_end=end)  # fmt: skip
        for _ in range(2):
            result, error = results.get(timeout=30)
            assert error is None, error
            got.append(int(result.as_numpy("OUTPUT")[0, 0]))
    grpc.stop_stream()
    assert got == [2, 20, 7, 70]


def test_concurrent_requests_each_get_their_own_answer(server: KilnProcess) -> None:
    # The dynamic batcher hands the model lists of requests: each must come back alone.
    rng = np.random.default_rng(5)
    batches = [rng.integers(0, 256, (1 + i % 3, 28, 28, 1), dtype=np.uint8) for i in range(8)]
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    pending = []
    for images in batches:
        tensor = httpclient.InferInput("IMAGE", list(images.shape), "UINT8")
        tensor.set_data_from_numpy(images)
        pending.append(client.async_infer("python_preprocess", [tensor]))
    for images, request in zip(batches, pending, strict=True):
        want = reference_outputs("python_preprocess", {"IMAGE": images})["NORMALIZED"]
        np.testing.assert_allclose(request.get_result().as_numpy("NORMALIZED"), want)
    client.close()


def test_large_tensor_grows_the_arena(http: httpclient.InferenceServerClient) -> None:
    x = np.random.default_rng(1).standard_normal(1_500_000).astype(np.float32)  # 6 MB
    result = http.infer("py_faults", _faults_inputs("ok", x))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT"), x * 2)


def test_auto_complete_config_filled_the_config(http: httpclient.InferenceServerClient) -> None:
    config = http.get_model_config("py_auto")
    assert config["max_batch_size"] == 4
    assert [i["name"] for i in config["input"]] == ["X"]
    x = httpclient.InferInput("X", [2, 2], "INT32")
    x.set_data_from_numpy(np.array([[1, 2], [3, 4]], np.int32))
    np.testing.assert_array_equal(http.infer("py_auto", [x]).as_numpy("Y"), [[2, 3], [4, 5]])


# ---- BLS -----------------------------------------------------------------------------------


def _bls_inputs(target: str, x: np.ndarray) -> list[httpclient.InferInput]:
    i = httpclient.InferInput("INPUT", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    t = httpclient.InferInput("TARGET", [x.shape[0], 1], "BYTES")
    t.set_data_from_numpy(np.array([[target.encode()]] * x.shape[0], dtype=object))
    return [i, t]


def test_bls_calls_mlp(http: httpclient.InferenceServerClient) -> None:
    x = np.random.default_rng(2).integers(0, 17, (2, 64)).astype(np.float32)
    got = http.infer("py_bls", _bls_inputs("mlp", x)).as_numpy("LOGITS")
    np.testing.assert_allclose(got, reference_outputs("mlp", {"INPUT": x})["LOGITS"], rtol=1e-4)


def test_concurrent_bls_calls_each_get_their_own_answer(server: KilnProcess) -> None:
    """py_bls runs one request per execute: the next request is in the worker's pipe while
    the current one waits for its BLS answers, and must not be taken for one of them."""
    rng = np.random.default_rng(4)
    xs = [rng.integers(0, 17, (1 + i % 2, 64)).astype(np.float32) for i in range(12)]
    client = httpclient.InferenceServerClient(server.http_url, concurrency=6)
    pending = [client.async_infer("py_bls", _bls_inputs("mlp", x)) for x in xs]
    for x, request in zip(xs, pending, strict=True):
        want = reference_outputs("mlp", {"INPUT": x})["LOGITS"]
        np.testing.assert_allclose(request.get_result().as_numpy("LOGITS"), want, rtol=1e-4)
    client.close()


def test_bls_error_comes_back_in_the_response(http: httpclient.InferenceServerClient) -> None:
    x = np.zeros((1, 64), np.float32)
    with pytest.raises(InferenceServerException, match=r"BLS failed: .*nope") as info:
        http.infer("py_bls", _bls_inputs("nope", x))
    assert info.value.status() == "500"


def _mode(mode: str) -> list[httpclient.InferInput]:
    tensor = httpclient.InferInput("MODE", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([mode.encode()], dtype=object))
    return [tensor]


def test_bls_carries_correlation_id_and_sequence_flags(
    http: httpclient.InferenceServerClient,
) -> None:
    """Three BLS calls with one ``correlation_id`` and START / END ``flags`` are one
    sequence of the stateful accumulator: running totals 1, 3, 6."""
    result = http.infer("py_bls_fields", _mode("sequence"))
    assert result.as_numpy("TOTALS").tolist() == [1, 3, 6]


def test_bls_timeout_applies_in_the_callee_s_queue(http: httpclient.InferenceServerClient) -> None:
    """``InferenceRequest(timeout=100000)`` (µs) overrides the callee's queue timeout (its
    policy allows it): the call fails as Triton's does instead of waiting out the 30 s
    batching delay."""
    with pytest.raises(InferenceServerException, match="BLS failed: Request timeout expired"):
        http.infer("py_bls_fields", _mode("timeout"))


def _stream_inputs(module: Any, values: list[int], target: str) -> list[Any]:
    tensors = [module.InferInput("IN", [len(values)], "INT32"),
               module.InferInput("TARGET", [1], "BYTES")]  # fmt: skip
    tensors[0].set_data_from_numpy(np.array(values, np.int32))
    tensors[1].set_data_from_numpy(np.array([target.encode()], dtype=object))
    return tensors


def test_bls_to_a_decoupled_model_iterates_its_responses(
    http: httpclient.InferenceServerClient,
) -> None:
    """``exec(decoupled=True)``: every response of repeat_int32, in order, then the empty
    final response that carries the FINAL flag."""
    for values in ([5, 6, 7], []):
        result = http.infer("py_bls_stream", _stream_inputs(httpclient, values, "repeat_int32"))
        assert result.as_numpy("OUT").tolist() == [*values, 1]
    # an unknown model: the error comes back as the stream's only (final) response
    bad = _stream_inputs(httpclient, [1], "nope")
    with pytest.raises(InferenceServerException, match=r"BLS failed: .*nope"):
        http.infer("py_bls_stream", bad)


def test_a_bls_stream_left_unread_ends_with_its_batch(
    http: httpclient.InferenceServerClient,
) -> None:
    """The model reads one of five responses (of a callee that takes its time): the rest
    are read and dropped before its batch ends. Their tensors go into the batch's arena, so
    they must not land in the next batches'."""
    first = http.infer(
        "py_bls_stream", _stream_inputs(httpclient, [9, 8, 7, 6, 5], "py_slow_repeat")
    )
    assert first.as_numpy("OUT")[:3].tolist() == [9, 9, 9]
    for values in ([1, 2], [3, 4, 5]):
        after = http.infer("py_bls_stream", _stream_inputs(httpclient, values, "repeat_int32"))
        assert after.as_numpy("OUT").tolist() == [*values, 1]


def test_a_decoupled_model_relays_a_bls_stream_over_grpc(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    grpc.async_stream_infer(
        "py_bls_relay", _stream_inputs(grpcclient, [1, 2, 3], "repeat_int32"), request_id="r"
    )
    got = []
    for _ in range(3):
        result, error = results.get(timeout=30)
        assert error is None, error
        got.append(result.as_numpy("OUT").tolist())
    grpc.stop_stream()
    assert got == [[2], [4], [6]]


# ---- decoupled ------------------------------------------------------------------------------


def test_decoupled_grpc_stream(grpc: grpcclient.InferenceServerClient) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    sent = {"a": [3, 1, 4], "b": [], "c": [7]}
    for request_id, values in sent.items():
        tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
        tensor.set_data_from_numpy(np.array(values, np.int32))
        grpc.async_stream_infer(
            "repeat_int32", [tensor], request_id=request_id, enable_empty_final_response=True
        )
    got: dict[str, list[dict[str, np.ndarray]]] = {k: [] for k in sent}
    open_ids = set(sent)
    while open_ids:
        result, error = results.get(timeout=30)
        assert error is None, error
        response = result.get_response()
        params = response.parameters
        if params["triton_final_response"].bool_param:
            assert not response.outputs  # the empty final response closes the request
            open_ids.remove(response.id)
            continue
        got[response.id].append({n: result.as_numpy(n) for n in ("OUT", "IDX")})
    grpc.stop_stream()
    for request_id, values in sent.items():
        want = reference_responses("repeat_int32", {"IN": np.array(values, np.int32)})
        assert len(got[request_id]) == len(want)
        for g, w in zip(got[request_id], want, strict=True):
            np.testing.assert_array_equal(g["OUT"], w["OUT"])
            np.testing.assert_array_equal(g["IDX"], w["IDX"])


def test_decoupled_stream_error_keeps_the_stream_open(
    grpc: grpcclient.InferenceServerClient,
) -> None:
    results: queue.Queue[Any] = queue.Queue()
    grpc.start_stream(callback=lambda result, error: results.put((result, error)))
    bad = grpcclient.InferInput("IN", [2], "FP32")
    bad.set_data_from_numpy(np.zeros(2, np.float32))
    grpc.async_stream_infer("repeat_int32", [bad], request_id="bad")
    _, error = results.get(timeout=30)
    assert error is not None and "IN" in str(error) and "FP32" in str(error)
    good = grpcclient.InferInput("IN", [1], "INT32")
    good.set_data_from_numpy(np.array([9], np.int32))
    grpc.async_stream_infer("repeat_int32", [good], request_id="good")
    result, error = results.get(timeout=30)
    grpc.stop_stream()
    assert error is None and result.as_numpy("OUT").tolist() == [9]


def test_decoupled_http_generate_stream(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/repeat_int32/generate_stream"
    with requests.post(url, json={"IN": [5, 6, 7]}, stream=True, timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [
            json.loads(line[len("data: ") :])
            for line in resp.iter_lines(decode_unicode=True)
            if line.startswith("data: ")
        ]
    assert [(e["OUT"], e["IDX"]) for e in events] == [(5, 0), (6, 1), (7, 2)]
    assert all(e["model_name"] == "repeat_int32" for e in events)


def test_http_generate(server: KilnProcess) -> None:
    base = f"http://{server.http_url}/v2/models/repeat_int32"
    one = requests.post(base + "/generate", json={"IN": [42]}, timeout=30)
    assert one.status_code == 200 and one.json()["OUT"] == 42
    many = requests.post(base + "/generate", json={"IN": [1, 2]}, timeout=30)
    assert many.status_code == 400 and "generate_stream" in many.json()["error"]
    unknown = requests.post(base + "/generate", json={"NOPE": 1}, timeout=30)
    assert unknown.status_code == 400 and "'NOPE' is not an input" in unknown.json()["error"]
    plain = requests.post(
        f"http://{server.http_url}/v2/models/py_auto/generate", json={"X": [1, 2]}, timeout=30
    )
    assert plain.status_code == 200 and plain.json()["Y"] == [2, 3]


def _cancelled_count(server: KilnProcess, model: str) -> float:
    """``nv_inference_request_failure{reason="CANCELED"}`` of ``model`` on /metrics."""
    text = requests.get(server.metrics_url, timeout=10).text
    pattern = (
        r'^nv_inference_request_failure\{(?=[^}]*model="' + model + r'")'
        r'(?=[^}]*reason="CANCELED")[^}]*\} (\S+)$'
    )
    found = re.search(pattern, text, re.M)
    return float(found.group(1)) if found else 0.0


def _wait_for_count(server: KilnProcess, model: str, want: float) -> None:
    deadline = time.monotonic() + 30
    while (got := _cancelled_count(server, model)) != want:
        assert time.monotonic() < deadline, f"CANCELED failures of {model}: {got}, not {want}"
        time.sleep(0.05)


def _wait_for_file(path: Path, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
    time.sleep(0.05)  # written and closed
    return path.read_text()


def test_a_cancelled_grpc_stream_is_seen_by_the_model(server: KilnProcess) -> None:
    """``stop_stream(cancel_requests=True)`` mid-stream: ``is_cancelled()`` turns true in the
    running ``execute``, which ends, and the instance serves the next request."""
    before = _cancelled_count(server, "py_until_cancelled")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    results: queue.Queue[Any] = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    tag = grpcclient.InferInput("TAG", [1], "BYTES")
    tag.set_data_from_numpy(np.array([b"grpc"], dtype=object))
    client.async_stream_infer("py_until_cancelled", [tag])
    for i in range(3):
        result, error = results.get(timeout=30)
        assert error is None, error
        assert result.as_numpy("N").tolist() == [i]
    client.stop_stream(cancel_requests=True)
    sent = int(_wait_for_file(server.repository / "py_until_cancelled" / "grpc.cancelled"))
    assert 3 <= sent < 6000
    _wait_for_count(server, "py_until_cancelled", before + 1)  # Triton's reason label
    client.close()
    # the instance is free again: a new stream gets its responses
    _assert_streams(server)


def test_a_closed_generate_stream_connection_is_seen_by_the_model(server: KilnProcess) -> None:
    before = _cancelled_count(server, "py_until_cancelled")
    url = f"http://{server.http_url}/v2/models/py_until_cancelled/generate_stream"
    with requests.post(url, json={"TAG": "sse"}, stream=True, timeout=30) as resp:
        assert resp.status_code == 200
        events: list[dict[str, Any]] = []
        for line in resp.iter_lines(decode_unicode=True):
            if line.startswith("data: "):
                events.append(json.loads(line[len("data: ") :]))
            if len(events) == 3:
                break
    # leaving the block closed the connection mid-stream
    assert [e["N"] for e in events] == [0, 1, 2]
    sent = int(_wait_for_file(server.repository / "py_until_cancelled" / "sse.cancelled"))
    assert 3 <= sent < 6000
    _wait_for_count(server, "py_until_cancelled", before + 1)
    _assert_streams(server)


def test_a_cancelled_grpc_infer_is_seen_by_the_model(server: KilnProcess) -> None:
    """tritonclient's asyncio client cancels a unary ``ModelInfer`` (the task is cancelled,
    so the call is): ``request.is_cancelled()`` turns true in the running ``execute``."""
    folder = server.repository / "py_unary_until_cancelled"
    before = _cancelled_count(server, "py_unary_until_cancelled")

    async def cancel_one() -> None:
        async with grpcaio.InferenceServerClient(server.grpc_url) as client:
            x = grpcaio.InferInput("X", [1], "INT32")
            x.set_data_from_numpy(np.array([7], np.int32))
            call = asyncio.create_task(client.infer("py_unary_until_cancelled", [x]))
            deadline = time.monotonic() + 30
            while not (folder / "started.7").exists():
                assert time.monotonic() < deadline, "execute never started"
                await asyncio.sleep(0.02)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call

    asyncio.run(cancel_one())
    sent = int(_wait_for_file(folder / "cancelled.7"))
    assert 0 <= sent < 6000
    _wait_for_count(server, "py_unary_until_cancelled", before + 1)


@pytest.mark.parametrize(
    ("route", "chunked", "x"),
    [
        ("infer", False, 8),
        ("infer", True, 9),
        ("generate", False, 10),
        ("generate_stream", False, 11),
    ],
    ids=["infer", "infer-chunked", "generate", "generate_stream"],
)
def test_an_http_client_that_leaves_cancels_its_request(
    server: KilnProcess, route: str, chunked: bool, x: int
) -> None:
    """Over HTTP too (Triton cancels only gRPC calls): a client whose connection closes
    while ``execute`` runs has its request turn ``is_cancelled()``; on the fast path
    (``infer``), the ASGI one (a chunked body), ``generate`` and ``generate_stream`` (before
    its first response)."""
    folder = server.repository / "py_unary_until_cancelled"
    before = _cancelled_count(server, "py_unary_until_cancelled")
    if route == "infer":
        tensor = {"name": "X", "shape": [1], "datatype": "INT32", "data": [x]}
        body = json.dumps({"inputs": [tensor]}).encode()
    else:
        body = json.dumps({"X": [x]}).encode()
    host, port = server.http_url.rsplit(":", 1)
    head = f"POST /v2/models/py_unary_until_cancelled/{route} HTTP/1.1\r\nHost: {host}\r\n"
    if chunked:
        raw = f"{head}Transfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n".encode()
        raw += body + b"\r\n0\r\n\r\n"
    else:
        raw = f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(raw)
        _wait_for_file(folder / f"started.{x}")
    sent = int(_wait_for_file(folder / f"cancelled.{x}"))
    assert 0 <= sent < 6000
    _wait_for_count(server, "py_unary_until_cancelled", before + 1)


def _assert_streams(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/repeat_int32/generate_stream"
    with requests.post(url, json={"IN": [5, 6]}, stream=True, timeout=30) as resp:
        events = [line for line in resp.iter_lines(decode_unicode=True) if line]
    assert len(events) == 2


def test_infer_on_a_decoupled_model_is_refused(
    http: httpclient.InferenceServerClient, grpc: grpcclient.InferenceServerClient
) -> None:
    tensor = httpclient.InferInput("IN", [1], "INT32")
    tensor.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException, match="decoupled transaction policy"):
        http.infer("repeat_int32", [tensor])
    gtensor = grpcclient.InferInput("IN", [1], "INT32")
    gtensor.set_data_from_numpy(np.array([1], np.int32))
    with pytest.raises(InferenceServerException, match="decoupled transaction policy"):
        grpc.infer("repeat_int32", [gtensor])


# ---- faults ----------------------------------------------------------------------------------


def test_initialize_failure_reason_in_the_index(http: httpclient.InferenceServerClient) -> None:
    with pytest.raises(InferenceServerException, match="RuntimeError: cannot open weights file"):
        http.load_model("py_init_fails")
    (row,) = [r for r in http.get_model_repository_index() if r["name"] == "py_init_fails"]
    assert row["state"] == "UNAVAILABLE"
    assert row["reason"].endswith("RuntimeError: cannot open weights file missing.bin")
    assert http.is_model_ready("python_preprocess")  # the others keep serving


def test_execute_raises_batch_fails_worker_lives(http: httpclient.InferenceServerClient) -> None:
    pid = _pid(http)
    with pytest.raises(InferenceServerException, match="py_faults") as info:
        http.infer("py_faults", _faults_inputs("raise", np.zeros(1, np.float32)))
    assert "ValueError: boom from execute" in str(info.value)
    assert info.value.status() == "500"
    assert _pid(http) == pid


@pytest.mark.parametrize(
    ("action", "message"),
    [
        ("wrong_count", "returned 0 responses for 1 requests"),
        ("wrong_dtype", "'OUTPUT' as float64.*TYPE_FP32"),
        ("missing", "did not produce output 'OUTPUT'"),
    ],
)
def test_bad_responses_name_model_and_output(
    http: httpclient.InferenceServerClient, action: str, message: str
) -> None:
    with pytest.raises(InferenceServerException, match=f"py_faults.*{message}"):
        http.infer("py_faults", _faults_inputs(action, np.ones(2, np.float32)))
    _pid(http)  # and the model keeps serving


def test_sigkill_mid_request_fails_it_and_restarts(
    server: KilnProcess, http: httpclient.InferenceServerClient
) -> None:
    pid = _pid(http)
    errors: list[BaseException] = []

    def slow() -> None:
        try:
            http_slow = httpclient.InferenceServerClient(server.http_url)
            http_slow.infer("py_faults", _faults_inputs("sleep", np.ones(1, np.float32)))
        except InferenceServerException as exc:
            errors.append(exc)

    thread = threading.Thread(target=slow)
    thread.start()
    threading.Event().wait(0.5)  # let the request reach the worker (either way it must fail)
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert len(errors) == 1 and "py_faults" in str(errors[0])
    assert _pid(http) != pid  # a new, re-initialized worker answers


def test_a_request_queued_behind_a_killed_one_is_answered_by_the_new_worker(
    server: KilnProcess, http: httpclient.InferenceServerClient
) -> None:
    """py_faults has no batching: the second request waits in the worker's pipe behind
    the sleeping one. It never started, so the worker's death must not fail it."""
    pid = _pid(http)
    results: dict[str, Any] = {}

    def call(name: str, action: str, x: np.ndarray) -> None:
        try:
            client = httpclient.InferenceServerClient(server.http_url)
            results[name] = client.infer("py_faults", _faults_inputs(action, x))
        except InferenceServerException as exc:
            results[name] = exc

    x = np.array([1.5, -2.0], np.float32)
    slow = threading.Thread(target=call, args=("slow", "sleep", np.ones(1, np.float32)))
    slow.start()
    threading.Event().wait(0.5)  # the first request is inside execute
    queued = threading.Thread(target=call, args=("queued", "ok", x))
    queued.start()
    threading.Event().wait(0.5)  # the second is in the pipe behind it
    os.kill(pid, signal.SIGKILL)
    slow.join(30)
    queued.join(30)
    assert isinstance(results["slow"], InferenceServerException)
    assert "py_faults" in str(results["slow"])
    answer = results["queued"]
    assert not isinstance(answer, InferenceServerException), answer
    np.testing.assert_array_equal(answer.as_numpy("OUTPUT"), x * 2)
    assert int(answer.as_numpy("PID")[0]) != pid


def test_concurrent_unbatched_requests_keep_their_own_tensors(server: KilnProcess) -> None:
    """Without batching, consecutive requests are in the worker's pipe together, each with
    its own pair of arenas: every answer must be its own input doubled."""
    client = httpclient.InferenceServerClient(server.http_url, concurrency=8)
    inputs = [np.full(1000 + 37 * i, i, np.float32) for i in range(24)]
    pending = [client.async_infer("py_faults", _faults_inputs("ok", x)) for x in inputs]
    for x, request in zip(inputs, pending, strict=True):
        np.testing.assert_array_equal(request.get_result().as_numpy("OUTPUT"), x * 2)
    client.close()


def test_hang_hits_execute_timeout_and_restarts(http: httpclient.InferenceServerClient) -> None:
    pid = _pid(http)
    with pytest.raises(InferenceServerException, match="execute_timeout_secs=3") as info:
        http.infer("py_faults", _faults_inputs("sleep", np.ones(1, np.float32)))
    assert "py_faults" in str(info.value)
    assert _pid(http) != pid
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the hung worker is gone


def test_unload_finalizes_and_stops_workers(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    pid = _pid(client)
    client.unload_model("py_faults")
    wait = partial(threading.Event().wait, 0.1)
    for _ in range(100):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        wait()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    client.load_model("py_faults")
    _pid(client)
