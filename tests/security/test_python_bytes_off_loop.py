"""A Python-backend model's BYTES tensors cross shared memory off the event loop when large.

Each BYTES element costs Python work to serialize into the worker's arena and to decode
out of it: 16 M elements (a 64 MiB request) held every client ~6 s each way. Above
``OFF_LOOP_ENCODE_ELEMENTS`` elements a batch, both run on a worker thread, while the
batches behind it keep their order. The checks are which thread did the work, and that
the server answers another model while a worker thread is held inside it; never how long
anything took.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kiln.backends.python import arena, batch_codec
from kiln.backends.python.backend import PythonBackend
from kiln.core.errors import KilnError, Status
from kiln.core.offloop import OFF_LOOP_ENCODE_ELEMENTS
from kiln.core.types import (
    DataType,
    InferenceRequest,
    InferenceResponse,
    InferInput,
    RequestedOutput,
)
from kiln.server.server import ControlMode, Server, ServerOptions

# Echoes S as T, and numbers its executes (N): the order the worker ran its requests in.
MODEL = """
import itertools
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def initialize(self, args):
        self.executed = itertools.count()

    def execute(self, requests):
        out = []
        for r in requests:
            echo = pb_utils.Tensor("T", pb_utils.get_input_tensor_by_name(r, "S").as_numpy())
            number = pb_utils.Tensor("N", np.array([next(self.executed)], np.int64))
            out.append(pb_utils.InferenceResponse([echo, number]))
        return out
"""
CONFIG = """
name: "strings"
backend: "python"
max_batch_size: 0
input [ { name: "S" data_type: TYPE_STRING dims: [ -1 ] } ]
output [
  { name: "T" data_type: TYPE_STRING dims: [ -1 ] },
  { name: "N" data_type: TYPE_INT64 dims: [ 1 ] }
]
"""
FLOATS = """
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("Y", pb_utils.get_input_tensor_by_name(r, "X").as_numpy())]
            )
            for r in requests
        ]
"""
FLOATS_CONFIG = """
name: "floats"
backend: "python"
max_batch_size: 0
input [ { name: "X" data_type: TYPE_FP32 dims: [ -1 ] } ]
output [ { name: "Y" data_type: TYPE_FP32 dims: [ -1 ] } ]
"""
COUNT = 3 * OFF_LOOP_ENCODE_ELEMENTS


class _Recorder:
    """The thread of each piece of work, and a gate that holds the first piece done off
    the loop until the test releases it."""

    def __init__(self) -> None:
        self.loop_thread = threading.get_ident()
        self.threads: list[int] = []
        self.sizes: list[int] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def saw(self, size: int = 1) -> None:
        me = threading.get_ident()
        self.threads.append(me)
        self.sizes.append(size)
        if me != self.loop_thread and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never released the worker thread"

    def on_loop(self) -> int:
        return sum(
            s for t, s in zip(self.threads, self.sizes, strict=True) if t == self.loop_thread
        )

    def off_loop(self) -> int:
        return sum(
            s for t, s in zip(self.threads, self.sizes, strict=True) if t != self.loop_thread
        )

    def wrap(self, real: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
        """A BYTES decode that records its thread and element count."""

        def recording(buffer: Any, shape: tuple[int, ...], *args: Any) -> np.ndarray:
            self.saw(int(np.prod(shape)))
            return real(buffer, shape, *args)

        return recording


class _Element:
    """A client's BYTES element that records the thread converting it to bytes (the
    shared-memory hand-off calls ``bytes()`` on each element that is not ``bytes``)."""

    __slots__ = ("data", "recorder")

    def __init__(self, data: bytes, recorder: _Recorder) -> None:
        self.data = data
        self.recorder = recorder

    def __bytes__(self) -> bytes:
        self.recorder.saw()
        return self.data


def _values(count: int, start: int = 0) -> list[bytes]:
    return [b"k%d" % i for i in range(start, start + count)]


def _request(elements: list[Any]) -> InferenceRequest:
    data = np.empty(len(elements), dtype=object)
    data[:] = elements
    return InferenceRequest(
        "strings",
        inputs=[InferInput("S", DataType.BYTES, data.shape, data)],
        outputs=[RequestedOutput("T"), RequestedOutput("N")],
    )


def _echoed(response: InferenceResponse) -> tuple[list[bytes], int]:
    out = {o.name: o.data for o in response.outputs}
    return list(out["T"]), int(out["N"][0])


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    for name, model, config in (("strings", MODEL, CONFIG), ("floats", FLOATS, FLOATS_CONFIG)):
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "1" / "model.py").write_text(model)
        (tmp_path / name / "config.pbtxt").write_text(config)
    server = Server(ServerOptions([tmp_path], ControlMode.EXPLICIT, ["strings", "floats"]))
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
def elements() -> Iterator[_Recorder]:
    """Records the conversions of ``_Element``s (a failed test's held thread is let go)."""
    recorder = _Recorder()
    yield recorder
    recorder.release.set()


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Recorder]:
    """Records every BYTES decode of the server's side of the hand-off (``Arena.read``'s,
    and the codec's for outputs decoded later)."""
    recorder = _Recorder()
    real = arena.deserialize_bytes
    monkeypatch.setattr(arena, "deserialize_bytes", recorder.wrap(real))
    monkeypatch.setattr(batch_codec, "deserialize_bytes", recorder.wrap(real), raising=False)
    yield recorder
    recorder.release.set()


