"""Issue #25, item 11: a sampling value the engine's tensors cannot take is refused when the
request is admitted (400 naming the field), and a step that fails anyway fails only the
requests it held that fail alone: the others sharing its batch go on."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from kiln.core.errors import KilnError, Status  # noqa: E402
from kiln.llm import model_runner  # noqa: E402
from kiln.llm.async_engine import AsyncEngine  # noqa: E402
from kiln.llm.config import EngineConfig  # noqa: E402
from kiln.llm.engine import LLMEngine  # noqa: E402
from kiln.llm.sequence import SamplingParams  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import (  # noqa: E402
    VOCAB,
    all_blocks_returned,
    build_tiny_llm,
    llm_config,
    tiny_llm_repository,
)

CONFIG = llm_config(block_size="4", num_gpu_blocks="128", dtype="float32")
STALL = 60.0  # a reply slower than this is a wedged engine


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0, timeout=STALL
    )


BAD: list[tuple[dict[str, Any], str]] = [
    ({"top_k": 2**63, "top_p": 0.9}, "top_k"),  # overflowed a torch long in the sampler
    ({"logit_bias": {"²": 5}}, "logit_bias"),  # "²".isdigit() is True, int("²") raises
    ({"logit_bias": {"٣": 5}}, "logit_bias"),  # an Arabic-Indic digit
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),  # past the vocabulary
    ({"stop_token_ids": [2**63]}, "stop_token_ids"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),  # seed + 1 overflowed torch's manual_seed
    ({"seed": 2**63}, "seed"),  # vLLM's bound: a torch long
    ({"priority": 2**63}, "priority"),
    ({"temperature": 2.5}, "temperature"),  # vLLM's (and OpenAI's) bound: [0, 2]
    ({"temperature": -0.5}, "temperature"),
]


@pytest.mark.parametrize(("extra", "param"), BAD)
def test_a_bad_sampling_value_is_400_and_a_running_stream_goes_on(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    stream = client.completions.create(
        model="tiny",
        prompt="a long story",
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = iter(stream)
    first = next(chunks)  # the stream runs in the engine now
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=4, extra_body=extra)
    err = info.value.body
    assert isinstance(err, dict) and err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    rest = list(chunks)
    assert rest[-1].choices[0].finish_reason == "length"
    text = first.choices[0].text + "".join(c.choices[0].text for c in rest)
    assert text
    # and a new request is served
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=1).choices


def test_bad_values_on_chat_and_triton_generate(client: openai.OpenAI, server: KilnProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"top_k": 2**63},
        )
    assert isinstance(info.value.body, dict) and info.value.body["param"] == "top_k"
    import httpx

    url = f"http://{server.http_url}/v2/models/tiny/generate"
    for params in ({"top_k": 2**63}, {"stop_token_ids": [VOCAB]}, {"logit_bias": {"²": 1}}):
        reply = httpx.post(url, json={"text_input": "hi", "parameters": params}, timeout=STALL)
        assert reply.status_code == 400, reply.text
        assert next(iter(params)) in reply.json()["error"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("llama"))


GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


async def test_a_failing_step_fails_only_the_request_that_fails(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault injected in the sampler for one request (a stand-in for any bug or bad value
    that makes its rows raise): its stream gets the error, the stream that shared its
    batch gets every token, the same as when it runs alone, and the engine serves on."""
    reference = LLMEngine(folder, EngineConfig(block_size=4)).generate([[1, 2, 3, 4, 5]], LONG)
    real_sample = model_runner.sample
    shared: list[bool] = []

    def sample(logits: Any, seqs: list[Any]) -> Any:
        ids = {s.request_id for s in seqs}
        if "poison" in ids:
            shared.append("good" in ids)
            raise RuntimeError("injected sampler failure")
        return real_sample(logits, seqs)

    monkeypatch.setattr(model_runner, "sample", sample)
    engine = LLMEngine(folder, EngineConfig(block_size=4))
    async_engine = AsyncEngine(engine)
    try:
        good = async_engine.generate([1, 2, 3, 4, 5], LONG, "good")
        tokens = list((await good.__anext__()).new_token_ids)

        async def poisoned() -> None:
            async for _ in async_engine.generate([6, 7, 8], GREEDY, "poison"):
                pass

        bad = asyncio.ensure_future(poisoned())
        async for out in good:
            tokens.extend(out.new_token_ids)
        with pytest.raises(KilnError) as info:
            await asyncio.wait_for(bad, STALL)
        assert info.value.status is Status.INTERNAL
        assert "injected sampler failure" in str(info.value)
        assert shared[0], "the poisoned request never shared a step with the good one"
        assert tokens == reference[0]
        # the engine goes on with new requests
        more = [o async for o in async_engine.generate([9, 10], GREEDY, "after")]
        assert sum(len(o.new_token_ids) for o in more) == 30
        assert not engine.has_work()
        all_blocks_returned(engine)
    finally:
        async_engine.close()
