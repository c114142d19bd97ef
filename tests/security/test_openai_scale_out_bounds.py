"""Hostile inputs on vLLM's scale-out routes (/inference/v1/generate, /abort_requests,
/derender): every list is counted before its items are read or allocated for, every token
id is one of the vocabulary, integers stay in their ranges, ids and lists are bounded.
Each test fails without the bound it names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402

STALL = 60.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    config = llm_config(block_size="4", num_gpu_blocks="64", dtype="float32")
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), config)
    proc = KilnProcess(repo, args=["--enable-scale-out"]).start(timeout=120)
    yield proc
    proc.stop()


SCALE_OUT_PATHS = [
    "/v1/chat/completions/render", "/v1/completions/render", "/v1/messages/render",
    "/v1/responses/render", "/inference/v1/generate", "/inference/v1/abort_requests",
    "/v1/chat/completions/derender", "/v1/completions/derender",
]  # fmt: skip


def test_without_enable_scale_out_every_route_is_403(tmp_path: Path) -> None:
    """vLLM's default: the routes answer 403 and nothing is read or run (the abort route
    would end other clients' generations)."""
    config = llm_config(block_size="4", num_gpu_blocks="64", dtype="float32")
    proc = KilnProcess(tiny_llm_repository(tmp_path, config)).start(timeout=120)
    try:
        for path in SCALE_OUT_PATHS:
            answer = httpx.post(f"http://{proc.http_url}{path}", json={"request_ids": ["x"]})
            assert answer.status_code == 403, (path, answer.text)
            error = answer.json()["error"]
            assert error["type"] == "PermissionDeniedError"
            assert "--enable-scale-out" in error["message"]
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def limits(server: KilnProcess) -> dict[str, int]:
    """The tiny model's context, and a token id past its vocabulary (``outside``)."""
    base = f"http://{server.http_url}"
    context = httpx.post(f"{base}/tokenize", json={"prompt": "a"}, timeout=STALL).json()
    vocab = 1
    while httpx.post(f"{base}/detokenize", json={"tokens": [vocab * 2]}).status_code == 200:
        vocab *= 2
    return {"context": context["max_model_len"], "outside": vocab * 2}


def _error(server: KilnProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = httpx.post(
        f"http://{server.http_url}{path}",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        timeout=STALL,
    )
    assert reply.status_code == 400, reply.text
    return dict(reply.json()["error"])


GENERATE = "/inference/v1/generate"


def test_generate_counts_token_ids_against_the_context_before_reading_them(
    server: KilnProcess, limits: dict[str, int]
) -> None:
    # out-of-vocabulary ids: the count is what is refused, before any id is read
    ids = [10**9] * limits["context"]
    err = _error(server, GENERATE, {"token_ids": ids, "sampling_params": {}})
    assert err["param"] == "token_ids" and err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("bad", [-1, "outside", 2**70, True, 1.0, "3", None])
def test_generate_token_ids_are_ids_of_the_vocabulary(
    server: KilnProcess, limits: dict[str, int], bad: Any
) -> None:
    token = limits["outside"] if bad == "outside" else bad
    err = _error(server, GENERATE, {"token_ids": [1, token], "sampling_params": {}})
    assert err["param"] == "token_ids"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seed", 2**64),
        ("top_k", -(2**70)),
        ("max_tokens", 2**70),
        ("n", 10**6),
        ("logprobs", 10**6),
        ("stop", ["x"] * 100),
        ("stop_token_ids", [10**9]),
        ("logit_bias", {"1": 10**6}),
        ("min_tokens", -1),
        ("extra_args", {"a": 1}),
        ("bogus", 1),
    ],
)
def test_generate_sampling_params_are_checked_as_the_other_routes(
    server: KilnProcess, field: str, value: Any
) -> None:
    body = {"token_ids": [1, 2], "sampling_params": {field: value}}
    assert _error(server, GENERATE, body)["param"] == f"sampling_params.{field}"


