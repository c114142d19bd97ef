"""core's EngineClient on a real ModelRuntime of a tiny llm model: each request counts in
the model's statistics (success, CANCELED, execution), in flight (so unload drains it),
and is refused with infer's error once the model no longer serves; with the engine in its
own process and on a thread alike."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError, Status
from kiln.core.stats import FailureReason
from kiln.frontends.openai.generation import run, started
from kiln.llm.backend import LLMBackend
from kiln.llm.sequence import SamplingParams
from kiln.server.runtime import ModelRuntime
from tests.llm_models import build_tiny_llm

CONFIG = """
name: "tiny"
backend: "llm"
instance_group { kind: KIND_CPU count: 1 }
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "num_gpu_blocks" value { string_value: "64" } }
parameters { key: "dtype" value { string_value: "float32" } }
"""
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True, params=["process", "thread"])
def engine_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test once with the engine in its own process, once on a thread (vLLM's
    switch, read when the model loads)."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if request.param == "process" else "0")
    return str(request.param)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("repo") / "tiny" / "1")


@asynccontextmanager
async def loaded(folder: Path) -> AsyncIterator[ModelRuntime]:
    config = parse_config_text(CONFIG)
    LLMBackend.auto_complete_config(config, folder)
    runtime = ModelRuntime("tiny", 1, config, folder, LLMBackend)
    await runtime.load()
    try:
        yield runtime
    finally:
        if runtime.ready:
            await runtime.unload(0)


async def test_a_request_counts_in_flight_and_in_the_statistics(folder: Path) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        outputs = client.generate([1, 2, 3], SHORT, "r1")
        await outputs.__anext__()
        assert runtime.inflight == 1
        async for _ in outputs:
            pass
        assert runtime.inflight == 0
        stats = runtime.stats.to_json("tiny", "1")
        assert stats["inference_count"] == stats["execution_count"] == 1
        assert stats["inference_stats"]["success"]["count"] == 1
        assert stats["inference_stats"]["compute_infer"]["ns"] > 0


async def test_stop_strings_end_a_request_normally_leaving_early_cancels_it(
    folder: Path,
) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        outputs = client.generate([1, 2, 3], LONG, "stopped")
        await outputs.__anext__()
        client.abort("stopped", 0, "stop")  # what a matched stop string does
        await outputs.aclose()
        outputs = client.generate([1, 2, 3], LONG, "left")
        await outputs.__anext__()
        await outputs.aclose()  # the client went away
        assert runtime.stats.success.count == 1
        assert runtime.stats.fail_reasons[FailureReason.CANCELED] == 1
        assert runtime.inflight == 0


async def test_unload_waits_for_a_stream_and_refuses_new_requests(folder: Path) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        deltas = run(client, [1, 2, 3], LONG, ())
        first = await deltas.__anext__()
        unload = asyncio.create_task(runtime.unload(60))
        await asyncio.sleep(0.05)
        assert not unload.done()  # draining: the stream is in flight
        with pytest.raises(KilnError) as info:
            await anext(client.generate([4, 5], SHORT, "late"))
        assert info.value.status is Status.UNAVAILABLE
        assert info.value.message == "model 'tiny' version 1 is not ready"  # infer's
        rest = [d async for d in deltas]
        last = rest[-1] if rest else first
        assert last.finish_reason == "length" and last.completion_tokens == 100
        await unload
        assert runtime.stats.success.count == 1


async def test_past_the_drain_timeout_a_stream_ends_with_a_clear_error(folder: Path) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        deltas = await started(run(client, [1, 2, 3], LONG, ()))
        # frozen mid-way (vLLM's keep pause), so it cannot end before the unload does on a
        # busy machine where the engine outruns this task
        await client.control("pause", mode="keep")
        await runtime.unload(0)
        with pytest.raises(KilnError, match="unloaded before the request finished"):
            async for _ in deltas:
                pass
        assert runtime.stats.fail.count == 1 and runtime.inflight == 0


async def test_a_model_of_another_backend_has_no_engine(folder: Path) -> None:
    async with loaded(folder) as runtime:
        instances = runtime.scheduler.instances  # type: ignore[union-attr]
        instances[0].backend.name = "onnxruntime"  # as if another backend served it
        runtime._engine_client = runtime._llm_client(instances)
        with pytest.raises(KilnError) as info:
            runtime.llm_engine()
        assert info.value.status is Status.INVALID_ARG
        assert "not by an llm backend: use /v2/models/tiny/infer" in info.value.message
