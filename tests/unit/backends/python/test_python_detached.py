"""Decoupled Python models whose ``execute`` returns before their requests are final, as
Triton allows: the instance takes its next batch while the model's own threads (or its
``async def execute`` coroutines) go on sending. Also: the side arenas that carry those
responses and BLS calls stay bounded however long a stream runs. Against a real worker
process and a real ``Instance``, driven from the event loop."""

from __future__ import annotations

import asyncio
import os
import textwrap
import threading
import time
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.backends.base import InstanceSpec, Rescheduled
from kiln.backends.python import worker_session
from kiln.backends.python.backend import PythonBackend
from kiln.backends.python.worker_channel import RECLAIM_BYTES
from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError
from kiln.core.stats import RequestTimes
from kiln.scheduling.base import Instance, Job

CONFIG = """
name: "streamer"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
model_transaction_policy { decoupled: true }
"""

SPEC = InstanceSpec(name="streamer_0", kind="cpu", device_id=0, index=0, total_instances=1)

# execute hands each request to a thread and returns. The thread answers nothing until it
# holds GATHER requests (from separate batches: one request per execute here), then sends
# each two responses, the second read from the request's input only now, and the FINAL
# flag. An instance that waited for a batch's FINAL flags before the next batch would
# never see the second request.
HANDS_OFF = """
import os, queue, threading
import numpy as np
import triton_python_backend_utils as pb_utils

GATHER = int(os.environ.get("KILN_TEST_GATHER", "3"))

class TritonPythonModel:
    def initialize(self, args):
        self.inbox = queue.Queue()
        threading.Thread(target=self.serve, daemon=True).start()

    def execute(self, requests):
        for r in requests:
            self.inbox.put(r)
        return None

    def serve(self):
        while True:
            held = [self.inbox.get() for _ in range(GATHER)]
            for r in held:
                sender = r.get_response_sender()
                x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 0 + GATHER)]))
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x.copy())]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

# The same with ``async def execute``: each coroutine waits until GATHER of them run
# at once, which only happens if the worker runs them side by side.
ASYNC = """
import asyncio
import numpy as np
import triton_python_backend_utils as pb_utils

GATHER = 3

class TritonPythonModel:
    def initialize(self, args):
        self.arrived = 0
        self.everyone = None

    async def execute(self, requests):
        if self.everyone is None:
            self.everyone = asyncio.Event()
        self.arrived += len(requests)
        if self.arrived >= GATHER:
            self.everyone.set()
        await self.everyone.wait()
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 2)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

# A stream that runs until its client goes away, on the model's own thread; the last
# response says whether the request saw the cancellation. -3 as input: the thread sleeps
# (so the worker can be killed while the stream is open). -1: the coroutine raises.
UNTIL_CANCELLED = """
import threading, time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            threading.Thread(target=self.stream, args=(r,), daemon=True).start()
        return None

    def stream(self, r):
        sender = r.get_response_sender()
        x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
        if x.reshape(-1)[0] == -3:
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
            time.sleep(60)
        for i in range(6000):  # 30 s unless the client goes away
            if sender.is_cancelled():
                seen = np.float32(-1 if r.is_cancelled() else -2)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 0 + seen)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + i)]))
            time.sleep(0.005)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
"""

ASYNC_RAISES = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    async def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            r.get_response_sender().send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
        raise RuntimeError("the coroutine broke")
"""

# One execute that streams far more than the side arena holds: COUNT responses of
# 16 KiB (4096 float32), each filled with its index.
LONG_STREAM = """
import os
import numpy as np
import triton_python_backend_utils as pb_utils

COUNT = 600

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            sender = r.get_response_sender()
            for i in range(COUNT):
                out = np.full((1, 4096), i, np.float32)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", out)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


