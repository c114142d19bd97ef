"""The engine in its own process (``enable_multiprocessing``), through core's EngineClient
on a real ModelRuntime: the same tokens as ``transformers`` and as the in-thread engine
(streaming order, ``n > 1``, structured outputs, embeddings); an abort reaches the engine
process; its counters reach ``vllm:*``; a killed engine process fails its requests with
INTERNAL naming the model and is replaced; unload leaves no process behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from kiln.config.loader import parse_config_text
from kiln.core.errors import KilnError, Status
from kiln.llm.backend import LLMBackend
from kiln.llm.engine_client import EngineClient
from kiln.llm.engine_proc import EngineProcClient
from kiln.llm.sequence import SamplingParams
from kiln.llm.structured import StructuredOutputsParams
from kiln.server.runtime import ModelRuntime
from tests.llm_models import build_tiny_llm, reference_generate

CONFIG = """
name: "tiny"
backend: "llm"
instance_group { kind: KIND_CPU count: 1 }
parameters { key: "block_size" value { string_value: "4" } }
parameters { key: "num_gpu_blocks" value { string_value: "64" } }
parameters { key: "dtype" value { string_value: "float32" } }
"""
LONG = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("repo") / "tiny" / "1")


@asynccontextmanager
async def loaded(folder: Path, process: bool = True, **extra: str) -> AsyncIterator[ModelRuntime]:
    text = CONFIG + "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n'
        for k, v in {"enable_multiprocessing": str(process).lower(), **extra}.items()
    )
    config = parse_config_text(text)
    LLMBackend.auto_complete_config(config, folder)
    runtime = ModelRuntime("tiny", 1, config, folder, LLMBackend)
    await runtime.load()
    try:
        yield runtime
    finally:
        if runtime.ready:
            await runtime.unload(0)


def engine_proc(client: EngineClient) -> EngineProcClient:
    proc = client._backend.engine_proc
    assert proc is not None
    return proc


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for every purpose but its table entry
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


async def collect(
    client: EngineClient, prompt: list[int], params: SamplingParams, rid: str
) -> dict[int, list[int]]:
    """Each sample's tokens, in the order they streamed."""
    out: dict[int, list[int]] = {}
    async for o in client.generate(prompt, params, rid):
        out.setdefault(o.index, []).extend(o.new_token_ids)
    return out


async def until(check: object, what: str) -> None:
    for _ in range(600):
        if callable(check) and check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def test_tokens_stream_in_order_as_transformers_and_n_samples_match_the_thread(
    folder: Path,
) -> None:
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [5]]
    sampled = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=3, ignore_eos=True)
    results = {}
    for process in (True, False):
        async with loaded(folder, process) as runtime:
            client = runtime.llm_engine()
            assert (client._backend.engine_proc is not None) is process
            greedy = await asyncio.gather(
                *(collect(client, p, GREEDY, f"g{i}") for i, p in enumerate(prompts))
            )
            results[process] = (greedy, await collect(client, [4, 5, 6], sampled, "n3"))
    for prompt, got in zip(prompts, results[True][0], strict=True):
        assert got[0] == reference_generate(folder, prompt, GREEDY.max_tokens)
    assert results[True] == results[False]
    assert sorted(results[True][1]) == [0, 1, 2]


async def test_an_abort_reaches_the_engine_process_and_the_counters_come_back(
    folder: Path,
) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        engine = client.engine
        prompt = list(range(1, 10))  # two full blocks of 4 for the prefix cache
        outputs = client.generate(prompt, LONG, "left")
        await outputs.__anext__()
        await outputs.aclose()  # the client went away
        # the engine process retired it as vLLM's "abort" and sent its counters
        await until(lambda: engine.stats.request_success["abort"] == 1, "abort counted")
        assert client.engine_counts().num_running == 0
        assert client.engine_counts().kv_cache_usage == 0.0
        assert engine.stats.num_generation_tokens < LONG.max_tokens
        await collect(client, prompt, GREEDY, "whole")
        # sent with the step that finished it: read at once by whoever got the answer
        assert engine.stats.request_success["length"] == 1
        assert engine.stats.histograms.e2e_request_latency.count == 2
        assert client.engine_counts().prefix_cache_hits > 0  # the same prompt again


async def test_structured_outputs_and_a_bad_constraint(folder: Path) -> None:
    spec = StructuredOutputsParams("choice", json.dumps(["alpha", "beta", "gamma"]))
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec)
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        client.check_request(3, params)
        got = await collect(client, [1, 2, 3], params, "choice")
        assert client.tokenizer.decode(got[0]) in ("alpha", "beta", "gamma")
        bad = StructuredOutputsParams("regex", "(unclosed", param="structured_outputs.regex")
        with pytest.raises(KilnError) as info:  # refused in this process, before the engine
            client.check_request(3, SamplingParams(structured_outputs=bad))
        assert info.value.status is Status.INVALID_ARG