def _backend(server: Server) -> PythonBackend:
    (instance,) = server.repository.get("strings", "").scheduler.instances  # type: ignore[attr-defined]
    backend = instance.backend
    assert isinstance(backend, PythonBackend)
    return backend


async def _held(recorder: _Recorder, call: asyncio.Task[Any]) -> None:
    """Until a worker thread is held in the recorded work; fails if the call ended first
    (the work ran on the loop)."""
    entered = asyncio.ensure_future(asyncio.to_thread(recorder.entered.wait, 60))
    await asyncio.wait([entered, call], return_when=asyncio.FIRST_COMPLETED)
    if not entered.done():
        recorder.entered.set()  # ends the waiting thread
    assert recorder.entered.is_set() and not call.done(), "the work ran on the event loop"


async def _until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.005)

    await asyncio.wait_for(poll(), 60)


async def _other_client(server: Server) -> None:
    """Another model's request, answered while a worker thread is held."""
    x = np.arange(8, dtype=np.float32)
    answer = await server.infer(
        InferenceRequest(
            "floats",
            inputs=[InferInput("X", DataType.FP32, x.shape, x)],
            outputs=[RequestedOutput("Y")],
        )
    )
    np.testing.assert_array_equal(answer.outputs[0].data, x)


async def test_large_bytes_inputs_are_written_to_shared_memory_off_the_loop(
    server: Server, elements: _Recorder
) -> None:
    recorder = elements
    values = _values(COUNT)
    recorder.release.clear()
    call = asyncio.create_task(server.infer(_request([_Element(v, recorder) for v in values])))
    await _held(recorder, call)
    await _other_client(server)  # served while a worker thread holds the serialization
    recorder.release.set()
    echoed, _ = _echoed(await call)
    assert echoed == values
    assert recorder.on_loop() == 0 and recorder.off_loop() == COUNT


async def test_large_bytes_outputs_are_read_from_shared_memory_off_the_loop(
    server: Server, decodes: _Recorder
) -> None:
    values = _values(COUNT)
    decodes.release.clear()
    call = asyncio.create_task(server.infer(_request(values)))
    await _held(decodes, call)
    await _other_client(server)  # served while a worker thread holds the decode
    decodes.release.set()
    echoed, _ = _echoed(await call)
    assert echoed == values
    assert decodes.on_loop() == 0 and decodes.sizes == [COUNT]


