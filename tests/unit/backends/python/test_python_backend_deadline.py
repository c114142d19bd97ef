"""Execution deadlines of Python-backend batches: how they are computed, which requests get
one, and what a real worker does when one passes."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend, BackendRequest, InstanceSpec, RequestOutcome
from kiln.backends.python.backend import PythonBackend
from kiln.backends.python.deadline import BatchDeadline, batch_deadline, expired
from kiln.config.loader import parse_config_text
from kiln.config.model_config_pb2 import ModelConfig, ModelDynamicBatching
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferInput
from kiln.scheduling.policy import QueuePolicy
from kiln.server.runtime import ModelRuntime

S = 1_000_000_000  # ns per second


# ---- the batch's deadline ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("requests", "execute_timeout", "expected"),
    [
        ([0, 0], None, BatchDeadline(0, False)),  # nothing bounds it
        ([0], 3.0, BatchDeadline(13 * S, False)),  # execute_timeout_secs from now (10 s)
        ([12 * S, 0, 11 * S], None, BatchDeadline(11 * S, True)),  # the earliest request
        ([12 * S], 3.0, BatchDeadline(12 * S, True)),  # a request's is earlier than the bound
        ([20 * S], 3.0, BatchDeadline(13 * S, False)),  # the operator's bound is earlier
        ([13 * S], 3.0, BatchDeadline(13 * S, True)),  # a tie names the request's timeout
    ],
)
def test_batch_deadline(
    requests: list[int], execute_timeout: float | None, expected: BatchDeadline
) -> None:
    assert batch_deadline(requests, 10 * S, execute_timeout) == expected


def test_deadline_seconds_and_expiry() -> None:
    assert BatchDeadline(0).seconds is None
    assert BatchDeadline(int(2.5 * S)).seconds == 2.5
    assert not expired(0, 10 * S)  # no deadline never expires
    assert expired(10 * S, 10 * S) and not expired(10 * S + 1, 10 * S)


def test_request_timeout_may_only_shorten_a_default() -> None:
    db = text_format.Parse(
        "default_queue_policy { default_timeout_microseconds: 5000 allow_timeout_override: true }"
        " priority_levels: 2 default_priority_level: 1"
        " priority_queue_policy { key: 2 value { allow_timeout_override: true } }",
        ModelDynamicBatching(),
    )
    policy = QueuePolicy.from_config("m", db)
    assert policy.timeout_ns(1, {"timeout": 1000}) == 1_000_000  # shorter: taken
    assert policy.timeout_ns(1, {"timeout": 9000}) == 5_000_000  # longer: the default holds
    assert policy.timeout_ns(2, {"timeout": 9000}) == 9_000_000  # no default: taken
    assert policy.timeout_ns(2, {}) == 0


# ---- which requests carry a deadline --------------------------------------------------------


class _Recorder(Backend):
    name: ClassVar[str] = "recorder"
    wants_requests: ClassVar[bool] = True
    seen: ClassVar[list[int]]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        return {"OUT": inputs["IN"]}

    def execute_requests(self, requests: list[BackendRequest]) -> list[RequestOutcome]:
        self.seen.extend(r.deadline_ns for r in requests)
        return [{"OUT": r.inputs["IN"]} for r in requests]


RECORDER_CONFIG = """
name: "rec"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


@pytest.mark.parametrize(
    ("scheduling", "has_deadline"),
    [
        ("dynamic_batching { default_queue_policy { allow_timeout_override: true } }", True),
        (
            "dynamic_batching { default_queue_policy { default_timeout_microseconds: 60000000 } }",
            True,
        ),
        # DELAY keeps a late request running: no deadline to enforce.
        (
            "dynamic_batching { default_queue_policy { timeout_action: DELAY "
            "allow_timeout_override: true } }",
            False,
        ),
        ("dynamic_batching { }", False),  # the override is not allowed: ignored, as in Triton
        ("", False),  # no queue policy without dynamic batching, as in Triton
    ],
)
async def test_deadline_comes_from_the_dynamic_batchers_policy(
    tmp_path: Path, scheduling: str, has_deadline: bool
) -> None:
    config = text_format.Parse(RECORDER_CONFIG + scheduling, ModelConfig())
    backend = type("Rec", (_Recorder,), {"seen": []})
    runtime = ModelRuntime("rec", 1, config, tmp_path, backend)
    await runtime.load()
    try:
        data = np.ones(2, np.float32)
        sent = time.monotonic_ns()
        request = InferenceRequest(
            "rec",
            inputs=[InferInput("IN", DataType.FP32, (2,), data)],
            parameters={"timeout": 30_000_000},
        )
        await runtime.infer(request)
    finally:
        await runtime.unload(5)
    (deadline,) = backend.seen
    if has_deadline:
        assert sent < deadline <= time.monotonic_ns() + 60 * S
    else:
        assert deadline == 0


# ---- a real worker whose deadline passes ----------------------------------------------------

MODEL = """
import os, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        x = [pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() for r in requests]
        if any(v.reshape(-1)[0] < 0 for v in x):
            time.sleep(60)
        pid = np.array([os.getpid()], dtype=np.int64)
        return [pb_utils.InferenceResponse([pb_utils.Tensor("PID", pid)]) for _ in requests]
"""

CONFIG = """
name: "hang"
backend: "python"
max_batch_size: 0
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "PID" data_type: TYPE_INT64 dims: [ 1 ] } ]
"""


class _Req:
    correlation_id = 0  # outside a sequence
    flags = 0

    def __init__(self, value: float, deadline_ns: int = 0) -> None:
        self.inputs = {"IN": np.array([value], np.float32)}
        self.output_names = ["PID"]
        self.parameters: dict[str, Any] = {}
        self.request_id = ""
        self.sink = None
        self.deadline_ns = deadline_ns


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[PythonBackend]:
    version = tmp_path / "hang" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(MODEL))
    spec = InstanceSpec(name="hang", kind="cpu", device_id=0, index=0, total_instances=1)
    b = PythonBackend(parse_config_text(CONFIG), version, spec)
    yield b
    b.close()


def _pid(outcome: RequestOutcome) -> int:
    assert isinstance(outcome, dict), outcome
    return int(outcome["PID"][0])


def test_deadline_mid_execute_fails_the_batch_and_restarts_the_worker(
    backend: PythonBackend,
) -> None:
    pid = _pid(backend.execute_requests([_Req(1.0)])[0])
    soon = time.monotonic_ns() + S // 5
    hung, mate = backend.execute_requests([_Req(-1.0, soon), _Req(1.0)])
    assert isinstance(hung, KilnError) and hung.status is Status.UNAVAILABLE
    assert hung.message.startswith("Request timeout expired: model 'hang' was still executing")
    assert isinstance(mate, KilnError) and mate.status is Status.UNAVAILABLE
    assert "another request of the same batch exceeded its timeout" in mate.message
    # The next batch waits for the restarted worker, then runs on it.
    assert _pid(backend.execute_requests([_Req(1.0)])[0]) != pid


def test_deadline_already_passed_fails_without_running(backend: PythonBackend) -> None:
    pid = backend.worker.pid
    late, fine = backend.execute_requests([_Req(-1.0, time.monotonic_ns() - 1), _Req(1.0)])
    assert isinstance(late, KilnError) and late.status is Status.UNAVAILABLE
    assert "could not start executing it before its timeout" in late.message
    assert _pid(fine) == pid  # the hanging input never reached the worker
    assert backend.worker.pid == pid