async def test_embeddings_match_the_thread_and_a_full_queue_is_refused(folder: Path) -> None:
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    vectors = {}
    for process in (True, False):
        # the engine holds max_num_seqs + max_waiting = 3 prompts at once
        async with loaded(
            folder, process, runner="pooling", max_num_seqs="2", max_waiting="1"
        ) as runtime:
            vectors[process] = await runtime.llm_engine().pool(prompts)
            with pytest.raises(KilnError) as info:
                await runtime.llm_engine().pool([*prompts, [10]])
            assert info.value.status is Status.UNAVAILABLE
            assert info.value.message == (
                "llm engine: 0 pooling prompts in flight, the queue is full"
            )
    for a, b in zip(vectors[True], vectors[False], strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) < 1e-5


async def test_a_killed_engine_process_fails_its_requests_and_is_replaced(folder: Path) -> None:
    async with loaded(folder) as runtime:
        client = runtime.llm_engine()
        proc = engine_proc(client)
        old = proc.pid
        outputs = client.generate([1, 2, 3], LONG, "doomed")
        await outputs.__anext__()
        os.kill(old, signal.SIGKILL)
        with pytest.raises(KilnError) as info:
            async for _ in outputs:
                pass
        assert info.value.status is Status.INTERNAL
        assert "model 'tiny'" in info.value.message
        assert "engine process stopped (killed by signal 9)" in info.value.message
        # the next request waits for the new engine process and is served by it
        got = await collect(client, [1, 2, 3], GREEDY, "after")
        assert got[0] == reference_generate(folder, [1, 2, 3], GREEDY.max_tokens)
        assert proc.restarts == 1 and proc.pid != old and not alive(old)
        assert runtime.ready


async def test_unload_leaves_no_engine_process(folder: Path) -> None:
    async with loaded(folder) as runtime:
        pid = engine_proc(runtime.llm_engine()).pid
        assert alive(pid)
        outputs = runtime.llm_engine().generate([1, 2, 3], LONG, "cut")
        await outputs.__anext__()
        await runtime.unload(0)
        with pytest.raises(KilnError, match="unloaded before the request finished"):
            async for _ in outputs:
                pass
        assert not alive(pid)


def test_the_switch_reads_the_parameter_then_vllms_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kiln.llm.backend import DEFAULT_MULTIPROCESSING, enable_multiprocessing

    plain = parse_config_text(CONFIG)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    assert enable_multiprocessing(plain) is DEFAULT_MULTIPROCESSING
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    assert enable_multiprocessing(plain) is False
    given = parse_config_text(
        CONFIG + 'parameters { key: "enable_multiprocessing" value { string_value: "true" } }'
    )
    assert enable_multiprocessing(given) is True
    bad = parse_config_text(
        CONFIG + 'parameters { key: "enable_multiprocessing" value { string_value: "maybe" } }'
    )
    with pytest.raises(KilnError, match="model 'tiny': parameter enable_multiprocessing must"):
        enable_multiprocessing(bad)


def test_the_engine_process_spins_briefly_for_a_large_model_only(tmp_path: Path) -> None:
    """OpenMP in the engine process: PASSIVE always (a waiting thread sleeps), plus ~0.1 ms
    of spinning (GOMP_SPINCOUNT) when the model's layers are large enough that their matrix
    products come back to back; no config.json (a GGUF file): PASSIVE alone."""
    from kiln.llm import engine_proc

    def folder(name: str, **config: object) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config))
        return path

    small = folder("small", hidden_size=256, intermediate_size=768, num_hidden_layers=4)
    large = folder("large", hidden_size=768, intermediate_size=2048, num_hidden_layers=12)
    nested = folder(
        "vlm", text_config={"hidden_size": 2048, "num_hidden_layers": 16}, vision_config={}
    )
    assert engine_proc.layer_params(small) == 256 * (4 * 256 + 3 * 768) * 4
    assert engine_proc.child_env(small) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert engine_proc.child_env(large) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
    assert engine_proc.child_env(nested)["GOMP_SPINCOUNT"] == "10000"  # 4x hidden MLP assumed
    assert engine_proc.child_env(tmp_path / "none") == {"OMP_WAIT_POLICY": "PASSIVE"}
    (small / "config.json").write_text("{broken")
    assert engine_proc.layer_params(small) == 0


async def test_pooling_prompts_count_against_the_engine_process_admission(folder: Path) -> None:
    """``--max-num-queued-reqs`` counts each pooled prompt in the server process too, and
    gives the slots back once the vectors came."""
    async with loaded(folder, True, max_num_queued_reqs="2") as runtime:
        client = runtime.llm_engine()
        admission = engine_proc(client).admission
        with pytest.raises(KilnError) as info:
            await client.pool([[1, 2], [3, 4], [5, 6]])
        assert info.value.status is Status.UNAVAILABLE
        assert client.admission_rejections()["max_num_queued_reqs"] == 1
        vectors = await client.pool([[1, 2], [3, 4]])
        assert len(vectors) == 2
        assert (admission.slots, admission.prefill_tokens) == (0, 0)