class Sink:
    """A decoupled request's responses as they come: (OUT or None, final, error)."""

    window = 0

    def __init__(self) -> None:
        self.items: list[tuple[Any, bool, KilnError | None]] = []
        self.detached = False

    def on_credit(self, grant: Any) -> None:
        raise AssertionError("no window: nothing to grant")

    def detach(self) -> None:
        self.detached = True

    def send(
        self, outputs: dict[str, np.ndarray] | None, final: bool, error: Any, parameters: Any = None
    ) -> None:
        out = None if outputs is None else outputs["OUT"].tolist()
        self.items.append((out, final, error))

    @property
    def final(self) -> bool:
        return bool(self.items) and self.items[-1][1]

    async def wait_final(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.final:
            assert time.monotonic() < deadline, f"no FINAL flag; got {self.items[-3:]}"
            await asyncio.sleep(0.005)


def _instance(tmp_path: Path, source: str) -> Instance:
    version = tmp_path / "streamer" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(source))
    backend = PythonBackend(parse_config_text(CONFIG), version, SPEC)
    return Instance(backend, "streamer")


def _backend(instance: Instance) -> PythonBackend:
    assert isinstance(instance.backend, PythonBackend)
    return instance.backend


def _job(value: float, sink: Sink, width: int = 2) -> Job:
    job = Job({"IN": np.full((1, width), value, np.float32)}, ["OUT"], 1, RequestTimes())
    job.sink = sink
    return job


async def _batch(instance: Instance, job: Job) -> list[Any]:
    outcomes, _, _ = await asyncio.wait_for(instance.submit_requests([job]), 30)
    return list(outcomes)


async def test_an_execute_that_hands_requests_to_a_thread_frees_the_instance(
    tmp_path: Path,
) -> None:
    """Each batch is answered when execute returns; the requests stay open (detached)
    and end with the FINAL flag their thread sends once it has all three."""
    instance = _instance(tmp_path, HANDS_OFF)
    try:
        sinks = [Sink() for _ in range(3)]
        for value, sink in enumerate(sinks):
            assert await _batch(instance, _job(value + 10, sink)) == [{}]
        for sink in sinks:
            await sink.wait_final()
        for value, sink in enumerate(sinks):
            assert sink.detached  # its batch ended before its FINAL flag
            assert sink.items == [([[3, 3]], False, None), ([[value + 10] * 2], True, None)]
        assert _backend(instance).codec.streams == {}  # nothing left open
        assert len(_backend(instance).session.flag_pool._free) >= 3  # their bytes came back
    finally:
        instance.close()


async def test_the_inputs_of_an_open_request_outlive_its_slot(tmp_path: Path) -> None:
    """The model reads a held request's input only after later batches went through
    every slot of the worker's pipe: the input is the request's own, not theirs."""
    os.environ["KILN_TEST_GATHER"] = "20"  # more than pipeline_depth (8) batches
    try:
        instance = _instance(tmp_path, HANDS_OFF)
    finally:
        del os.environ["KILN_TEST_GATHER"]
    try:
        sinks = [Sink() for _ in range(20)]
        for value, sink in enumerate(sinks):
            assert await _batch(instance, _job(value, sink, width=300)) == [{}]
        for value, sink in enumerate(sinks):
            await sink.wait_final()
            assert sink.items[-1] == ([[value] * 300], True, None)
    finally:
        instance.close()


async def test_async_execute_of_a_decoupled_model_runs_side_by_side(tmp_path: Path) -> None:
    """Triton runs a decoupled model's ``async def execute`` coroutines concurrently: the
    three here each wait until all three have started."""
    instance = _instance(tmp_path, ASYNC)
    try:
        sinks = [Sink() for _ in range(3)]
        for value, sink in enumerate(sinks):
            assert await _batch(instance, _job(value, sink)) == [{}]
        for value, sink in enumerate(sinks):
            await sink.wait_final()
            assert sink.items == [([[2 * value] * 2], True, None)]
    finally:
        instance.close()


