"""The Python backend driven from the event loop (``loopcall.py``): framing, outcomes,
faults, BLS and decoupled streaming, against a real worker process and a real ``Instance``."""

from __future__ import annotations

import asyncio
import itertools
import select
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from socket import socketpair
from typing import Any

import numpy as np
import pytest

from kiln.backends.base import InstanceSpec
from kiln.backends.python.backend import PythonBackend
from kiln.backends.python.broker import BlsBroker
from kiln.backends.python.deadline import BatchDeadline
from kiln.backends.python.loopcall import WorkerPipe
from kiln.backends.python.wire import Wire
from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError, Status
from kiln.core.stats import RequestTimes
from kiln.scheduling.base import Instance, Job

# Input values steer the model: -1 raises, -3 sleeps (so it can be killed mid-request),
# -4 makes a BLS call (no server here: it gets an error response back), -5 sleeps 1.2 s
# then doubles, else doubles.
MODEL = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            first = x.reshape(-1)[0]
            if first == -1:
                raise ValueError("negative one is not allowed")
            if first == -3:
                time.sleep(30)
            if first == -5:
                time.sleep(1.2)
            if first == -4:
                bls = pb_utils.InferenceRequest(
                    model_name="elsewhere", requested_output_names=["OUT"],
                    inputs=[pb_utils.Tensor("IN", x)])
                reply = bls.exec()
                out.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", x * 2)]))
        return out
