"""Batch formation of the dynamic batcher, driven through ModelRuntime with a gated backend.

The backend blocks any batch that holds a HOLD row until the test releases it, so tests
fill the queue while an instance is busy and then inspect exactly which batches formed.
Nothing here measures time: waits only guard against a hang.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError, Status
from kiln.core.types import DataType, InferenceRequest, InferenceResponse, InferInput
from kiln.scheduling.dynamic import DynamicScheduler
from kiln.server.runtime import ModelRuntime

HOLD = 999.0  # a row starting with this blocks its batch until Gate.release is set
FAIL = -1.0  # a row starting with this makes its batch raise


@dataclass
class Gate:
    release: threading.Event = field(default_factory=threading.Event)
    batches: list[tuple[int, np.ndarray]] = field(default_factory=list)  # (instance, INPUT)
    finished: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def firsts(self) -> list[list[float]]:
        """Each batch as the list of its rows' first values, in execution order."""
        return [[float(v) for v in batch[:, 0]] for _, batch in self.batches]


class GatedBackend(Backend):
    name: ClassVar[str] = "gated"
    gate: ClassVar[Gate]

    def execute(
        self, inputs: dict[str, np.ndarray], output_names: list[str]
    ) -> dict[str, np.ndarray]:
        data = inputs["INPUT"]
        rows = data.reshape(-1, data.shape[-1])  # max_batch_size 0: one bare row
        with self.gate.lock:
            self.gate.batches.append((self.instance.index, rows.copy()))
        if HOLD in rows[:, 0]:
            assert self.gate.release.wait(10), "test never released the gate"
        if FAIL in rows[:, 0]:
            raise ValueError("the gated model refuses negative rows")
        with self.gate.lock:
            self.gate.finished += 1
        return {"OUT": data * 2, "ROWS": np.full((rows.shape[0], 1), rows.shape[0], np.int32)}


CONFIG = """
name: "gated"
max_batch_size: {mbs}
input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ -1 ] }} ]
output [ {{ name: "OUT" data_type: TYPE_FP32 dims: [ -1 ] }},
         {{ name: "ROWS" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: {count} kind: KIND_CPU }} ]
dynamic_batching {{ {batching} }}
"""

Factory = Callable[..., Any]


@pytest.fixture
async def make_runtime(tmp_path: Path) -> AsyncIterator[Factory]:
    runtimes: list[ModelRuntime] = []
    gates: list[Gate] = []

    async def make(batching: str = "", mbs: int = 8, count: int = 1) -> tuple[ModelRuntime, Gate]:
        config = text_format.Parse(
            CONFIG.format(mbs=mbs, count=count, batching=batching), ModelConfig()
        )
        gate = Gate()
        backend = type("Gated", (GatedBackend,), {"gate": gate})
        runtime = ModelRuntime("gated", 1, config, tmp_path, backend)
        await runtime.load()
        runtimes.append(runtime)
        gates.append(gate)
        return runtime, gate

    yield make
    for gate in gates:
        gate.release.set()
    for runtime in runtimes:
        await runtime.unload(5)


def request(
    first: float, rows: int = 1, width: int = 4, rank1: bool = False, **params: Any
) -> InferenceRequest:
    data = np.full((rows, width), first, np.float32)
    data[:, 1:] = np.arange(1, width, dtype=np.float32)  # rows distinguishable from one another
    data[:, 1] += np.arange(rows, dtype=np.float32) / 10
    if rank1:  # a model without a batch dimension takes the bare [-1] tensor
        data = data[0]
    tensor = InferInput("INPUT", DataType.FP32, data.shape, data)
    return InferenceRequest("gated", inputs=[tensor], parameters=dict(params))


def submit(runtime: ModelRuntime, req: InferenceRequest) -> asyncio.Task[InferenceResponse]:
    return asyncio.create_task(runtime.infer(req))