def test_generate_request_id_and_priority_are_bounded(server: KilnProcess) -> None:
    body: dict[str, Any] = {"token_ids": [1, 2], "sampling_params": {}}
    assert _error(server, GENERATE, {**body, "request_id": "x" * 513})["param"] == "request_id"
    assert _error(server, GENERATE, {**body, "priority": 2**64})["param"] == "priority"
    for field in ("features", "content_parts", "kv_transfer_params"):
        assert _error(server, GENERATE, {**body, field: {"a": 1}})["param"] == field


ABORT = "/inference/v1/abort_requests"


@pytest.mark.parametrize(
    "ids",
    [["x"] * 1025, ["x" * 600], [1], {"a": 1}, None],
)
def test_abort_lists_are_bounded(server: KilnProcess, ids: Any) -> None:
    assert _error(server, ABORT, {"request_ids": ids})["param"] == "request_ids"


def _generated(ids: Any, **choice: Any) -> dict[str, Any]:
    return {"request_id": "r", "choices": [{"index": 0, "token_ids": ids, **choice}]}


def test_derender_counts_before_decoding(server: KilnProcess, limits: dict[str, int]) -> None:
    path = "/v1/chat/completions/derender"
    too_long = [10**9] * (limits["context"] + 1)
    err = _error(server, path, {"generate_response": _generated(too_long)})
    assert err["param"] == "generate_response.choices[0].token_ids" and "holds" in err["message"]
    err = _error(server, path, {"generate_response": _generated([limits["outside"]])})
    assert err["param"] == "generate_response.choices[0].token_ids"
    many = {"request_id": "r", "choices": [{"token_ids": [1]}] * 1025}
    assert _error(server, path, {"generate_response": many})["param"] == (
        "generate_response.choices"
    )
    wide = {"content": [{"token_id": 1, "logprob": 0.0,
                         "top_logprobs": [{"token_id": 1, "logprob": 0.0}] * 22}]}  # fmt: skip
    err = _error(server, path, {"generate_response": _generated([1], logprobs=wide)})
    assert err["param"] == "generate_response.choices[0].logprobs"
    long_prompt = {"generate_response": _generated([1]), "prompt_token_ids": too_long}
    assert _error(server, path, long_prompt)["param"] == "prompt_token_ids"
    responses = {"generate_responses": [_generated([1])] * 1025}
    err = _error(server, "/v1/completions/derender", responses)
    assert err["param"] == "generate_responses"


@pytest.mark.parametrize(
    ("state", "param"),
    [
        ({"prev_tokens": ["1"] * 1025}, "stream_state.prev_tokens"),
        ({"prev_tokens": ["1" * 400]}, "stream_state.prev_tokens"),
        ({"prev_tokens": ["-1"]}, "stream_state.prev_tokens"),
        ({"prev_tokens": ["\u0661"]}, "stream_state.prev_tokens"),  # a digit, not ASCII
        ({"prev_tokens": ["1"], "read_offset": 2}, "stream_state.read_offset"),
        ({"prev_tokens": ["1"], "prefix_offset": 1}, "stream_state.prefix_offset"),
        ({"logprob_text_offset": 2**70}, "stream_state.logprob_text_offset"),
        ([], "stream_state"),
    ],
)
def test_streamed_derender_state_is_bounded(server: KilnProcess, state: Any, param: str) -> None:
    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}]}
    body = {"stream": True, "generate_chunk": chunk, "stream_state": state}
    assert _error(server, "/v1/chat/completions/derender", body)["param"] == param
    assert _error(server, "/v1/completions/derender", body)["param"] == param


