"""vLLM's switched metric families on a real ``kiln serve``, driven by the real ``openai``
client and read from ``/metrics``: the KV-cache residency histograms with
``kv_cache_metrics`` (observed once the pool evicts the blocks requests left behind), the
MFU estimates with ``enable_mfu_metrics``, ``vllm:corrupted_requests`` with
``VLLM_COMPUTE_NANS_IN_LOGITS=1``, and ``vllm:tool_call_parser_invocations_total`` for a
model with the hermes tool-call parser. ``tiny`` has the switches on; ``tools`` has them off
(and the parser)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")

from kiln.llm.kv_cache_metrics import RESIDENCY_BUCKETS  # noqa: E402
from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_llm_vllm_metrics import _families, _grew, _les, _value  # noqa: E402
from tests.integration.test_openai_tools import HERMES_CALL, MESSAGES, TEMPLATE, TOOLS  # noqa: E402
from tests.llm_models import build_tiny_llm, llm_config  # noqa: E402

RESIDENCY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds",
             "vllm:kv_block_reuse_gap_seconds")  # fmt: skip
MFU = ("vllm:estimated_flops_per_gpu", "vllm:estimated_read_bytes_per_gpu",
       "vllm:estimated_write_bytes_per_gpu")  # fmt: skip
PROMPT = list(range(1, 10))  # token ids: 9 tokens, two full blocks of 4 in the prefix cache


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("switches")
    repo = root / "repo"
    build_tiny_llm(repo / "tiny" / "1")
    (repo / "tiny" / "config.pbtxt").write_text(
        llm_config(
            "tiny",
            block_size="4",
            max_num_seqs="8",
            num_gpu_blocks="32",
            kv_cache_metrics="true",
            kv_cache_metrics_sample="1.0",
            enable_mfu_metrics="true",
        )
    )
    template = root / "template.jinja"
    template.write_text(TEMPLATE)
    build_tiny_llm(repo / "tools" / "1", max_position_embeddings=1024)
    (repo / "tools" / "config.pbtxt").write_text(
        llm_config(
            "tools",
            max_num_seqs="8",
            num_gpu_blocks="512",
            chat_template=str(template),
            enable_auto_tool_choice="true",
            tool_call_parser="hermes",
        )
    )
    proc = KilnProcess(repo, env={"VLLM_COMPUTE_NANS_IN_LOGITS": "1"}).start(timeout=180)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _complete(client: openai.OpenAI, prompt: list[int], max_tokens: int) -> None:
    client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                              extra_body={"ignore_eos": True})  # fmt: skip


def _models(families: dict[str, Any], name: str) -> set[str]:
    return {s.labels["model_name"] for s in families[name].samples}


def test_residency_is_observed_once_the_pool_evicts_the_blocks_requests_left(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    for _ in range(3):  # the 2nd and 3rd reuse the first two blocks from the prefix cache
        _complete(client, PROMPT, 3)
    families = _families(server)
    for name in RESIDENCY:
        assert families[name].type == "histogram"
        assert _models(families, name) == {"tiny"}  # ``tools`` has the switch off
        assert _les(families, name) == [repr(float(b)) for b in RESIDENCY_BUCKETS] + ["+Inf"]
        # the requests ended and released their blocks; none was evicted yet
        assert _value(families, name + "_count", model_name="tiny", engine="0") == 0
    # a prompt that needs every block (126 + 2 tokens): the pool hands them all out again
    _complete(client, list(range(100, 226)), 2)
    after = _families(server)
    evicted = _value(after, "vllm:kv_block_lifetime_seconds_count", model_name="tiny")
    assert evicted > 0
    assert _value(after, "vllm:kv_block_idle_before_evict_seconds_count", model_name="tiny") == (
        evicted
    )
    # the two shared blocks, accessed by the 2nd and 3rd request: one gap each
    assert _value(after, "vllm:kv_block_reuse_gap_seconds_count", model_name="tiny") == 2
    lifetime = _value(after, "vllm:kv_block_lifetime_seconds_sum", model_name="tiny")
    idle = _value(after, "vllm:kv_block_idle_before_evict_seconds_sum", model_name="tiny")
    assert 0 <= idle <= lifetime


def test_mfu_estimates_count_with_the_switch_only(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    before = _families(server)
    _complete(client, PROMPT, 4)
    client.chat.completions.create(model="tools", messages=MESSAGES,  # type: ignore[arg-type]
                                   max_completion_tokens=3)  # fmt: skip
    after = _families(server)
    for name in MFU:
        assert after[name].type == "counter"
        assert _models(after, name) == {"tiny", "tools"}  # vLLM creates them regardless
        assert _grew(before, after, name + "_total", model_name="tiny", engine="0") > 0
        assert _value(after, name + "_total", model_name="tools", engine="0") == 0


def test_corrupted_requests_is_exported_with_the_environment_switch(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    _complete(client, PROMPT, 2)
    families = _families(server)
    assert families["vllm:corrupted_requests"].type == "counter"
    for model in ("tiny", "tools"):  # healthy weights: no NaN in any logits
        assert _value(families, "vllm:corrupted_requests_total", model_name=model) == 0


def _parser(families: dict[str, Any], mode: str, outcome: str, kind: str) -> float:
    return _value(families, "vllm:tool_call_parser_invocations_total", model_name="tools",
                  mode=mode, outcome=outcome, request_type=kind)  # fmt: skip


def test_tool_parser_runs_are_counted_by_mode_outcome_and_api(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    before = _families(server)
    family = before["vllm:tool_call_parser_invocations"]
    assert family.type == "counter"
    assert len(family.samples) == 12  # every combination, from the start, as vLLM's
    assert all(s.labels["model_name"] == "tools" for s in family.samples)
    call: dict[str, Any] = dict(
        model="tools", messages=MESSAGES, tools=TOOLS, max_completion_tokens=200,
        temperature=1.0, seed=5, extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )  # fmt: skip
    reply = client.chat.completions.create(n=2, **call)
    assert [c.finish_reason for c in reply.choices] == ["tool_calls", "tool_calls"]
    plain = {**call, "extra_body": {"structured_outputs": {"regex": "Sure, no tools."}}}
    assert client.chat.completions.create(**plain).choices[0].finish_reason == "stop"
    # required is read by its grammar, not the parser: not counted (as in vLLM)
    client.chat.completions.create(
        model="tools", messages=MESSAGES, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
        max_completion_tokens=60, temperature=0,
        extra_body={"structured_outputs": {"disable_any_whitespace": True}},
    )  # fmt: skip
    mid = _families(server)
    # whole answers: once per choice
    assert (
        _parser(mid, "non_streaming", "tool_call", "chat_completions")
        - _parser(before, "non_streaming", "tool_call", "chat_completions")
        == 2
    )
    assert (
        _parser(mid, "non_streaming", "no_tool_call", "chat_completions")
        - _parser(before, "non_streaming", "no_tool_call", "chat_completions")
        == 1
    )
    chunks = list(client.chat.completions.create(stream=True, **call))
    streamed = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    after = _families(server)
    # streamed: once per delta the parser reads; the deltas that carried calls
    called = _parser(after, "streaming", "tool_call", "chat_completions")
    assert called == len(streamed) > 0
    assert _parser(after, "streaming", "no_tool_call", "chat_completions") > 0
    # the Responses API's runs carry its request type
    weather = {"type": "function", "name": "get_weather",
               "parameters": TOOLS[0]["function"]["parameters"]}  # fmt: skip
    client.responses.create(
        model="tools", input="the quick brown fox", tools=[weather],  # type: ignore[list-item]
        max_output_tokens=200, extra_body={"structured_outputs": {"regex": HERMES_CALL}},
    )  # fmt: skip
    final = _families(server)
    assert _parser(final, "non_streaming", "tool_call", "responses") == 1