async def until(condition: Callable[[], bool]) -> None:
    """Yield to the loop until ``condition`` holds (the bound only stops a hung test)."""
    for _ in range(5000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition never became true")


def batcher(runtime: ModelRuntime) -> DynamicScheduler:
    assert isinstance(runtime.scheduler, DynamicScheduler)
    return runtime.scheduler


def pending(runtime: ModelRuntime) -> int:
    return batcher(runtime).pending


async def hold_instance(
    runtime: ModelRuntime, gate: Gate, rows: int = 1
) -> asyncio.Task[InferenceResponse]:
    """Occupy one instance with a HOLD request; returns once it is executing."""
    started = len(gate.batches)
    task = submit(runtime, request(HOLD, rows=rows))
    await until(lambda: len(gate.batches) > started)
    return task


def out(response: InferenceResponse, name: str = "OUT") -> np.ndarray:
    return next(o.data for o in response.outputs if o.name == name)


async def test_runtime_picks_the_dynamic_batcher(make_runtime: Factory) -> None:
    runtime, _ = await make_runtime()
    assert batcher(runtime).max_batch_size == 8


async def test_requests_queued_while_busy_merge_up_to_max_batch_size(
    make_runtime: Factory,
) -> None:
    runtime, gate = await make_runtime(mbs=4)
    held = await hold_instance(runtime, gate)
    tasks = [submit(runtime, request(float(i))) for i in range(6)]
    await until(lambda: pending(runtime) == 6)
    gate.release.set()
    responses = await asyncio.gather(held, *tasks)
    assert gate.firsts() == [[HOLD], [0, 1, 2, 3], [4, 5]]
    for i, response in enumerate(responses[1:]):
        np.testing.assert_array_equal(out(response), request(float(i)).inputs[0].data * 2)
        assert out(response, "ROWS").tolist() == [[4 if i < 4 else 2]]
    stats = runtime.stats.to_json("gated", "1")
    assert stats["execution_count"] == 3
    assert stats["inference_count"] == 7
    assert [b["batch_size"] for b in stats["batch_stats"]] == [1, 2, 4]
    assert stats["inference_stats"]["success"]["count"] == 7
    assert stats["inference_stats"]["queue"]["count"] == 7
    assert pending(runtime) == 0


async def test_mixed_request_batch_sizes_split_back_exactly(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(mbs=8)
    held = await hold_instance(runtime, gate)
    sizes = [3, 1, 4, 2]
    reqs = [request(float(10 + i), rows=n) for i, n in enumerate(sizes)]
    tasks = [submit(runtime, r) for r in reqs]
    await until(lambda: pending(runtime) == 4)
    gate.release.set()
    responses = await asyncio.gather(*tasks)
    await held
    assert [len(b) for b in gate.firsts()] == [1, 8, 2]
    for req, response in zip(reqs, responses, strict=True):
        np.testing.assert_array_equal(out(response), req.inputs[0].data * 2)
    stats = runtime.stats.to_json("gated", "1")
    assert stats["inference_count"] == 1 + sum(sizes)
    assert stats["execution_count"] == 3


async def test_requests_with_different_variable_dims_are_not_merged(
    make_runtime: Factory,
) -> None:
    runtime, gate = await make_runtime(mbs=8)
    held = await hold_instance(runtime, gate)
    widths = [4, 4, 3, 4]
    reqs = [request(float(i), width=w) for i, w in enumerate(widths)]
    tasks = [submit(runtime, r) for r in reqs]
    await until(lambda: pending(runtime) == 4)
    gate.release.set()
    responses = await asyncio.gather(held, *tasks)
    # The width-3 request cuts the queue: merging past it would reorder requests.
    assert gate.firsts()[1:] == [[0, 1], [2], [3]]
    for req, response in zip(reqs, responses[1:], strict=True):
        np.testing.assert_array_equal(out(response), req.inputs[0].data * 2)


async def test_preferred_batch_size_runs_at_once_without_waiting_out_the_delay(
    make_runtime: Factory,
) -> None:
    # A delay of 100 s: only reaching the preferred size can make these batches run.
    runtime, gate = await make_runtime(
        "preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 100000000", mbs=8
    )
    first = [submit(runtime, request(float(i))) for i in range(3)]
    await until(lambda: pending(runtime) == 3)
    await asyncio.sleep(0.05)  # give the batcher every chance to (wrongly) run early
    assert gate.batches == []
    first.append(submit(runtime, request(3.0)))
    await asyncio.gather(*first)
    assert gate.firsts() == [[0, 1, 2, 3]]


async def test_preferred_batch_size_is_cut_from_a_longer_queue(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(
        "preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100000000", mbs=8
    )
    held = await hold_instance(runtime, gate, rows=2)  # a preferred size: runs at once
    tasks = [submit(runtime, request(float(i))) for i in range(5)]
    await until(lambda: pending(runtime) == 5)
    gate.release.set()
    await asyncio.gather(held, *tasks[:4])
    await until(lambda: pending(runtime) == 1)
    assert gate.firsts()[1:] == [[0, 1, 2, 3]]  # the largest preferred size, at once
    tasks.append(submit(runtime, request(5.0)))
    await asyncio.gather(*tasks[4:])
    assert gate.firsts()[2:] == [[4, 5]]


async def test_delay_expiry_runs_what_is_queued(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(
        "preferred_batch_size: [ 4 ] max_queue_delay_microseconds: 2000", mbs=8
    )
    # Created together, both are queued before the batcher looks at the queue.
    responses = await asyncio.gather(*(submit(runtime, request(float(i))) for i in range(2)))
    assert gate.firsts() == [[0, 1]]
    assert [out(r, "ROWS").tolist() for r in responses] == [[[2]], [[2]]]


async def test_higher_priority_requests_run_first(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime("priority_levels: 3 default_priority_level: 2", mbs=1)
    held = await hold_instance(runtime, gate)
    tasks = [
        submit(runtime, request(1.0, priority=3)),
        submit(runtime, request(2.0)),  # no priority: default level 2
        submit(runtime, request(3.0, priority=1)),
        submit(runtime, request(4.0, priority=0)),  # 0 = default level too
        submit(runtime, request(5.0, priority=2)),
    ]
    await until(lambda: pending(runtime) == 5)
    gate.release.set()
    await asyncio.gather(held, *tasks)
    assert gate.firsts()[1:] == [[3], [2], [4], [5], [1]]


@pytest.mark.parametrize(
    ("batching", "priority", "expected"),
    [
        ("priority_levels: 2 default_priority_level: 1", 3, "priority 3 is out of range"),
        ("", 1, "priority 1 is out of range"),
        ("priority_levels: 2 default_priority_level: 1", -1, "must be an unsigned integer"),
        ("priority_levels: 2 default_priority_level: 1", "high", "must be an unsigned integer"),
    ],
)
async def test_bad_priority_is_refused_and_the_model_keeps_serving(
    make_runtime: Factory, batching: str, priority: Any, expected: str
) -> None:
    runtime, _ = await make_runtime(batching)
    with pytest.raises(KilnError) as err:
        await runtime.infer(request(1.0, priority=priority))
    assert err.value.status is Status.INVALID_ARG
    assert expected in err.value.message and "'gated'" in err.value.message
    response = await runtime.infer(request(2.0))
    np.testing.assert_array_equal(out(response), request(2.0).inputs[0].data * 2)
    assert runtime.stats.to_json("gated", "1")["inference_stats"]["fail"]["count"] == 1


async def test_reject_timeout_fails_the_queued_request(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(
        "default_queue_policy { timeout_action: REJECT default_timeout_microseconds: 1000 }"
    )
    held = await hold_instance(runtime, gate)  # dispatched at once: its timer never fires
    with pytest.raises(KilnError) as err:
        await runtime.infer(request(1.0))  # expires while the instance is held
    assert err.value.status is Status.UNAVAILABLE
    assert err.value.message == "Request timeout expired"
    assert pending(runtime) == 0
    gate.release.set()
    await held
    assert gate.firsts() == [[HOLD]]  # the expired request never reached the model


async def test_delay_timeout_moves_the_request_behind_but_runs_it(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(
        "default_queue_policy { timeout_action: DELAY allow_timeout_override: true }", mbs=1
    )
    held = await hold_instance(runtime, gate)
    late = submit(runtime, request(1.0, timeout=1000))
    await until(lambda: batcher(runtime).queue.delayed == 1)
    others = [submit(runtime, request(2.0)), submit(runtime, request(3.0))]
    await until(lambda: pending(runtime) == 3)
    gate.release.set()
    await asyncio.gather(held, late, *others)
    assert gate.firsts()[1:] == [[2], [3], [1]]


async def test_request_timeout_overrides_only_when_allowed(make_runtime: Factory) -> None:
    allowed, gate_a = await make_runtime(
        "default_queue_policy { default_timeout_microseconds: 100000000 "
        "allow_timeout_override: true }"
    )
    held = await hold_instance(allowed, gate_a)
    with pytest.raises(KilnError, match="Request timeout expired"):
        await allowed.infer(request(1.0, timeout=1000))  # shorter than the 100 s default
    gate_a.release.set()
    await held

    refused, gate_r = await make_runtime("default_queue_policy { allow_timeout_override: false }")
    held = await hold_instance(refused, gate_r)
    task = submit(refused, request(1.0, timeout=1000))
    await until(lambda: pending(refused) == 1)
    await asyncio.sleep(0.05)  # far past its 1 ms: the override must have been ignored
    assert not task.done() and pending(refused) == 1
    gate_r.release.set()
    await asyncio.gather(held, task)
    assert gate_r.firsts() == [[HOLD], [1]]


async def test_full_queue_rejects_at_once(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime("default_queue_policy { max_queue_size: 2 }")
    held = await hold_instance(runtime, gate)
    queued = [submit(runtime, request(1.0)), submit(runtime, request(2.0))]
    await until(lambda: pending(runtime) == 2)
    for _ in range(3):
        with pytest.raises(KilnError) as err:
            await runtime.infer(request(3.0))
        assert err.value.status is Status.UNAVAILABLE
        assert err.value.message.startswith("Exceeds maximum queue size")
        assert "'gated'" in err.value.message
    assert pending(runtime) == 2
    gate.release.set()
    await asyncio.gather(held, *queued)
    assert gate.firsts() == [[HOLD], [1, 2]]


async def test_priority_queue_policy_applies_per_level(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(
        "priority_levels: 2 default_priority_level: 2 "
        "priority_queue_policy { key: 1 value { max_queue_size: 1 } }"
    )
    held = await hold_instance(runtime, gate)
    first = submit(runtime, request(1.0, priority=1))
    await until(lambda: pending(runtime) == 1)
    with pytest.raises(KilnError, match="Exceeds maximum queue size"):
        await runtime.infer(request(2.0, priority=1))
    low = [submit(runtime, request(3.0 + i)) for i in range(3)]  # level 2: unbounded
    await until(lambda: pending(runtime) == 4)
    gate.release.set()
    await asyncio.gather(held, first, *low)


@pytest.mark.parametrize(("preserve", "expected"), [(True, [HOLD, 1.0]), (False, [1.0, HOLD])])
async def test_preserve_ordering_holds_back_later_batches(
    make_runtime: Factory, preserve: bool, expected: list[float]
) -> None:
    runtime, gate = await make_runtime(f"preserve_ordering: {str(preserve).lower()}", count=2)
    answered: list[float] = []
    held = await hold_instance(runtime, gate)
    fast = submit(runtime, request(1.0))
    held.add_done_callback(lambda _: answered.append(HOLD))
    fast.add_done_callback(lambda _: answered.append(1.0))
    await until(lambda: gate.finished == 1)  # the later batch computed on the other instance
    if preserve:
        await asyncio.sleep(0.02)  # time for its answer to go out, were it allowed to
        assert not fast.done()
    else:
        await fast  # answers while the earlier batch still computes
        assert not held.done()
    gate.release.set()
    await asyncio.gather(held, fast)
    assert answered == expected
    assert [index for index, _ in gate.batches] == [0, 1]


async def test_instances_run_batches_concurrently(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(mbs=1, count=2)
    held = await hold_instance(runtime, gate)
    response = await runtime.infer(request(1.0))  # completes while instance 0 is held
    np.testing.assert_array_equal(out(response), request(1.0).inputs[0].data * 2)
    assert not held.done()
    assert [index for index, _ in gate.batches] == [0, 1]
    gate.release.set()
    await held


async def test_failing_batch_fails_only_its_requests(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime(mbs=2)
    held = await hold_instance(runtime, gate)
    tasks = [submit(runtime, request(v)) for v in (FAIL, 1.0, 2.0)]
    await until(lambda: pending(runtime) == 3)
    gate.release.set()
    results = await asyncio.gather(held, *tasks, return_exceptions=True)
    assert gate.firsts()[1:] == [[FAIL, 1], [2]]
    for failed in results[1:3]:
        assert isinstance(failed, KilnError) and failed.status is Status.INTERNAL
        assert "'gated'" in failed.message
        assert "the gated model refuses negative rows" in failed.message
    assert isinstance(results[3], InferenceResponse)
    stats = runtime.stats.to_json("gated", "1")
    assert stats["inference_stats"]["fail"]["count"] == 2
    assert stats["execution_count"] == 2  # the failed batch is not counted as executed
    after = await runtime.infer(request(4.0))  # the instance keeps serving
    np.testing.assert_array_equal(out(after), request(4.0).inputs[0].data * 2)


async def test_cancelled_request_leaves_the_queue(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime()
    held = await hold_instance(runtime, gate)
    gone = submit(runtime, request(1.0))
    await until(lambda: pending(runtime) == 1)
    gone.cancel()
    await until(lambda: pending(runtime) == 0)
    gate.release.set()
    await held
    assert gate.firsts() == [[HOLD]]


async def test_unload_drains_the_queue_then_refuses(make_runtime: Factory) -> None:
    runtime, gate = await make_runtime("max_queue_delay_microseconds: 100000000", mbs=4)
    held = await hold_instance(runtime, gate, rows=4)  # a full batch: runs at once
    queued = [submit(runtime, request(float(i))) for i in range(3)]
    await until(lambda: pending(runtime) == 3)
    unloading = asyncio.create_task(runtime.unload(10))
    await until(lambda: not runtime.ready)
    with pytest.raises(KilnError) as err:
        await runtime.infer(request(9.0))
    assert err.value.status is Status.UNAVAILABLE
    gate.release.set()
    responses = await asyncio.gather(held, *queued)
    await unloading
    assert len(responses) == 4
    assert gate.firsts() == [[HOLD] * 4, [0, 1, 2]]


async def test_model_without_batch_dimension_runs_requests_one_by_one(
    make_runtime: Factory,
) -> None:
    runtime, gate = await make_runtime(mbs=0)
    reqs = [request(float(i), rank1=True) for i in range(3)]
    responses = await asyncio.gather(*(submit(runtime, r) for r in reqs))
    assert gate.firsts() == [[0], [1], [2]]
    for req, response in zip(reqs, responses, strict=True):
        np.testing.assert_array_equal(out(response), req.inputs[0].data * 2)
    assert runtime.stats.to_json("gated", "1")["execution_count"] == 3
