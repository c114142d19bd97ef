"""The soak's requests: one call per example model over HTTP or gRPC, each with an outcome.

Every call has a client-side timeout, so a request the server never answers ends as
``hung`` instead of blocking the soak. An answer is compared with
``kiln.examples.reference_outputs`` (a sample of them: the CNN reference is not free).
Outcomes: ``ok``, ``wrong`` (answered, but not what the reference says), ``failed`` (an
error from the server: message and status kept), ``hung`` (client timeout) and ``lost``
(the connection dropped, or a stream ended without its final response).
"""

from __future__ import annotations

import itertools
import queue
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from kiln.examples import reference_outputs, reference_responses, reference_sequence

SEQUENCE_MODELS = ("simple_sequence", "simple_sequence_oldest", "simple_sequence_state")
DECOUPLED_MODELS = ("repeat_int32",)
_sequence_ids = itertools.count(1)  # unique across threads: next() on a count is atomic


@dataclass(slots=True)
class Outcome:
    model: str
    protocol: str  # http, grpc, grpc-stream
    kind: str  # ok, wrong, failed, hung, lost
    start: float  # time.monotonic()
    end: float
    requests: int = 1  # a sequence counts each of its steps
    status: str = ""
    message: str = ""


@dataclass(frozen=True, slots=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 where the batch (or a variable dim) goes


def model_inputs(http_url: str, models: list[str]) -> dict[str, list[TensorSpec]]:
    """Each model's inputs from its metadata, so new example models need no code here."""
    client = httpclient.InferenceServerClient(http_url)
    specs: dict[str, list[TensorSpec]] = {}
    for model in models:
        meta = client.get_model_metadata(model)
        specs[model] = [
            TensorSpec(t["name"], t["datatype"], tuple(int(d) for d in t["shape"]))
            for t in meta["inputs"]
        ]
    client.close()
    return specs


def make_inputs(specs: list[TensorSpec], rng: random.Random) -> dict[str, np.ndarray]:
    batch = rng.randint(1, 4)
    seed = np.random.default_rng(rng.getrandbits(32))
    arrays: dict[str, np.ndarray] = {}
    for spec in specs:
        shape = tuple(batch if d < 0 else d for d in spec.shape)
        if spec.datatype == "BYTES":  # simple_string: decimal integers as text
            numbers = seed.integers(-1000, 1000, shape)
            arrays[spec.name] = np.vectorize(lambda n: str(n).encode(), otypes=[object])(numbers)
        elif spec.datatype == "UINT8":
            arrays[spec.name] = seed.integers(0, 256, shape, dtype=np.uint8)
        elif spec.datatype == "INT32":
            arrays[spec.name] = seed.integers(-1000, 1000, shape, dtype=np.int32)
        else:
            arrays[spec.name] = seed.standard_normal(shape).astype(np.float32)
    return arrays


def _matches(expected: dict[str, np.ndarray], got: dict[str, np.ndarray]) -> bool:
    for name, want in expected.items():
        have = got.get(name)
        if have is None or have.shape != want.shape:
            return False
        if want.dtype == object:
            if [bytes(x) for x in have.flat] != [bytes(x) for x in want.flat]:
                return False
        elif not np.allclose(have, want, rtol=1e-4, atol=1e-5):
            return False
    return True


def _classify(exc: BaseException) -> tuple[str, str, str]:
    """(kind, status, message) of a failed call."""
    if isinstance(exc, InferenceServerException):
        status = str(exc.status() or "")
        message = str(exc.message() or exc)
        if "DEADLINE_EXCEEDED" in status or "timed out" in message.lower():
            return "hung", status, message
        if "UNAVAILABLE" in status and "Socket closed" in message:
            return "lost", status, message
        return "failed", status, message
    text = f"{type(exc).__name__}: {exc}"
    if "timeout" in text.lower() or "timed out" in text.lower():
        return "hung", "", text
    return "lost", "", text  # connection reset / closed without an answer


class Traffic:
    """One load thread's clients (tritonclient clients are not shared across threads)."""

    def __init__(self, http_url: str, grpc_url: str, timeout: float, check_every: int) -> None:
        self.timeout = timeout
        self.check_every = check_every
        self.calls = 0
        self.http = httpclient.InferenceServerClient(
            http_url, connection_timeout=timeout, network_timeout=timeout
        )
        self.grpc = grpcclient.InferenceServerClient(grpc_url)

    def close(self) -> None:
        self.http.close()
        self.grpc.close()

    def _check(self) -> bool:
        self.calls += 1
        return self.calls % self.check_every == 0

    def infer(
        self, model: str, specs: list[TensorSpec], protocol: str, rng: random.Random
    ) -> Outcome:
        inputs = make_inputs(specs, rng)
        start = time.monotonic()
        try:
            got = self._http(model, inputs) if protocol == "http" else self._grpc(model, inputs)
        except Exception as exc:
            kind, status, message = _classify(exc)
            return Outcome(model, protocol, kind, start, time.monotonic(), 1, status, message)
        end = time.monotonic()
        if self._check() and not _matches(reference_outputs(model, inputs), got):
            return Outcome(model, protocol, "wrong", start, end, 1, "", "answer differs")
        return Outcome(model, protocol, "ok", start, end)

    def _http(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        wire = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == object else _triton_dtype(array)
            tensor = httpclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array, binary_data=True)
            wire.append(tensor)
        result = self.http.infer(model, wire)
        return {o["name"]: result.as_numpy(o["name"]) for o in result.get_response()["outputs"]}

    def _grpc(self, model: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        wire = []
        for name, array in inputs.items():
            dtype = "BYTES" if array.dtype == object else _triton_dtype(array)
            tensor = grpcclient.InferInput(name, list(array.shape), dtype)
            tensor.set_data_from_numpy(array)
            wire.append(tensor)
        result = self.grpc.infer(model, wire, client_timeout=self.timeout)
        outputs = result.get_response().outputs
        return {o.name: result.as_numpy(o.name) for o in outputs}

    def sequence(self, model: str, rng: random.Random) -> Outcome:
        """One whole sequence (START ... END) on one protocol; its steps are its requests."""
        protocol = rng.choice(("http", "grpc"))
        values = [rng.randint(-100, 100) for _ in range(rng.randint(2, 5))]
        sequence_id = next(_sequence_ids)
        start = time.monotonic()
        answers: list[int] = []
        for step, value in enumerate(values):
            flags = {"sequence_start": step == 0, "sequence_end": step == len(values) - 1}
            array = np.full((1, 1), value, np.int32)
            try:
                if protocol == "http":
                    tensor = httpclient.InferInput("INPUT", [1, 1], "INT32")
                    tensor.set_data_from_numpy(array, binary_data=True)
                    result: Any = self.http.infer(model, [tensor], sequence_id=sequence_id, **flags)
                else:
                    gtensor = grpcclient.InferInput("INPUT", [1, 1], "INT32")
                    gtensor.set_data_from_numpy(array)
                    result = self.grpc.infer(
                        model,
                        [gtensor],
                        sequence_id=sequence_id,
                        client_timeout=self.timeout,
                        **flags,
                    )
            except Exception as exc:
                kind, status, message = _classify(exc)
                return Outcome(
                    model, protocol, kind, start, time.monotonic(), step + 1, status, message
                )
            answers.append(int(result.as_numpy("OUTPUT")[0, 0]))
        end = time.monotonic()
        kind = "ok" if answers == reference_sequence(model, values) else "wrong"
        return Outcome(
            model,
            protocol,
            kind,
            start,
            end,
            len(values),
            "",
            "" if kind == "ok" else "answer differs",
        )

    def stream(self, model: str, rng: random.Random) -> Outcome:
        """A decoupled request on a fresh gRPC stream: n responses, then the final flag."""
        values = np.array([rng.randint(-50, 50) for _ in range(rng.randint(1, 6))], np.int32)
        tensor = grpcclient.InferInput("IN", [len(values)], "INT32")
        tensor.set_data_from_numpy(values)
        answers: queue.Queue[tuple[Any, Any]] = queue.Queue()
        start = time.monotonic()
        self.grpc.start_stream(
            callback=lambda result, error: answers.put((result, error)), stream_timeout=self.timeout
        )
        try:
            self.grpc.async_stream_infer(model, [tensor], enable_empty_final_response=True)
            got: list[dict[str, np.ndarray]] = []
            while True:
                remaining = start + self.timeout - time.monotonic()
                try:
                    result, error = answers.get(timeout=max(0.0, remaining))
                except queue.Empty:
                    return Outcome(
                        model,
                        "grpc-stream",
                        "hung",
                        start,
                        time.monotonic(),
                        1,
                        "",
                        "no final response",
                    )
                if error is not None:
                    kind, status, message = _classify(error)
                    return Outcome(
                        model, "grpc-stream", kind, start, time.monotonic(), 1, status, message
                    )
                response = result.get_response()
                if response.outputs:
                    got.append({o.name: result.as_numpy(o.name) for o in response.outputs})
                if response.parameters["triton_final_response"].bool_param:
                    break
        finally:
            self.grpc.stop_stream()
        end = time.monotonic()
        expected = reference_responses(model, {"IN": values})
        same = len(got) == len(expected) and all(
            _matches(e, g) for e, g in zip(expected, got, strict=True)
        )
        return Outcome(
            model,
            "grpc-stream",
            "ok" if same else "wrong",
            start,
            end,
            1,
            "",
            "" if same else "answer differs",
        )


def _triton_dtype(array: np.ndarray) -> str:
    return {"float32": "FP32", "int32": "INT32", "uint8": "UINT8", "int64": "INT64"}[
        str(array.dtype)
    ]