async def test_small_bytes_tensors_stay_on_the_loop_up_to_the_threshold(
    server: Server, elements: _Recorder, decodes: _Recorder
) -> None:
    recorder = elements
    for count, on_loop in ((1, True), (OFF_LOOP_ENCODE_ELEMENTS, True),
                           (OFF_LOOP_ENCODE_ELEMENTS + 1, False)):  # fmt: skip
        for r in (recorder, decodes):
            r.threads.clear()
            r.sizes.clear()
        values = _values(count)
        echoed, _ = _echoed(await server.infer(_request([_Element(v, recorder) for v in values])))
        assert echoed == values
        # no thread hop at or under the threshold; every element off the loop over it
        assert (recorder.on_loop(), recorder.off_loop()) == ((count, 0) if on_loop else (0, count))
        assert (decodes.on_loop(), decodes.off_loop()) == ((count, 0) if on_loop else (0, count))


async def test_batches_behind_a_large_one_keep_their_order(
    server: Server, elements: _Recorder
) -> None:
    """The worker runs its requests in the order they came while the first one's inputs
    are serialized on a thread; they are answered in that order too."""
    backend = _backend(server)
    recorder = elements
    large = _values(COUNT)
    recorder.release.clear()
    first = asyncio.create_task(server.infer(_request([_Element(v, recorder) for v in large])))
    await _held(recorder, first)
    behind = [asyncio.create_task(server.infer(_request(_values(2, i)))) for i in (0, 10)]
    # the two wait behind the one being serialized (or, were they sent, end meanwhile)
    await _until(lambda: backend.queued_requests >= 3 or all(c.done() for c in behind))
    assert not any(call.done() for call in behind)
    recorder.release.set()
    results = [_echoed(await call) for call in (first, *behind)]
    assert [r[0] for r in results] == [large, _values(2, 0), _values(2, 10)]
    numbers = [r[1] for r in results]
    assert numbers == sorted(numbers) and len(set(numbers)) == 3


async def test_answers_behind_a_large_output_wait_for_it(
    server: Server, decodes: _Recorder
) -> None:
    """A small batch the worker answered while a large one's outputs are decoded off the
    loop is answered after it, as batches are answered in the order they ran."""
    backend = _backend(server)
    large = _values(COUNT)
    decodes.release.clear()
    first = asyncio.create_task(server.infer(_request(large)))
    await _held(decodes, first)
    second = asyncio.create_task(server.infer(_request(_values(2, 7))))
    pipe = backend.pipe
    assert pipe is not None
    # the worker has answered it, and its output was decoded (its answer could go out)
    await _until(lambda: not pipe.calls and decodes.sizes[-1] == 2)
    await asyncio.sleep(0.05)
    assert not second.done()
    decodes.release.set()
    assert _echoed(await first)[0] == large
    assert _echoed(await second)[0] == _values(2, 7)
    assert decodes.on_loop() == 2 and decodes.off_loop() == COUNT


class _Unwritable:
    def __bytes__(self) -> bytes:
        raise RuntimeError("this element has no bytes")


async def test_a_large_batch_that_cannot_be_written_fails_alone(server: Server) -> None:
    """Its inputs fail on the worker thread: that request gets the error, the slot it was
    given goes to the next batch, and the model keeps serving in order."""
    bad = asyncio.create_task(server.infer(_request([*_values(COUNT), _Unwritable()])))
    after = asyncio.create_task(server.infer(_request(_values(3))))
    with pytest.raises(KilnError) as err:
        await bad
    assert err.value.status is Status.INTERNAL
    assert "model 'strings'" in err.value.message and "no bytes" in err.value.message
    assert _echoed(await after)[0] == _values(3)
    for _ in range(2):  # and large batches after it go through
        assert _echoed(await server.infer(_request(_values(COUNT + 1))))[0] == _values(COUNT + 1)