async def test_an_async_execute_that_raises_ends_its_open_requests_with_the_error(
    tmp_path: Path,
) -> None:
    instance = _instance(tmp_path, ASYNC_RAISES)
    try:
        sink = Sink()
        assert await _batch(instance, _job(4, sink)) == [{}]
        await sink.wait_final()
        (out, final, error), (_, last, failure) = sink.items
        assert out == [[4, 4]] and not final and error is None
        assert last and failure is not None
        assert "model 'streamer' failed to execute: RuntimeError: the coroutine broke" in str(
            failure
        )
        # the instance goes on: the next request gets its response and the same error
        again = Sink()
        assert await _batch(instance, _job(5, again)) == [{}]
        await again.wait_final()
        assert again.items[0] == ([[5, 5]], False, None)
    finally:
        instance.close()


async def test_a_detached_request_sees_its_client_go(tmp_path: Path) -> None:
    """``Job.cancel`` after the batch ended still reaches the model's thread."""
    instance = _instance(tmp_path, UNTIL_CANCELLED)
    try:
        sink = Sink()
        job = _job(3, sink)
        assert await _batch(instance, job) == [{}]
        assert sink.detached
        deadline = time.monotonic() + 30
        while len(sink.items) < 3:
            assert time.monotonic() < deadline, "no responses"
            await asyncio.sleep(0.005)
        job.cancel()
        await sink.wait_final()
        assert sink.items[-1] == ([[-1, -1]], True, None)  # the request saw it too
        assert len(sink.items) < 6000
        assert _backend(instance).codec.streams == {}
    finally:
        instance.close()


class SlowStart(threading.Thread):
    def start(self) -> None:
        time.sleep(0.5)  # as a loaded machine may hold the thread that starts it
        super().start()


@pytest.mark.parametrize("restart_thread", ["starts at once", "starts late"])
async def test_a_worker_killed_with_a_stream_open_ends_it_with_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, restart_thread: str
) -> None:
    """The open stream fails naming the model; the next batch runs on the new worker.
    "starts late": the restart is published (``restarting``) a moment before its thread
    runs, and a batch that reaches the instance's thread in that moment must wait for it,
    not find the thread "not alive" and run on the dead worker (seen under load: it failed
    with the old worker's death)."""
    instance = _instance(tmp_path, UNTIL_CANCELLED)
    backend = _backend(instance)
    if restart_thread == "starts late":
        fake = types.SimpleNamespace(Thread=SlowStart, Lock=threading.Lock)
        monkeypatch.setattr(worker_session, "threading", fake)
    try:
        sink = Sink()
        assert await _batch(instance, _job(-3, sink)) == [{}]
        deadline = time.monotonic() + 30
        while not sink.items:
            assert time.monotonic() < deadline, "no first response"
            await asyncio.sleep(0.005)
        assert backend.worker.proc is not None
        backend.worker.proc.kill()
        await sink.wait_final()
        _, final, error = sink.items[-1]
        assert final and isinstance(error, KilnError)
        assert "model 'streamer'" in error.message and "still streaming" in error.message
        # Later requests run on the restarted worker. The first batch after a restart
        # runs on the instance's thread, which waits for its FINAL flag.
        later = Sink()
        job = _job(7, later)
        running = asyncio.ensure_future(_batch(instance, job))
        while len(later.items) < 2:
            if running.done():
                raise AssertionError(f"the batch ended without responses: {running.result()}")
            assert time.monotonic() < deadline, "no responses after the restart"
            await asyncio.sleep(0.005)
        assert later.items[0] == ([[7, 7]], False, None)
        job.cancel()
        assert await running == [{}]
        assert later.items[-1] == ([[-1, -1]], True, None)
    finally:
        instance.close()