@pytest.mark.parametrize(
    ("state", "param"),
    [
        ({"output_token_ids": "context+1"}, "stream_state.output_token_ids"),
        ({"output_token_ids": ["outside"], "output_chunk_lens": [1]},
         "stream_state.output_token_ids"),
        ({"output_token_ids": [1, 2], "output_chunk_lens": [1]},
         "stream_state.output_chunk_lens"),
        ({"output_token_ids": [1], "output_chunk_lens": [1, 0]},
         "stream_state.output_chunk_lens"),
        ({"output_token_ids": [1, 2], "output_chunk_lens": [3, -1]},
         "stream_state.output_chunk_lens"),
        ({"output_token_ids": [1], "output_chunk_lens": [True]},
         "stream_state.output_chunk_lens"),
        ({"output_token_ids": [1], "output_chunk_lens": [1],
          "last_tool_call_ids": ["x" * 129]}, "stream_state.last_tool_call_ids"),
        ({"output_token_ids": [1], "output_chunk_lens": [1],
          "last_tool_call_ids": ["a", "b"]}, "stream_state.last_tool_call_ids"),
        ({"last_tool_call_ids": [7]}, "stream_state.last_tool_call_ids"),
        ({"role_sent": "yes"}, "stream_state.role_sent"),
        ({"tools_streamed": 1}, "stream_state.tools_streamed"),
        ({"logprob_context_token_ids": [1] * 5}, "stream_state.logprob_context_token_ids"),
        ({"logprob_context_token_ids": ["outside"]}, "stream_state.logprob_context_token_ids"),
    ],
)  # fmt: skip
def test_streamed_derender_replay_state_is_bounded(
    server: KilnProcess, limits: dict[str, int], state: dict[str, Any], param: str
) -> None:
    """vLLM's parser-path fields of ``stream_state`` (the output replayed each call, its
    chunk sizes, the tool calls' ids) and its flags: each counted and typed before use."""

    def resolve(value: Any) -> Any:
        if value == "context+1":
            return [1] * (limits["context"] + 1)
        if isinstance(value, list):
            return [limits["outside"] if v == "outside" else v for v in value]
        return value

    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}]}
    resolved = {k: resolve(v) for k, v in state.items()}
    body = {"stream": True, "generate_chunk": chunk, "stream_state": resolved}
    assert _error(server, "/v1/chat/completions/derender", body)["param"] == param
    assert _error(server, "/v1/completions/derender", body)["param"] == param


def test_streamed_derender_counts_prompt_output_and_chunk_against_the_context(
    server: KilnProcess, limits: dict[str, int]
) -> None:
    """vLLM's: the prompt, the output so far and the chunk together fit the context."""
    half = limits["context"] // 2
    state = {"output_token_ids": [1] * half, "output_chunk_lens": [half]}
    chunk = {"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}]}
    body = {"stream": True, "generate_chunk": chunk, "stream_state": state,
            "prompt_token_ids": [1] * (limits["context"] - half)}  # fmt: skip
    err = _error(server, "/v1/chat/completions/derender", body)
    assert err["param"] == "stream_state.output_token_ids" and "context" in err["message"]
    long = {"request_id": "r", "prompt_token_ids": [1] * (limits["context"] + 1),
            "choices": [{"index": 0, "token_ids": [1]}]}  # fmt: skip
    err = _error(server, "/v1/completions/derender", {"stream": True, "generate_chunk": long})
    assert err["param"] == "generate_chunk.prompt_token_ids"
    whole = {"request_id": "r", "prompt_token_ids": [limits["outside"]],
             "choices": [{"index": 0, "token_ids": [1]}]}  # fmt: skip
    err = _error(server, "/v1/chat/completions/derender", {"generate_response": whole})
    assert err["param"] == "generate_response.prompt_token_ids"


def test_streamed_derender_takes_one_choice_per_chunk(
    server: KilnProcess, limits: dict[str, int]
) -> None:
    two = {"request_id": "r", "choices": [{"index": 0, "token_ids": [1]}] * 2}
    err = _error(server, "/v1/chat/completions/derender", {"stream": True, "generate_chunk": two})
    assert err["param"] == "generate_chunk.choices"
    long = {
        "request_id": "r",
        "choices": [{"index": 0, "token_ids": [10**9] * (limits["context"] + 1)}],
    }
    err = _error(server, "/v1/completions/derender", {"stream": True, "generate_chunk": long})
    assert err["param"] == "generate_chunk.choices[0].token_ids" and "holds" in err["message"]
