"""An ensemble with a decoupled step, as LLM pipelines are built on Triton (tokenizer ->
streaming generator -> detokenizer), behind a real ``kiln serve``: each response of the
decoupled step runs through the steps after it and reaches the client as its own response,
over the gRPC stream and HTTP generate_stream; errors and misuse answer clearly."""

from __future__ import annotations

import json
import queue
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess

TOKENIZE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            text = pb_utils.get_input_tensor_by_name(r, "TEXT").as_numpy()[0]
            ids = np.frombuffer(text, dtype=np.uint8).astype(np.int32)
            out.append(pb_utils.InferenceResponse([
                pb_utils.Tensor("IDS", ids),
                pb_utils.Tensor("LEN", np.array([len(ids)], np.int32)),
            ]))
        return out
"""

GENERATE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for token in pb_utils.get_input_tensor_by_name(r, "IDS").as_numpy():
                tensor = pb_utils.Tensor("TOKEN", np.array([token + 1], np.int32))
                sender.send(pb_utils.InferenceResponse([tensor]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

DETOKENIZE = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            token = int(pb_utils.get_input_tensor_by_name(r, "TOKEN").as_numpy()[0])
            if token == ord("!"):
                raise ValueError(f"detokenize cannot take token {token}")
            out.append(pb_utils.InferenceResponse(
                [pb_utils.Tensor("PIECE", np.array([chr(token).encode()], dtype=object))]))
        return out
"""