async def test_a_long_stream_reuses_the_side_arena(tmp_path: Path) -> None:
    """600 responses of 16 KiB (9.4 MiB) in one execute: every one arrives intact, and the
    side arena stays near ``RECLAIM_BYTES`` instead of growing by the stream's size."""
    instance = _instance(tmp_path, LONG_STREAM)
    try:
        sink = Sink()
        assert await _batch(instance, _job(0, sink)) == [{}]
        await sink.wait_final()
        values = [out for out, _, _ in sink.items if out is not None]
        assert len(values) == 600
        for i, out in enumerate(values):
            assert out[0][0] == i and out[0][-1] == i and len(out[0]) == 4096
        side = _backend(instance).worker.side_out
        assert os.stat(side.path).st_size <= 2 * RECLAIM_BYTES
    finally:
        instance.close()


async def test_the_thread_path_still_waits_for_every_final_flag(tmp_path: Path) -> None:
    """On the instance's thread (warm-up, the sequence batcher, after a restart) a batch
    ends with its last FINAL flag, as before: nothing is detached."""
    os.environ["KILN_TEST_GATHER"] = "2"
    try:
        instance = _instance(tmp_path, HANDS_OFF)
    finally:
        del os.environ["KILN_TEST_GATHER"]
    backend = _backend(instance)
    try:
        sinks = [Sink(), Sink()]
        jobs = [_job(1, sinks[0]), _job(2, sinks[1])]
        outcomes = await asyncio.wait_for(asyncio.to_thread(backend.execute_requests, jobs), 30)
        assert outcomes == [{}, {}]
        assert all(s.final and not s.detached for s in sinks)
    finally:
        instance.close()


# The first run of each request sends one response and reschedules it; the second sends
# the FINAL flag.
RESCHEDULES = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.runs = 0

    def execute(self, requests):
        self.runs += 1
        for r in requests:
            sender = r.get_response_sender()
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            if self.runs % 2:
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x)]))
                r.set_release_flags(pb_utils.TRITONSERVER_REQUEST_RELEASE_RESCHEDULE)
            else:
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


async def test_a_rescheduled_request_is_not_left_open(tmp_path: Path) -> None:
    """A rescheduled request is over for its batch (its next run gets a stream key and a
    cancellation byte of its own): neither stays behind once the batch ends, on the
    instance's thread (the sequence batcher's) or the loop's."""
    instance = _instance(tmp_path, RESCHEDULES)
    backend = _backend(instance)
    try:
        sink = Sink()
        job = _job(1, sink)
        (first,) = await asyncio.to_thread(backend.execute_requests, [job])
        assert isinstance(first, Rescheduled)
        assert backend.codec.streams == {} and not sink.detached
        assert await asyncio.to_thread(backend.execute_requests, [job]) == [{}]
        assert sink.items == [([[1, 1]], False, None), (None, True, None)]
        assert backend.codec.streams == {}
        # the loop's path: the scheduler refuses the reschedule; nothing is left open
        other = Sink()
        (outcome,) = await _batch(instance, _job(2, other))
        assert isinstance(outcome, Rescheduled)
        assert backend.codec.streams == {} and not other.detached
        # one byte served all three runs: each came back before the next batch took one
        assert len(backend.session.flag_pool._free) == 1
    finally:
        instance.close()


async def test_an_unload_ends_a_stream_still_open(tmp_path: Path) -> None:
    """The server waits for streams before unloading a model; one still open when the
    backend closes anyway (shutdown past its exit timeout) ends with an error, not never."""
    instance = _instance(tmp_path, UNTIL_CANCELLED)
    sink = Sink()
    try:
        assert await _batch(instance, _job(3, sink)) == [{}]
        deadline = time.monotonic() + 30
        while not sink.items:
            assert time.monotonic() < deadline, "no first response"
            await asyncio.sleep(0.005)
    finally:
        await asyncio.to_thread(instance.close)
    _, final, error = sink.items[-1]
    assert final and isinstance(error, KilnError)
    assert error.message == "model 'streamer' was unloaded while the request was still streaming"
    assert _backend(instance).codec.streams == {}