"""

STREAM = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            sender = r.get_response_sender()
            for i in range(3):
                sender.send(pb_utils.InferenceResponse(
                    output_tensors=[pb_utils.Tensor("OUT", x + i)]))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""

CONFIG = """
name: "double"
backend: "python"
max_batch_size: 4
input [ { name: "IN" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""

SPEC = InstanceSpec(name="double_0", kind="cpu", device_id=0, index=0, total_instances=1)


def test_take_after_each_fill_returns_whole_messages_in_order() -> None:
    """The loop's way of reading (``fill`` once the socket is readable, then ``take`` until
    nothing is whole): bytes arriving one at a time, and a message larger than the buffer."""
    ours, theirs = socketpair()
    reader = Wire(ours)
    big = b"x" * 200_000  # past the 64 KiB initial buffer: it must grow
    messages = [("response", 0, [], None, False, True), ("bls", {"blob": big}),
                ("executed", [([], None)], None)]  # fmt: skip
    stream = b"".join(_framed(m) for m in messages)
    got: list[Any] = []
    i = 0
    while i < len(stream):
        step = 1 if i < 400 else 4096  # every split of the small ones, then faster
        theirs.sendall(stream[i : i + step])
        i += step
        # as the loop does: one fill per readiness (a fill may leave bytes in the socket
        # when the buffer is full; the socket then stays readable)
        while select.select([ours], [], [], 0)[0]:
            reader.fill()
            while (item := reader.take())[0]:
                got.append(item[1])
    assert got == messages
    assert reader.pending == 0
    assert reader.take() == (False, None)
    theirs.close()
    with pytest.raises(EOFError):
        reader.fill()
    reader.close()


def _framed(message: Any) -> bytes:
    """A message as ``Wire.send`` puts it on the socket."""
    sender, sink = socketpair()
    Wire(sender).send(message)
    sender.close()
    data = b""
    while chunk := sink.recv(1 << 20):
        data += chunk
    sink.close()
    return data


def _model(tmp_path: Path, source: str = MODEL) -> Path:
    version = tmp_path / "double" / "1"
    version.mkdir(parents=True)
    (version / "model.py").write_text(textwrap.dedent(source))
    return version


@pytest.fixture
def instance(tmp_path: Path) -> Iterator[Instance]:
    config = parse_config_text(
        CONFIG + 'parameters { key: "execute_timeout_secs" value { string_value: "2" } }'
    )
    inst = Instance(PythonBackend(config, _model(tmp_path), SPEC), "double")
    yield inst
    inst.close()


def _job(value: float, deadline_ns: int = 0, sink: Any = None) -> Job:
    job = Job({"IN": np.full((1, 2), value, np.float32)}, ["OUT"], 1, RequestTimes())
    job.deadline_ns = deadline_ns
    job.sink = sink
    return job


async def _run(instance: Instance, jobs: list[Job]) -> list[Any]:
    outcomes, start, end = await instance.submit_requests(jobs)
    assert start <= end
    return outcomes


async def test_a_batch_runs_from_the_loop_without_the_instance_thread(
    instance: Instance,
) -> None:
    outcomes = await _run(instance, [_job(1), _job(2), _job(3)])
    assert [o["OUT"].tolist() for o in outcomes] == [[[2, 2]], [[4, 4]], [[6, 6]]]
    assert instance.loop_driven_calls == 1
    assert instance.call_ns is None  # the instance's thread never timed a call


async def test_execute_raising_fails_that_batch_and_the_next_one_runs(
    instance: Instance,
) -> None:
    outcomes = await _run(instance, [_job(-1), _job(1)])
    for error in outcomes:
        assert isinstance(error, KilnError) and error.status is Status.INTERNAL
        assert "model 'double'" in error.message and "negative one" in error.message
    assert (await _run(instance, [_job(5)]))[0]["OUT"].tolist() == [[10, 10]]
    assert instance.loop_driven_calls == 2


async def test_worker_killed_mid_request_fails_it_and_is_restarted(instance: Instance) -> None:
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    old = backend.worker.pid
    running = asyncio.ensure_future(_run(instance, [_job(-3)]))
    await asyncio.sleep(0.3)  # the worker is asleep inside execute
    assert backend.worker.proc is not None
    backend.worker.proc.kill()
    (error,) = await asyncio.wait_for(running, 30)
    assert isinstance(error, KilnError) and error.status is Status.INTERNAL
    assert "model 'double'" in error.message and "signal 9" in error.message
    # The next batch waits for the restart (on the thread path), later ones use the loop.
    assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
    assert (await _run(instance, [_job(2)]))[0]["OUT"].tolist() == [[4, 4]]
    assert backend.worker.pid != old
    assert instance.loop_driven_calls == 2  # the killed batch and the last one


async def test_execute_timeout_kills_the_worker_and_answers_unavailable(
    instance: Instance,
) -> None:
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    old = backend.worker.pid
    (error,) = await asyncio.wait_for(_run(instance, [_job(-3)]), 30)
    assert isinstance(error, KilnError) and error.status is Status.UNAVAILABLE
    assert "execute_timeout_secs=2" in error.message
    assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
    assert backend.worker.pid != old


async def test_a_request_timeout_overrun_names_that_request_even_if_the_timer_is_early(
    instance: Instance,
) -> None:
    """The loop's timer keeps millisecond time and may fire just before the deadline by
    ``time.monotonic_ns``: the request whose timeout set the deadline still gets Triton's
    timeout message, its batch mate the other one (this raced in CI)."""
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    soon = time.monotonic_ns() + 50_000_000  # "now" is up to 50 ms before the deadline
    jobs = [_job(-3, deadline_ns=soon), _job(1)]
    mine, mate = backend.codec.overran(jobs, BatchDeadline(soon, from_request=True))
    assert isinstance(mine, KilnError) and mine.message.startswith("Request timeout expired")
    assert isinstance(mate, KilnError) and "another request of the same batch" in mate.message
    hung = await asyncio.wait_for(_run(instance, [_job(-3, time.monotonic_ns() + 300_000_000)]), 30)
    assert isinstance(hung[0], KilnError) and hung[0].message.startswith("Request timeout expired")


async def test_a_request_whose_deadline_passed_in_the_queue_is_not_sent(
    instance: Instance,
) -> None:
    past = time.monotonic_ns() - 1
    outcomes = await _run(instance, [_job(1), _job(2, deadline_ns=past), _job(3)])
    assert outcomes[0]["OUT"].tolist() == [[2, 2]]
    assert isinstance(outcomes[1], KilnError) and outcomes[1].status is Status.UNAVAILABLE
    assert "Request timeout expired" in outcomes[1].message
    assert outcomes[2]["OUT"].tolist() == [[6, 6]]


async def test_a_bls_call_is_answered_off_the_loop(instance: Instance) -> None:
    # No server runs here: the BLS call comes back as an error response, and the loop,
    # which the call would block if it ran there, keeps running meanwhile.
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    ticker = asyncio.ensure_future(tick())
    (error,) = await asyncio.wait_for(_run(instance, [_job(-4)]), 30)
    ticker.cancel()
    assert isinstance(error, KilnError)
    assert "no server is running" in error.message and "elsewhere" in error.message
    assert ticks > 0
    assert instance.loop_driven_calls == 1


class _AnySink:
    """A decoupled request's responses as they come: (OUT or None, final, error)."""

    window = 0  # no flow control (core/stream.py)

    def on_credit(self, grant: Any) -> None:
        raise AssertionError("no window: nothing to grant")

    def __init__(self) -> None:
        self.items: list[tuple[Any, bool, Any]] = []
        self.detached = False

    def detach(self) -> None:
        self.detached = True

    def send(
        self,
        outputs: dict[str, np.ndarray] | None,
        final: bool,
        error: Any,
        parameters: Any = None,
    ) -> None:
        out = None if outputs is None else outputs["OUT"].tolist()
        self.items.append((out, final, error))


async def test_decoupled_responses_stream_from_the_loop(tmp_path: Path) -> None:
    config = parse_config_text(CONFIG + "model_transaction_policy { decoupled: true }")
    instance = Instance(PythonBackend(config, _model(tmp_path, STREAM), SPEC), "double")
    try:
        sinks = [_AnySink(), _AnySink()]
        outcomes = await _run(instance, [_job(1, sink=sinks[0]), _job(10, sink=sinks[1])])
        assert outcomes == [{}, {}]
        assert sinks[0].items == [([[1, 1]], False, None), ([[2, 2]], False, None),
                                  ([[3, 3]], False, None), (None, True, None)]  # fmt: skip
        assert [i[0] for i in sinks[1].items[:3]] == [[[10, 10]], [[11, 11]], [[12, 12]]]
        assert instance.loop_driven_calls == 1
    finally:
        instance.close()


# ---- busy polling ----------------------------------------------------------------------
SLOW = """
import time
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        time.sleep(0.005)
        return [pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor("OUT", pb_utils.get_input_tensor_by_name(r, "IN").as_numpy() * 2)])
            for r in requests]
"""


def _instance(
    tmp_path: Path,
    source: str = MODEL,
    busy_poll_us: str | None = None,
    pipeline_depth: str | None = None,
) -> Instance:
    text = CONFIG
    if busy_poll_us is not None:
        text += f'parameters {{ key: "busy_poll_us" value {{ string_value: "{busy_poll_us}" }} }}'
    if pipeline_depth is not None:
        text += (
            f'parameters {{ key: "pipeline_depth" value {{ string_value: "{pipeline_depth}" }} }}'
        )
    return Instance(
        PythonBackend(parse_config_text(text), _model(tmp_path, source), SPEC), "double"
    )


async def test_a_lone_request_is_answered_by_busy_polling(tmp_path: Path) -> None:
    # 50 ms: far more than the worker's round trip, even on a loaded CI machine.
    instance = _instance(tmp_path, busy_poll_us="50000")
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    try:
        for value in (1, 2, 3):
            (out,) = await _run(instance, [_job(value)])
            assert out["OUT"].tolist() == [[2 * value, 2 * value]]
        assert backend.busy_polled_calls == 3
        assert instance.loop_driven_calls == 3
        assert backend.round_trip_ns is not None and backend.round_trip_ns < 50_000_000
    finally:
        instance.close()


async def test_no_busy_polling_when_off_or_not_alone(tmp_path: Path) -> None:
    off = _instance(tmp_path / "off", busy_poll_us="0")
    on = _instance(tmp_path / "on", busy_poll_us="50000")
    try:
        assert (await _run(off, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
        assert isinstance(off.backend, PythonBackend) and off.backend.busy_polled_calls == 0
        # Another request in flight in the server: the loop has other work, it must not spin.
        activity = on.backend.activity
        activity.inflight += 2
        try:
            assert (await _run(on, [_job(2)]))[0]["OUT"].tolist() == [[4, 4]]
        finally:
            activity.inflight -= 2
        assert isinstance(on.backend, PythonBackend) and on.backend.busy_polled_calls == 0
        assert (await _run(on, [_job(3)]))[0]["OUT"].tolist() == [[6, 6]]
        assert on.backend.busy_polled_calls == 1
    finally:
        off.close()
        on.close()


async def test_a_model_slower_than_the_budget_stops_busy_polling(tmp_path: Path) -> None:
    """The first call may poll (no round trip is known yet) and gives up after the budget;
    once the average round trip exceeds the budget the loop waits on the pipe at once."""
    instance = _instance(tmp_path, SLOW, busy_poll_us="100")
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    try:
        for value in (1, 2, 3):
            assert (await _run(instance, [_job(value)]))[0]["OUT"].tolist() == [[2 * value] * 2]
        assert backend.busy_polled_calls == 0
        assert backend.round_trip_ns is not None and backend.round_trip_ns >= 5_000_000
        assert backend.busy_poll_budget() == 0
    finally:
        instance.close()


@pytest.mark.parametrize("value", ["-5", "fast", "1.5"])
def test_a_bad_busy_poll_us_names_the_model_and_parameter(tmp_path: Path, value: str) -> None:
    with pytest.raises(KilnError) as err:
        _instance(tmp_path, busy_poll_us=value)
    assert "model 'double'" in err.value.message
    assert "busy_poll_us" in err.value.message and value in err.value.message


# ---- pipelining: the next batch waits in the worker's pipe ---------------------------------
def _backend(instance: Instance) -> PythonBackend:
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    return backend


async def test_a_second_batch_waits_in_the_pipe_and_keeps_its_own_tensors(
    instance: Instance,
) -> None:
    """Two batches in the pipe at once use the two pairs of arenas: neither one's inputs
    nor outputs are overwritten by the other's."""
    backend = _backend(instance)
    first = instance.submit_requests([_job(-5), _job(7)])
    queued = [_job(11), _job(13), _job(17)]
    second = instance.submit_requests(queued)
    assert backend.pipe is not None and len(backend.pipe.calls) == 2
    assert [c.slot for c in backend.pipe.calls] == [0, 1]
    (a, _, a_end), (b, b_start, b_end) = await asyncio.wait_for(asyncio.gather(first, second), 30)
    assert [o["OUT"].tolist() for o in a] == [[[-10, -10]], [[14, 14]]]
    assert [o["OUT"].tolist() for o in b] == [[[22, 22]], [[26, 26]], [[34, 34]]]
    # The second computed once the first had ended, and its stamps say so.
    assert b_start >= a_end and b_end >= b_start
    # Its wait behind the first counts as queue time (nv_inference_queue_duration_us).
    assert all(job.times.queue_end == b_start for job in queued)
    assert instance.loop_driven_calls == 2
    third = await _run(instance, [_job(1)])  # slot 0 again, reused
    assert third[0]["OUT"].tolist() == [[2, 2]]


async def test_a_queued_batch_runs_after_the_one_before_overran(instance: Instance) -> None:
    hung = instance.submit_requests([_job(-3)])
    queued = instance.submit_requests([_job(5)])
    (error,), _, _ = await asyncio.wait_for(hung, 30)
    assert isinstance(error, KilnError) and "execute_timeout_secs=2" in error.message
    (out,), _, _ = await asyncio.wait_for(queued, 30)
    assert out["OUT"].tolist() == [[10, 10]]


async def test_a_queued_batch_s_execute_timeout_starts_when_it_begins(
    instance: Instance,
) -> None:
    """execute_timeout_secs=2 bounds each execute, not the wait behind the one before:
    two 1.2 s executes back to back both finish."""
    first = instance.submit_requests([_job(-5)])
    second = instance.submit_requests([_job(-5)])
    for running in (first, second):
        (out,), _, _ = await asyncio.wait_for(running, 30)
        assert not isinstance(out, KilnError), out
        assert out["OUT"].tolist() == [[-10, -10]]


async def test_the_pipe_holds_pipeline_depth_batches_each_with_its_own_arenas(
    instance: Instance,
) -> None:
    """By default eight batches wait in the worker's pipe at once, one per pair of arenas,
    behind a slow first one: each gets its own answers, in order, and the slots wrap."""
    from kiln.backends.python.loopcall import PIPELINE_DEPTH

    backend = _backend(instance)
    assert backend.pipeline_depth == PIPELINE_DEPTH == 8
    assert len(backend.worker.arenas) == PIPELINE_DEPTH
    first = instance.submit_requests([_job(-5)])
    rest = [instance.submit_requests([_job(v), _job(v + 0.5)]) for v in range(1, PIPELINE_DEPTH)]
    assert backend.pipe is not None
    assert [c.slot for c in backend.pipe.calls] == list(range(PIPELINE_DEPTH))
    (slow,), _, _ = await asyncio.wait_for(first, 30)
    assert slow["OUT"].tolist() == [[-10, -10]]
    ends = []
    for v, running in zip(range(1, PIPELINE_DEPTH), rest, strict=True):
        (a, b), start, end = await asyncio.wait_for(running, 30)
        assert a["OUT"].tolist() == [[2 * v] * 2] and b["OUT"].tolist() == [[2 * v + 1] * 2]
        ends.append((start, end))
    assert all(e1 <= s2 for (_, e1), (s2, _) in itertools.pairwise(ends))
    again = await _run(instance, [_job(3)])  # slot 0 again
    assert again[0]["OUT"].tolist() == [[6, 6]]


async def test_pipeline_depth_from_the_config_sets_the_pipe_and_the_arenas(
    tmp_path: Path,
) -> None:
    instance = _instance(tmp_path, pipeline_depth="3")
    backend = _backend(instance)
    try:
        assert backend.pipeline_depth == 3 and len(backend.worker.arenas) == 3
        running = [instance.submit_requests([_job(-5 if v == 0 else v)]) for v in range(3)]
        assert backend.pipe is not None
        assert [c.slot for c in backend.pipe.calls] == [0, 1, 2]
        # A fourth batch would overwrite the first's arenas: the pipe refuses it (the
        # scheduler never hands an instance more than pipeline_depth at once).
        with pytest.raises(KilnError) as refused:
            await instance.submit_requests([_job(9)])
        assert "model 'double'" in refused.value.message
        assert "3 batches in flight" in refused.value.message
        outs = [(await asyncio.wait_for(r, 30))[0][0]["OUT"].tolist() for r in running]
        assert outs == [[[-10, -10]], [[2, 2]], [[4, 4]]]
        assert (await _run(instance, [_job(7)]))[0]["OUT"].tolist() == [[14, 14]]
    finally:
        instance.close()


@pytest.mark.parametrize("value", ["0", "-1", "deep", "65"])
def test_a_bad_pipeline_depth_names_the_model_and_parameter(tmp_path: Path, value: str) -> None:
    with pytest.raises(KilnError) as err:
        _instance(tmp_path, pipeline_depth=value)
    assert err.value.status is Status.INVALID_ARG
    assert "model 'double'" in err.value.message
    assert "pipeline_depth" in err.value.message and value in err.value.message


async def test_every_batch_queued_behind_a_killed_one_runs_after_the_restart(
    instance: Instance,
) -> None:
    backend = _backend(instance)
    old = backend.worker.pid
    hung = instance.submit_requests([_job(-3)])
    queued = [instance.submit_requests([_job(v)]) for v in range(1, 7)]
    await asyncio.sleep(0.3)  # the worker is asleep inside the first execute
    assert backend.worker.proc is not None
    backend.worker.proc.kill()
    (error,), _, _ = await asyncio.wait_for(hung, 30)
    assert isinstance(error, KilnError) and "signal 9" in error.message
    for v, running in zip(range(1, 7), queued, strict=True):
        (out,), _, _ = await asyncio.wait_for(running, 30)
        assert out["OUT"].tolist() == [[2 * v, 2 * v]]
    assert backend.worker.pid != old
    assert backend.queued_requests == 0


async def test_requests_queued_in_the_pipe_count_as_pending(instance: Instance) -> None:
    """Requests behind the running batch wait for the worker as others wait for an
    instance: nv_inference_pending_request_count (which autoscalers read) includes them."""
    from kiln.core.stats import ModelStats
    from kiln.scheduling.direct import DirectScheduler

    scheduler = DirectScheduler([instance], ModelStats(), "double")
    slow = asyncio.ensure_future(scheduler.schedule(_job(-5)))
    await asyncio.sleep(0.05)
    assert scheduler.pending == 0  # running, not pending
    queued = [asyncio.ensure_future(scheduler.schedule(_job(v))) for v in (1, 2, 3)]
    await asyncio.sleep(0.05)
    assert scheduler.pending == 3
    assert _backend(instance).queued_requests == 3
    assert (await asyncio.wait_for(slow, 30))["OUT"].tolist() == [[-10, -10]]
    outs = await asyncio.wait_for(asyncio.gather(*queued), 30)
    assert [o["OUT"].tolist() for o in outs] == [[[2, 2]], [[4, 4]], [[6, 6]]]
    assert scheduler.pending == 0


def test_schedulers_free_lists_spread_over_instances_before_pipelining() -> None:
    from kiln.scheduling.base import free_slots

    class _Fake:
        def __init__(self, depth: int) -> None:
            self.backend = type("B", (), {"pipeline_depth": depth})()

    a, b, c = _Fake(2), _Fake(2), _Fake(1)
    assert free_slots([a, b]) == [a, b, a, b]  # type: ignore[list-item]
    assert free_slots([a, c]) == [a, c, a]  # type: ignore[list-item]
    assert free_slots([c]) == [c]  # type: ignore[list-item]


async def test_a_bls_call_read_by_the_loop_runs_on_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The callee runs as a task of the server's loop, on its thread: the thread-side
    ``bls.call`` (an executor thread waiting on the loop) is not used, and the answer,
    written back into the worker's side arena, is the callee's."""
    import threading

    from kiln.backends import host
    from kiln.backends.python import bls
    from kiln.core.types import DataType, InferenceResponse, InferOutput

    loop_thread = threading.get_ident()
    seen: list[tuple[str, int, list[float]]] = []

    async def infer(request: Any) -> Any:
        x = request.inputs[0].data
        seen.append((request.model_name, threading.get_ident(), x.reshape(-1).tolist()))
        out = InferOutput("OUT", DataType.FP32, x.shape, x + 1)
        return InferenceResponse("elsewhere", "1", outputs=[out])

    def no_thread(request: Any) -> Any:
        raise AssertionError("a BLS call read by the loop went to a thread")

    monkeypatch.setattr(bls, "call", no_thread)
    instance = Instance(
        PythonBackend(parse_config_text(CONFIG), _model(tmp_path, BLS_ECHO), SPEC), "double"
    )
    host.install(infer, asyncio.get_running_loop())
    try:
        (out,) = await asyncio.wait_for(_run(instance, [_job(7)]), 30)
        assert not isinstance(out, KilnError), out
        assert out["OUT"].tolist() == [[8, 8]]
        assert seen == [("elsewhere", loop_thread, [7.0, 7.0])]
        assert instance.loop_driven_calls == 1
    finally:
        host.uninstall(infer)
        instance.close()


async def test_a_lone_request_s_bls_call_is_a_lone_request_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the only request in flight waits for its BLS call, the callee's request is
    the only one the loop has (so its worker is busy-polled for, ``busy_poll_budget``);
    the count is whole again after the call, and the loop then polls for the worker's
    answer instead of sleeping until the pipe wakes it."""
    from kiln.backends import host
    from kiln.core.activity import Activity
    from kiln.core.types import DataType, InferenceResponse, InferOutput

    alone: list[tuple[bool, int]] = []
    activity = Activity()  # the server's, shared by the caller's and the callee's runtimes

    async def infer(request: Any) -> Any:
        activity.inflight += 1  # as the runtime counts the callee's request
        try:
            alone.append((activity.alone(), activity.inflight))
            x = request.inputs[0].data
            return InferenceResponse(
                "elsewhere", "1", outputs=[InferOutput("OUT", DataType.FP32, x.shape, x + 1)]
            )
        finally:
            activity.inflight -= 1

    backend = PythonBackend(parse_config_text(CONFIG), _model(tmp_path, BLS_ECHO), SPEC)
    backend.activity = activity  # as its runtime sets it
    instance = Instance(backend, "double")
    polled: list[int] = []
    poll = WorkerPipe.poll_after_answer

    def watched(self: WorkerPipe, budget_ns: int) -> None:
        polled.append(budget_ns)
        poll(self, budget_ns)

    monkeypatch.setattr(WorkerPipe, "poll_after_answer", watched)
    activity.inflight = 1  # the caller's own request
    host.install(infer, asyncio.get_running_loop())
    try:
        (out,) = await asyncio.wait_for(_run(instance, [_job(3)]), 30)
        assert out["OUT"].tolist() == [[4, 4]]
        assert alone == [(True, 1)]
        assert activity.inflight == 1
        assert polled == [backend.busy_poll_ns]
    finally:
        host.uninstall(infer)
        instance.close()


async def test_the_reader_does_not_block_when_a_busy_poll_took_the_bytes() -> None:
    """The pipe's reader runs once the loop saw the socket readable; a busy poll
    (``poll_after_answer``) may have read those bytes since: it must return, not wait in
    ``recv`` for more and hold the loop."""
    ours, theirs = socketpair()
    pipe = WorkerPipe.__new__(WorkerPipe)
    pipe.conn = Wire(ours)
    drained: list[bool] = []
    pipe._drain = lambda: drained.append(True)  # type: ignore[method-assign]
    theirs.sendall(_framed(("executed", [], None)))
    pipe._readable()  # reads the message
    assert drained == [True]
    done = await asyncio.wait_for(asyncio.to_thread(pipe._readable), 5)  # nothing left
    assert done is None and drained == [True]
    ours.close()
    theirs.close()


async def test_a_batch_queued_behind_one_making_a_bls_call_waits_its_turn(
    instance: Instance, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second batch reaches the worker's pipe while the first waits for its BLS answer
    (made slow here, so it surely comes second): the worker must keep that batch for
    later, not read it as the answer."""
    from kiln.backends.python import bls

    real_call = bls.call_async

    async def slow_call(*args: Any) -> Any:
        await asyncio.sleep(0.3)
        return await real_call(*args)

    monkeypatch.setattr(bls, "call_async", slow_call)
    first = instance.submit_requests([_job(-4)])
    second = instance.submit_requests([_job(6)])
    (error,), _, _ = await asyncio.wait_for(first, 30)
    assert isinstance(error, KilnError) and "elsewhere" in error.message
    (out,), _, _ = await asyncio.wait_for(second, 30)
    assert out["OUT"].tolist() == [[12, 12]]
    assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]


async def test_while_a_batch_runs_on_the_thread_path_the_next_ones_wait_for_it(
    instance: Instance,
) -> None:
    """After a restart the batch that waited for it runs on the instance's thread, reading
    the worker's pipe itself; a batch arriving meanwhile (the second pipeline slot) must
    not start on the loop and share that pipe: it waits, then runs on the loop."""
    backend = _backend(instance)
    hung = instance.submit_requests([_job(-3)])
    slow = instance.submit_requests([_job(-5)])  # 1.2 s, rerun on the thread path
    await asyncio.sleep(0.3)
    assert backend.worker.proc is not None
    backend.worker.proc.kill()
    (error,), _, _ = await asyncio.wait_for(hung, 30)
    assert isinstance(error, KilnError) and "signal 9" in error.message
    for _ in range(3000):  # until the restart is over and `slow` computes on the thread
        if backend.session.restart_thread is None and instance._thread_calls:
            break
        await asyncio.sleep(0.01)
    assert backend.session.restart_thread is None and instance._thread_calls == 1
    driven = instance.loop_driven_calls
    late = instance.submit_requests([_job(5)])
    assert instance.loop_driven_calls == driven  # not on the loop while `slow` runs
    assert instance._thread_calls == 1  # nor behind it on the thread
    (a,), _, _ = await asyncio.wait_for(slow, 30)
    (b,), _, _ = await asyncio.wait_for(late, 30)
    assert a["OUT"].tolist() == [[-10, -10]] and b["OUT"].tolist() == [[10, 10]]
    assert instance._thread_calls == 0
    assert instance.loop_driven_calls == driven + 1  # `late` ran on the loop
    (c,), _, _ = await asyncio.wait_for(instance.submit_requests([_job(1)]), 30)
    assert c["OUT"].tolist() == [[2, 2]]
    assert instance.loop_driven_calls == driven + 2


async def test_a_loaded_instance_returns_to_the_loop_after_a_restart(tmp_path: Path) -> None:
    """Four callers keep the instance busy through a worker restart. Only the batches that
    waited for the restart run on the instance's thread: the rest go back to the loop,
    although each arrives while others are queued (when later batches followed the
    thread's, a busy instance never left it)."""
    instance = _instance(tmp_path, pipeline_depth="4")
    backend = _backend(instance)
    try:
        assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
        assert backend.worker.proc is not None
        backend.worker.proc.kill()
        backend.worker.proc.wait()
        driven = instance.loop_driven_calls

        async def caller(value: float) -> list[float]:
            got = []
            for _ in range(10):
                (out,) = await _run(instance, [_job(value)])
                if isinstance(out, KilnError):  # the batch that met the dead worker
                    continue
                got.append(float(out["OUT"][0, 0]))
            return got

        results = await asyncio.wait_for(asyncio.gather(*(caller(v) for v in (2, 3, 4, 5))), 60)
        for value, got in zip((2, 3, 4, 5), results, strict=True):
            assert got and set(got) == {2 * value}
        on_the_loop = instance.loop_driven_calls - driven
        assert on_the_loop >= 30, on_the_loop  # of 40: the thread took the first few only
        assert instance._thread_calls == 0 and instance._behind_thread == []
    finally:
        instance.close()


async def test_a_caller_that_goes_away_keeps_its_slot_until_its_batch_ends(
    tmp_path: Path,
) -> None:
    """As many callers as the pipe holds give up on long batches (a client disconnect
    cancels its task): the scheduler must not hand their slots to others while those
    batches are still in the worker's pipe (their arenas would be overwritten), and later
    callers get their own answers."""
    instance = _instance(tmp_path, pipeline_depth="2")
    from kiln.backends.python import loopcall
    from kiln.core.stats import ModelStats
    from kiln.scheduling.direct import DirectScheduler

    depths: list[int] = []
    submit = loopcall.WorkerPipe.submit

    def watched(pipe: loopcall.WorkerPipe, *args: Any) -> None:
        depths.append(len(pipe.calls))  # batches already in the pipe
        submit(pipe, *args)

    loopcall.WorkerPipe.submit = watched  # type: ignore[method-assign]
    try:
        scheduler = DirectScheduler([instance], ModelStats(), "double")
        gone = [asyncio.ensure_future(scheduler.schedule(_job(-5))) for _ in range(2)]
        await asyncio.sleep(0.2)
        for task in gone:
            task.cancel()
        values = (3.0, 4.0, 5.0, 6.0)
        outs = await asyncio.wait_for(
            asyncio.gather(*(scheduler.schedule(_job(v)) for v in values)), 30
        )
        assert [o["OUT"].tolist() for o in outs] == [[[2 * v, 2 * v]] for v in values]
        assert max(depths) < 2
    finally:
        loopcall.WorkerPipe.submit = submit  # type: ignore[method-assign]
        instance.close()


# ---- review: BLS answers and deadlines across a restart ------------------------------------
BLS_ECHO = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        out = []
        for r in requests:
            x = pb_utils.get_input_tensor_by_name(r, "IN").as_numpy()
            reply = pb_utils.InferenceRequest(
                model_name="elsewhere", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", x)]).exec()
            if reply.has_error():
                out.append(pb_utils.InferenceResponse(error=reply.error()))
                continue
            got = pb_utils.get_output_tensor_by_name(reply, "OUT").as_numpy()
            out.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUT", got)]))
        return out
"""


async def test_a_bls_answer_for_a_killed_worker_does_not_reach_its_successor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch overruns its request's timeout while its BLS call is still out (a task of
    the loop): the worker is killed and restarted. When that BLS call returns late, its
    answer belongs to nobody: it must not be sent to the new worker, where the next
    batch's own BLS call (on the instance's thread, the first batch after a restart, or
    on the loop) would take it as its answer."""
    import threading

    from kiln.backends.python import bls

    instance = Instance(
        PythonBackend(parse_config_text(CONFIG), _model(tmp_path, BLS_ECHO), SPEC), "double"
    )
    second_asked = threading.Event()
    stale_done = threading.Event()  # the first call's answer went out, or was dropped

    def second_call(request: Any) -> Any:
        x = request.inputs[0].data
        second_asked.set()
        stale_done.wait(20)
        return {"OUT": x + 1}, {}  # outputs, the response's parameters

    async def fake_call(request: Any) -> Any:
        x = request.inputs[0].data
        if x.flat[0] != 100:
            return await asyncio.to_thread(second_call, request)
        # the first batch's call: answered only once the second asks
        await asyncio.to_thread(second_asked.wait, 20)
        return {"OUT": x + 1}, {}

    answer = BlsBroker._call_async

    async def watched(self: BlsBroker, call: Any, inputs: dict[str, np.ndarray], pipe: Any) -> None:
        try:
            await answer(self, call, inputs, pipe)
        finally:
            if next(iter(inputs.values())).flat[0] == 100:
                stale_done.set()

    monkeypatch.setattr(bls, "call_async", fake_call)
    monkeypatch.setattr(bls, "call", second_call)
    monkeypatch.setattr(BlsBroker, "_call_async", watched)
    try:
        soon = time.monotonic_ns() + 300_000_000
        (error,) = await asyncio.wait_for(_run(instance, [_job(100, deadline_ns=soon)]), 30)
        assert isinstance(error, KilnError) and "Request timeout expired" in error.message
        (out,) = await asyncio.wait_for(_run(instance, [_job(200)]), 30)
        assert not isinstance(out, KilnError), out
        assert out["OUT"].tolist() == [[201, 201]]  # its own answer, not the stale 101
    finally:
        instance.close()


def test_a_batch_answered_before_its_overdue_timer_runs_is_not_killed(tmp_path: Path) -> None:
    """uvloop runs due timers before it polls for I/O: when the loop was held up past a
    batch's deadline (a long callback, a GC pause) while the worker had answered in time,
    the deadline timer runs first. The answer is already there: the batch must get it, the
    worker must not be killed, and the batch queued behind it must not run twice."""
    import uvloop

    config = parse_config_text(
        CONFIG
        + 'parameters { key: "execute_timeout_secs" value { string_value: "0.5" } }'
        + 'parameters { key: "busy_poll_us" value { string_value: "0" } }'
    )
    # 0.2 s a batch: their answers surely come after the loop has polled for I/O
    backend = PythonBackend(config, _model(tmp_path, SLOW.replace("0.005", "0.2")), SPEC)
    instance = Instance(backend, "double")
    old = backend.worker.pid

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        other, poke = socketpair()  # another connection of the server's, slow to serve

        def slow_reader() -> None:
            loop.remove_reader(other.fileno())
            time.sleep(1.5)  # the worker answers both batches meanwhile

        loop.add_reader(other.fileno(), slow_reader)
        first = instance.submit_requests([_job(1)])
        second = instance.submit_requests([_job(2)])
        poke.send(b"x")
        try:
            return [(await first)[0], (await second)[0]]
        finally:
            other.close()
            poke.close()

    try:
        (a,), (b,) = uvloop.run(main())
        assert not isinstance(a, KilnError), a
        assert not isinstance(b, KilnError), b
        assert a["OUT"].tolist() == [[2, 2]] and b["OUT"].tolist() == [[4, 4]]
        assert backend.worker.pid == old  # not killed
    finally:
        instance.close()


async def test_a_batch_sent_to_a_worker_that_died_idle_runs_on_its_successor(
    instance: Instance,
) -> None:
    """The worker died between requests: sending the next batch fails, so the worker never
    had it; it runs on the restarted worker instead of failing as if it had been running."""
    backend = _backend(instance)
    assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
    old = backend.worker.pid
    assert backend.worker.proc is not None
    backend.worker.proc.kill()
    backend.worker.proc.wait()
    (out,), _, _ = await asyncio.wait_for(instance.submit_requests([_job(7)]), 30)
    assert not isinstance(out, KilnError), out
    assert out["OUT"].tolist() == [[14, 14]]
    assert backend.worker.pid != old


async def test_the_server_counts_its_requests_in_flight_for_busy_polling(tmp_path: Path) -> None:
    """Through a loaded model (``ModelRuntime.infer``): a lone request busy-polls; of a
    burst, the ones that overlap others do not (were requests not counted, all would);
    the count returns to zero, also after a refused request. The count is the one the
    server owns and gives the runtimes it builds (``runtime_factory``), not a global."""
    from kiln.core.activity import Activity
    from kiln.core.types import DataType, InferenceRequest, InferInput
    from kiln.repository.manager import RepositoryManager
    from kiln.server.runtime import runtime_factory

    _model(tmp_path)
    (tmp_path / "double" / "config.pbtxt").write_text(
        CONFIG + 'parameters { key: "busy_poll_us" value { string_value: "50000" } }'
    )
    activity = Activity()
    manager = RepositoryManager([tmp_path], runtime_factory(activity=activity))
    await manager.load("double")
    try:
        runtime = manager.get("double")
        assert runtime.scheduler is not None
        backend = _backend(runtime.scheduler.instances[0])
        assert runtime.activity is activity and backend.activity is activity

        def request(value: float, width: int = 2) -> InferenceRequest:
            data = np.full((1, width), value, np.float32)
            return InferenceRequest(
                "double", inputs=[InferInput("IN", DataType.FP32, (1, width), data)]
            )

        assert (await runtime.infer(request(1))).outputs[0].data.tolist() == [[2, 2]]
        assert backend.busy_polled_calls == 1 and activity.inflight == 0
        burst = await asyncio.gather(*(runtime.infer(request(v)) for v in range(2, 8)))
        assert [r.outputs[0].data.tolist() for r in burst] == [[[2 * v] * 2] for v in range(2, 8)]
        assert backend.busy_polled_calls < 7
        assert activity.inflight == 0
        with pytest.raises(KilnError):
            await runtime.infer(InferenceRequest("double", inputs=[]))  # no input IN
        assert activity.inflight == 0
    finally:
        await manager.unload_all()


# ---- a decoupled execute that raises while its threads still send ----------------------------
LATE = """
import threading
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.late_error = ""

    def execute(self, requests):
        x = pb_utils.get_input_tensor_by_name(requests[0], "IN").as_numpy()
        sender = requests[0].get_response_sender()
        if x.flat[0] < 0:
            def late():
                time.sleep(0.2)
                try:
                    sender.send(pb_utils.InferenceResponse(
                        output_tensors=[pb_utils.Tensor("OUT", x)]),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except pb_utils.TritonModelException as exc:
                    self.late_error = str(exc)
            threading.Thread(target=late).start()
            raise ValueError("execute failed after starting a thread")
        time.sleep(0.6)  # the first request's thread sends meanwhile
        refused = np.float32(1 if "execute raised" in self.late_error else 0)
        out = pb_utils.Tensor("OUT", x + refused)
        sender.send(pb_utils.InferenceResponse(output_tensors=[out]))
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


async def test_a_decoupled_execute_that_raises_closes_its_senders(tmp_path: Path) -> None:
    """The error ends each open request of the batch as its final response; a thread of the
    model's that sends later is refused, so nothing it sends reaches the next batch."""
    config = parse_config_text(CONFIG + "model_transaction_policy { decoupled: true }")
    instance = Instance(PythonBackend(config, _model(tmp_path, LATE), SPEC), "double")
    try:
        failed, after = _AnySink(), _AnySink()
        assert await _run(instance, [_job(-1, sink=failed)]) == [{}]
        ((out, final, error),) = failed.items
        assert out is None and final
        assert isinstance(error, KilnError) and error.status is Status.INTERNAL
        assert error.message == (
            "model 'double' failed to execute: ValueError: execute failed after starting a thread"
        )
        assert await _run(instance, [_job(5, sink=after)]) == [{}]
        # its own two responses only, the first saying the late send was refused
        assert after.items == [([[6.0, 6.0]], False, None), (None, True, None)]
        assert failed.items == [(None, True, error)]
        # nobody streams a warm-up's responses: its outcome carries the error
        (outcome,) = await _run(instance, [_job(-1)])
        assert isinstance(outcome, KilnError) and "execute failed after" in outcome.message
    finally:
        instance.close()


# ---- request cancellation: is_cancelled() -----------------------------------------------------
UNTIL_CANCELLED = """
import time
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        request = requests[0]
        sender = request.get_response_sender()
        x = pb_utils.get_input_tensor_by_name(request, "IN").as_numpy()
        for i in range(4000):  # 20 s of responses unless the client goes away
            if sender.is_cancelled():
                seen = np.float32(-1 if request.is_cancelled() else -2)
                sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x * 0 + seen)]),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                return None
            sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("OUT", x + i)]))
            time.sleep(0.005)
        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


@pytest.mark.parametrize("path", ["loop", "thread"])
async def test_a_cancelled_stream_is_seen_by_the_running_model(tmp_path: Path, path: str) -> None:
    """``Job.cancel`` (its client went away) sets the request's byte: the model's
    ``is_cancelled()`` turns true while ``execute`` runs, on both of the backend's paths."""
    config = parse_config_text(CONFIG + "model_transaction_policy { decoupled: true }")
    instance = Instance(PythonBackend(config, _model(tmp_path, UNTIL_CANCELLED), SPEC), "double")
    try:
        sink = _AnySink()
        jobs = [_job(3, sink=sink)]
        if path == "loop":
            task = asyncio.ensure_future(_run(instance, jobs))
        else:  # the instance's thread drives the worker (as after a restart)
            backend = _backend(instance)
            task = asyncio.ensure_future(asyncio.to_thread(backend.execute_requests, jobs))
        deadline = time.monotonic() + 30
        while len(sink.items) < 3:
            assert time.monotonic() < deadline, "no responses"
            await asyncio.sleep(0.005)
        assert [out for out, _, _ in sink.items[:3]] == [[[3, 3]], [[4, 4]], [[5, 5]]]
        jobs[0].cancel()
        assert await asyncio.wait_for(task, 30) == [{}]
        last_out, last_final, _ = sink.items[-1]
        assert last_final and last_out == [[-1, -1]]  # the request saw it too
        assert len(sink.items) < 4000
    finally:
        instance.close()


async def test_a_cancel_after_the_batch_ended_writes_nothing(tmp_path: Path) -> None:
    """A request's cancellation byte serves another request once its batch has ended: a
    late cancel must not flip it."""
    config = parse_config_text(CONFIG + "model_transaction_policy { decoupled: true }")
    instance = Instance(PythonBackend(config, _model(tmp_path, STREAM), SPEC), "double")
    try:
        job = _job(1, sink=_AnySink())
        assert await _run(instance, [job]) == [{}]
        backend = _backend(instance)
        freed = backend.session.flag_pool._free[-1]  # the request's byte, back in the pool
        wire, watch = backend.codec.encode([_job(7)], 0)  # the next batch: its byte where ours was
        assert wire[0]["cancel_at"] == freed
        job.cancel()  # the first request's callback runs now
        assert not backend.worker.flags.flag(wire[0]["cancel_at"])
        watch.end()
    finally:
        instance.close()


RETURNS_A_LIST = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [pb_utils.InferenceResponse([]) for _ in requests]
"""


async def test_a_decoupled_execute_that_returns_responses_ends_each_request_with_an_error(
    tmp_path: Path,
) -> None:
    config = parse_config_text(CONFIG + "model_transaction_policy { decoupled: true }")
    instance = Instance(PythonBackend(config, _model(tmp_path, RETURNS_A_LIST), SPEC), "double")
    try:
        sinks = [_AnySink(), _AnySink()]
        assert await _run(instance, [_job(1, sink=sinks[0]), _job(2, sink=sinks[1])]) == [{}, {}]
        for sink in sinks:
            ((out, final, error),) = sink.items
            assert out is None and final and isinstance(error, KilnError)
            assert error.message == (
                "model 'double' failed to execute: a decoupled model's execute must return None"
            )
    finally:
        instance.close()


# ---- a decoupled BLS stream relayed on the instance's thread --------------------------------
RELAY = """
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            call = pb_utils.InferenceRequest(
                model_name="many", requested_output_names=["OUT"],
                inputs=[pb_utils.Tensor("IN", np.zeros(1, np.float32))])
            for response in call.exec(decoupled=True):
                if response.output_tensors():
                    sender.send(pb_utils.InferenceResponse(response.output_tensors()))
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
"""


class _CountingSink:
    window = 0

    def on_credit(self, grant: Any) -> None:
        raise AssertionError("no window: nothing to grant")

    def __init__(self) -> None:
        self.count = 0
        self.final = False

    def send(self, outputs: Any, final: bool, error: Any, parameters: Any = None) -> None:
        assert error is None, error
        self.count += outputs is not None
        self.final = self.final or final


async def test_a_long_bls_stream_relayed_on_the_thread_path_does_not_deadlock(
    tmp_path: Path,
) -> None:
    """On the instance's thread (the sequence batcher's path, and the one after a restart)
    the server must keep reading the worker while it writes a BLS stream's parts to it: a
    model relaying each part as a response fills the worker's socket otherwise, and both
    sides wait on each other's full buffer until the execute timeout kills the worker."""
    from kiln.backends import host
    from kiln.core.types import DataType, InferenceResponse, InferOutput

    count = 20_000  # far more than both socket buffers hold

    async def many(request: Any) -> Any:
        for i in range(count):
            value = np.full(1, i, np.float32)
            out = InferOutput("OUT", DataType.FP32, (1,), value)
            yield InferenceResponse("many", "1", outputs=[out], parameters={
                "triton_final_response": False})  # fmt: skip
        yield InferenceResponse("many", "1", parameters={"triton_final_response": True})

    async def infer(request: Any) -> Any:
        raise AssertionError("unary BLS not expected")

    config = parse_config_text(
        CONFIG
        + "model_transaction_policy { decoupled: true }"
        + 'parameters { key: "execute_timeout_secs" value { string_value: "60" } }'
    )
    backend = PythonBackend(config, _model(tmp_path, RELAY), SPEC)
    host.install(infer, asyncio.get_running_loop(), many)
    try:
        sink = _CountingSink()
        job = _job(1, sink=sink)
        (outcome,) = await asyncio.wait_for(asyncio.to_thread(backend.execute_requests, [job]), 120)
        assert outcome == {}, outcome
        assert sink.count == count and sink.final
    finally:
        host.uninstall(infer)
        # Deadlocked, the instance's thread would hold the worker's send lock for ever
        # (blocked in a write that the execute timeout does not reach): killing the
        # worker ends that write, so a regression fails here instead of hanging.
        assert backend.worker.proc is not None
        backend.worker.proc.kill()
        backend.close()


async def test_a_batch_told_late_to_run_again_queues_behind_the_new_workers_batch(
    tmp_path: Path,
) -> None:
    """A batch queued behind a lost worker is told to run again (``NotStarted``) once the
    restart has begun. When that word comes late (the thread taking the lost worker's exit
    status stalls, as on a loaded machine) the restart may be over and a batch of the loop's
    already in the new worker's pipe: the late batch must queue behind it there. On the
    instance's thread it would read the same pipe at once, and one of the two readers
    would wait for good for an answer the other took."""
    instance = _instance(tmp_path, pipeline_depth="2")
    backend = _backend(instance)
    session = backend.session
    begin = session.begin_restart
    stalled = threading.Event()

    def stalling(cause: str, conn: Any) -> None:
        begin(cause, conn)
        stalled.wait(30)

    session.begin_restart = stalling  # type: ignore[method-assign]
    try:
        assert (await _run(instance, [_job(1)]))[0]["OUT"].tolist() == [[2, 2]]
        lost = asyncio.ensure_future(_run(instance, [_job(-3)]))  # sleeps in the worker
        await asyncio.sleep(0.3)
        late = asyncio.ensure_future(_run(instance, [_job(2)]))  # queued behind it
        await asyncio.sleep(0.1)
        assert backend.worker.proc is not None
        backend.worker.proc.kill()
        deadline = time.monotonic() + 30
        while not session.restarting:
            assert time.monotonic() < deadline, "the restart did not begin"
            await asyncio.sleep(0.01)
        # the next batch waits out the restart on the instance's thread
        (after,) = await asyncio.wait_for(_run(instance, [_job(3)]), 60)
        assert not isinstance(after, KilnError), after.message
        assert after["OUT"].tolist() == [[6, 6]]
        assert not session.restarting and not late.done() and not lost.done()
        slow = asyncio.ensure_future(_run(instance, [_job(-5)]))  # 1.2 s in the new worker
        await asyncio.sleep(0.2)
        stalled.set()  # now the lost batch gets its error, the late one runs again
        (died,) = await asyncio.wait_for(lost, 30)
        assert isinstance(died, KilnError) and "stopped while executing" in died.message
        (first,) = await asyncio.wait_for(slow, 30)
        (second,) = await asyncio.wait_for(late, 30)
        assert first["OUT"].tolist() == [[-10, -10]]
        assert second["OUT"].tolist() == [[4, 4]]
    finally:
        stalled.set()
        instance.close()