SLOW_GENERATE = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.marker = os.path.join(args["model_repository"], "..", "slowgen.log")

    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for n in range(1000):
                if sender.is_cancelled():
                    with open(self.marker, "w") as f:
                        f.write(f"cancelled after {n}")
                    break
                tensor = pb_utils.Tensor("TOKEN", np.array([ord("a")], np.int32))
                sender.send(pb_utils.InferenceResponse([tensor]))
                time.sleep(0.02)
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# Triton's vLLM backend's shape: execute hands each request to a thread and returns, so one
# instance generates for several requests at once. Each waits (10 s at most) until three
# generate together; a token made without that company comes out as "?".
THREAD_GENERATE = """
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.lock = threading.Lock()
        self.running = self.peak = 0

    def execute(self, requests):
        for r in requests:
            threading.Thread(target=self.generate, args=(r,), daemon=True).start()
        return None

    def generate(self, r):
        ids = pb_utils.get_input_tensor_by_name(r, "IDS").as_numpy()
        sender = r.get_response_sender()
        with self.lock:
            self.running += 1
            self.peak = max(self.peak, self.running)
        for _ in range(1000):
            if self.peak >= 3:
                break
            time.sleep(0.01)
        together = self.peak >= 3
        for token in ids:
            value = token + 1 if together else ord("?")
            tensor = pb_utils.Tensor("TOKEN", np.array([value], np.int32))
            sender.send(pb_utils.InferenceResponse([tensor]))
        with self.lock:
            self.running -= 1
            if not self.running:
                self.peak = 0
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

MODELS = {
    "tok": (
        TOKENIZE,
        """
        input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [ { name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] },
                 { name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] } ]""",
    ),
    "gen": (
        GENERATE,
        """
        input [ { name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        model_transaction_policy { decoupled: true }""",
    ),
    "slowgen": (
        SLOW_GENERATE,
        """
        input [ { name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        model_transaction_policy { decoupled: true }""",
    ),
    "threadgen": (
        THREAD_GENERATE,
        """
        input [ { name: "IDS" data_type: TYPE_INT32 dims: [ -1 ] } ]
        output [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        instance_group [ { count: 1 kind: KIND_CPU } ]
        model_transaction_policy { decoupled: true }""",
    ),
    "detok": (
        DETOKENIZE,
        """
        input [ { name: "TOKEN" data_type: TYPE_INT32 dims: [ 1 ] } ]
        output [ { name: "PIECE" data_type: TYPE_STRING dims: [ 1 ] } ]""",
    ),
}

PIPELINE = """
name: "{name}"
platform: "ensemble"
max_batch_size: 0
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "PIECE" data_type: TYPE_STRING dims: [ 1 ] }},
         {{ name: "LEN" data_type: TYPE_INT32 dims: [ 1 ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "tok" input_map {{ key: "TEXT" value: "TEXT" }}
     output_map {{ key: "IDS" value: "ids" }} output_map {{ key: "LEN" value: "LEN" }} }},
  {{ model_name: "{generator}" input_map {{ key: "IDS" value: "ids" }}
     output_map {{ key: "TOKEN" value: "token" }} }},
  {{ model_name: "detok" input_map {{ key: "TOKEN" value: "token" }}
     output_map {{ key: "PIECE" value: "PIECE" }} }}
  {extra}
] }}
"""

# two decoupled steps side by side: each response of one would run the other again
PARALLEL_EXTRA = """,
  {{ model_name: "gen" input_map {{ key: "IDS" value: "ids" }}
     output_map {{ key: "TOKEN" value: "other_token" }} }}"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("decoupled_ensemble") / "models"
    for name, (source, io) in MODELS.items():
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text(textwrap.dedent(source))
        config = f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n' + textwrap.dedent(io)
        (repo / name / "config.pbtxt").write_text(config)
    for name, generator, extra in (
        ("pipeline", "gen", ""),
        ("parallel", "gen", PARALLEL_EXTRA.format()),
        ("slow_pipeline", "slowgen", ""),
        ("thread_pipeline", "threadgen", ""),
    ):
        (repo / name / "1").mkdir(parents=True)
        config = PIPELINE.format(name=name, generator=generator, extra=extra)
        (repo / name / "config.pbtxt").write_text(config)
    proc = KilnProcess(repo, ["--no-strict-readiness"]).start()  # "parallel" fails to load
    yield proc
    proc.stop()


def _text(module: Any, text: str) -> list[Any]:
    tensor = module.InferInput("TEXT", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([text.encode()], dtype=object))
    return [tensor]


def _stream(server: KilnProcess, text: str, model: str = "pipeline", **kwargs: Any) -> list[Any]:
    """Every stream message for one request, until its final one."""
    got: queue.Queue[Any] = queue.Queue()
    items = []
    with grpcclient.InferenceServerClient(server.grpc_url) as client:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer(model, _text(grpcclient, text), **kwargs)
        while True:
            item = got.get(timeout=30)
            items.append(item)
            if isinstance(item, InferenceServerException):
                break
            if item.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    return items


def test_each_generated_token_streams_through_the_steps_after_it(server: KilnProcess) -> None:
    items = _stream(server, "abc", enable_empty_final_response=True)
    *responses, final = items
    assert not any(isinstance(r, InferenceServerException) for r in items), items
    pieces = sorted(r.as_numpy("PIECE")[0].decode() for r in responses)
    assert pieces == ["b", "c", "d"]  # one response per token, each detokenized
    # a tensor made before the decoupled step reaches every branch's response
    assert all(r.as_numpy("LEN").tolist() == [3] for r in responses)
    assert final.get_response().outputs == []  # the FINAL flag, asked for, comes last


def test_generate_stream_sends_one_event_per_token(server: KilnProcess) -> None:
    url = f"http://{server.http_url}/v2/models/pipeline/generate_stream"
    with requests.post(url, json={"TEXT": "hi"}, stream=True, timeout=30) as resp:
        assert resp.status_code == 200, resp.text
        events = [
            json.loads(line[len(b"data: ") :])
            for line in resp.iter_lines()
            if line.startswith(b"data: ")
        ]
    assert sorted(e["PIECE"] for e in events) == ["i", "j"]
    assert all(e["LEN"] == 2 for e in events)


def test_nothing_generated_means_no_response(server: KilnProcess) -> None:
    (final,) = _stream(server, "", enable_empty_final_response=True)
    assert final.get_response().outputs == []


def test_a_failing_step_after_the_fork_fails_the_request_naming_it(server: KilnProcess) -> None:
    items = _stream(server, "a ")  # " " + 1 == "!": detok refuses it
    error = items[-1]
    assert isinstance(error, InferenceServerException), items
    assert "in ensemble 'pipeline', step 2 model 'detok' failed" in error.message()
    assert "detokenize cannot take token 33" in error.message()
    ok = _stream(server, "ok", enable_empty_final_response=True)
    assert sorted(r.as_numpy("PIECE")[0].decode() for r in ok[:-1]) == ["l", "p"]


def test_unary_infer_on_the_decoupled_ensemble_points_at_the_stream(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    with pytest.raises(InferenceServerException) as info:
        client.infer("pipeline", _text(httpclient, "abc"))
    assert "doesn't support models with decoupled transaction policy" in info.value.message()


def test_decoupled_steps_on_parallel_branches_are_refused_at_load(server: KilnProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    index = {row["name"]: row for row in client.get_model_repository_index()}
    assert index["parallel"]["state"] == "UNAVAILABLE"
    assert (
        "in ensemble 'parallel', step 1 (model 'gen') and step 3 (model 'gen') are decoupled "
        "and on parallel branches" in index["parallel"]["reason"]
    )
    assert index["pipeline"]["state"] == "READY"


def test_a_client_leaving_the_stream_cancels_the_generating_step(server: KilnProcess) -> None:
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer("slow_pipeline", _text(grpcclient, "x"))
    for _ in range(2):  # it is streaming
        assert not isinstance(got.get(timeout=30), InferenceServerException)
    client.stop_stream(cancel_requests=True)
    client.close()
    marker = server.repository / "slowgen.log"
    for _ in range(300):  # wait for the model to see it (no duration is asserted)
        if marker.exists():
            break
        time.sleep(0.05)
    assert marker.read_text().startswith("cancelled after ")
    assert int(marker.read_text().split()[-1]) < 1000  # it stopped early
    # and the server goes on serving
    ok = _stream(server, "ok", enable_empty_final_response=True)
    assert sorted(r.as_numpy("PIECE")[0].decode() for r in ok[:-1]) == ["l", "p"]


def test_one_generator_instance_streams_through_the_ensemble_to_several_clients(
    server: KilnProcess,
) -> None:
    """The generating step returns from execute at once and streams from its threads: its
    one instance serves three clients' requests together (each token waits for that)."""
    texts = ["abc", "xyz", "mno"]
    with ThreadPoolExecutor(len(texts)) as pool:
        results = list(
            pool.map(
                lambda t: _stream(
                    server, t, model="thread_pipeline", enable_empty_final_response=True
                ),
                texts,
            )
        )
    for text, items in zip(texts, results, strict=True):
        *responses, final = items
        assert not any(isinstance(r, InferenceServerException) for r in items), items
        pieces = sorted(r.as_numpy("PIECE")[0].decode() for r in responses)
        assert pieces == sorted(chr(ord(c) + 1) for c in text)  # no "?": they ran together
        assert final.get_response().outputs == []
