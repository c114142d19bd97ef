"""Adaptive inline execution (``Instance.submit``): short CPU calls run on the event loop's
thread, long ones and non-CPU backends on the instance's own thread; the model parameter
``inline_execution_max_us`` sets the bound (0: never inline) and a bad value fails the load.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format

from kiln.backends.base import Backend, InstanceSpec
from kiln.config.model_config_pb2 import ModelConfig
from kiln.core.errors import KilnError
from kiln.scheduling.base import Instance
from kiln.server.runtime import ModelRuntime

SPEC = InstanceSpec("m_0", "cpu", 0, 0, 1)
Arrays = dict[str, np.ndarray]


class Spin(Backend):
    """Records the thread each call ran on; a call burns ``spin_ms`` of CPU."""

    name = "spin"
    spin_ms = 0.0

    def __init__(self, inline: bool = True) -> None:
        super().__init__(ModelConfig(), Path("."), SPEC)
        self.inline_capable = inline
        self.threads: list[int] = []

    def execute(self, inputs: Arrays, output_names: list[str]) -> Arrays:
        self.threads.append(threading.get_ident())
        end = time.thread_time() + self.spin_ms / 1000
        while time.thread_time() < end:
            pass
        return {"OUT": inputs["IN"]}


async def _call(instance: Instance, value: float) -> float:
    outputs, _, _ = await instance.run({"IN": np.array([value])}, ["OUT"])
    return float(outputs["OUT"][0])


async def test_short_calls_run_inline_after_the_first() -> None:
    backend = Spin()
    instance = Instance(backend, "m", inline_max_us=50_000)
    try:
        assert [await _call(instance, v) for v in (1.0, 2.0, 3.0)] == [1.0, 2.0, 3.0]
        loop_thread = threading.get_ident()
        # the first call measures on the instance thread; the next ones are short: inline
        assert backend.threads[0] != loop_thread
        assert backend.threads[1:] == [loop_thread, loop_thread]
        assert instance.inline_calls == 2
    finally:
        instance.close()


async def test_a_backend_inline_only_alone_goes_to_its_thread_under_load() -> None:
    """``inline_only_alone`` (the PyTorch backend): a short call runs inline while its
    request is the only one in flight in the server, and on the instance's thread when
    others are, where it overlaps the loop's work."""
    backend = Spin()
    activity = backend.activity  # the server's, once a runtime sets it
    backend.inline_only_alone = True
    instance = Instance(backend, "m", inline_max_us=50_000)
    loop_thread = threading.get_ident()
    try:
        activity.inflight = 1
        await _call(instance, 1.0)  # the first call measures on the thread
        await _call(instance, 2.0)
        activity.inflight = 3
        await _call(instance, 3.0)
        activity.inflight = 1
        await _call(instance, 4.0)
        assert backend.threads[1] == loop_thread and backend.threads[3] == loop_thread
        assert backend.threads[2] != loop_thread
        assert instance.inline_calls == 2
    finally:
        instance.close()


def test_the_pytorch_backend_runs_inline_only_alone_on_the_cpu(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kiln.backends.pytorch import PyTorchBackend
    from kiln.config.loader import parse_config_text
    from kiln.examples import build_example_repository

    build_example_repository(tmp_path, ["torch_mlp"])
    config = parse_config_text((tmp_path / "torch_mlp" / "config.pbtxt").read_text())
    backend = PyTorchBackend(config, tmp_path / "torch_mlp" / "1", SPEC)
    assert backend.inline_capable and backend.inline_only_alone
    backend.close()


async def test_a_long_call_sends_the_next_ones_back_to_the_thread() -> None:
    backend = Spin()
    instance = Instance(backend, "m", inline_max_us=5_000)
    try:
        await _call(instance, 1.0)  # measured: short
        Spin.spin_ms = 60.0
        await _call(instance, 2.0)  # runs inline (the average said short), measured long
        Spin.spin_ms = 0.0
        await _call(instance, 3.0)
        loop_thread = threading.get_ident()
        assert backend.threads[1] == loop_thread
        assert backend.threads[2] != loop_thread  # the average is now above the bound
    finally:
        Spin.spin_ms = 0.0
        instance.close()


@pytest.mark.parametrize(("inline", "bound"), [(False, 50_000), (True, 0)])
async def test_never_inline_for_non_cpu_backends_or_a_zero_bound(inline: bool, bound: int) -> None:
    backend = Spin(inline=inline)
    instance = Instance(backend, "m", inline_max_us=bound)
    try:
        for v in range(4):
            await _call(instance, float(v))
        assert threading.get_ident() not in backend.threads
        assert instance.inline_calls == 0
    finally:
        instance.close()


async def test_an_inline_error_reaches_the_caller() -> None:
    class Failing(Spin):
        def execute(self, inputs: Arrays, output_names: list[str]) -> Arrays:
            if inputs["IN"][0] < 0:
                raise ValueError("negative input")
            return super().execute(inputs, output_names)

    instance = Instance(Failing(), "m", inline_max_us=50_000)
    try:
        await _call(instance, 1.0)
        with pytest.raises(KilnError, match="model 'm' failed to execute: ValueError: negative"):
            await _call(instance, -1.0)
        assert instance.inline_calls == 1
        assert await _call(instance, 2.0) == 2.0  # the instance keeps serving
    finally:
        instance.close()


async def test_bad_parameter_fails_the_load_naming_it(example_repo: Path, tmp_path: Path) -> None:
    config = text_format.Parse(
        (example_repo / "simple" / "config.pbtxt").read_text(), ModelConfig()
    )
    config.parameters["inline_execution_max_us"].string_value = "fast"
    from kiln.backends.onnxruntime import OnnxRuntimeBackend

    runtime = ModelRuntime("simple", 1, config, example_repo / "simple" / "1", OnnxRuntimeBackend)
    with pytest.raises(KilnError, match="inline_execution_max_us must be an integer >= 0"):
        await runtime.load()
