"""A Triton vLLM-backend model folder (``backend: "vllm"``, ``1/model.json``) served by
``kiln serve``, driven the way Triton's vLLM backend clients drive it: ``tritonclient.grpc``
streaming (``start_stream`` + ``async_stream_infer``), plain ``infer`` over HTTP and gRPC,
and the generate endpoints; every text compared with kiln's OpenAI completions output for
the same prompt and greedy settings (the same engine, so token for token)."""

from __future__ import annotations

import json
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("transformers")

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import KilnProcess
from tests.llm_models import build_tiny_llm

MODEL = "vllm_tiny"
PROMPT = "the quick brown fox"
GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
CONFIG = """
backend: "vllm"
model_transaction_policy { decoupled: true }
instance_group [ { count: 1 kind: KIND_MODEL } ]
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("vllm")
    weights = build_tiny_llm(root / "hf")
    version = root / "repo" / MODEL / "1"
    version.mkdir(parents=True)
    (root / "repo" / MODEL / "config.pbtxt").write_text(CONFIG)
    engine_args = {
        "model": str(weights),
        "dtype": "float32",
        "block_size": 4,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 256,
        "num_gpu_blocks_override": 64,
        "max_model_len": 256,
        "gpu_memory_utilization": 0.5,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "disable_log_requests": True,
        "tensor_parallel_size": 1,
    }
    (version / "model.json").write_text(json.dumps(engine_args))
    proc = KilnProcess(root / "repo").start(timeout=120)
    yield proc
    proc.stop()


def _completion(server: KilnProcess, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, **GREEDY, **extra}
    reply = requests.post(f"http://{server.http_url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return dict(reply.json()["choices"][0] | {"usage": reply.json()["usage"]})


def _inputs(
    module: Any, prompt: str = PROMPT, stream: bool | None = None,
    sampling: dict[str, Any] | str | None = None, **flags: bool,
) -> list[Any]:  # fmt: skip
    """The vLLM backend's inputs, as its sample client and CI build them."""
    inputs = [module.InferInput("text_input", [1], "BYTES")]
    inputs[-1].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    if stream is not None:
        inputs.append(module.InferInput("stream", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([stream], dtype=bool))
    if sampling is not None:
        text = sampling if isinstance(sampling, str) else json.dumps(sampling)
        inputs.append(module.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
    for name, value in flags.items():
        inputs.append(module.InferInput(name, [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([value], dtype=bool))
    return inputs


def _stream(server: KilnProcess, inputs: list[Any], **kw: Any) -> list[Any]:
    """Every response of one request over ``start_stream`` + ``async_stream_infer``."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put(error or result))
        client.async_stream_infer(MODEL, inputs=inputs, request_id="r1", **kw)
        responses = []
        while True:
            item = got.get(timeout=60)
            responses.append(item)
            if isinstance(item, InferenceServerException):
                return responses
            final = item.get_response().parameters["triton_final_response"].bool_param
            if final:
                return responses
    finally:
        client.stop_stream()
        client.close()


def _text(result: Any) -> str:
    return str(result.as_numpy("text_output")[0].decode())


def test_grpc_stream_deltas_match_completions(server: KilnProcess) -> None:
    want = _completion(server)["text"]
    responses = _stream(server, _inputs(grpcclient, stream=True, sampling=GREEDY))
    assert all(not isinstance(r, InferenceServerException) for r in responses), responses
    # a response per step (steps merged when the reader fell behind, as vLLM's collector
    # merges them), the last one flagged final, never the prompt
    assert 1 <= len(responses) <= GREEDY["max_tokens"]
    flags = [r.get_response().parameters["triton_final_response"].bool_param for r in responses]
    assert flags == [False] * (len(responses) - 1) + [True]
    assert "".join(_text(r) for r in responses) == want
    assert responses[0].get_response().id == "r1"


def test_grpc_stream_optional_outputs(server: KilnProcess) -> None:
    reference = _completion(server, logprobs=0)
    responses = _stream(
        server,
        _inputs(
            grpcclient, stream=True, sampling=GREEDY, return_finish_reason=True,
            return_cumulative_logprob=True, return_num_input_tokens=True,
            return_num_output_tokens=True,
        ),
    )  # fmt: skip
    reasons = [r.as_numpy("finish_reason")[0].decode() for r in responses]
    assert reasons == ["None"] * (len(responses) - 1) + ["length"]  # vLLM backend's str()
    counts = [int(r.as_numpy("num_output_tokens")[0]) for r in responses]
    # the tokens of each response: one a step, more where steps were merged
    assert all(c >= 1 for c in counts) and sum(counts) == GREEDY["max_tokens"]
    inputs = {int(r.as_numpy("num_input_tokens")[0]) for r in responses}
    assert inputs == {reference["usage"]["prompt_tokens"]}
    cumulative = [float(r.as_numpy("cumulative_logprob")[0]) for r in responses]
    running = np.cumsum(reference["logprobs"]["token_logprobs"])
    assert cumulative == pytest.approx([running[i - 1] for i in np.cumsum(counts)], abs=1e-4)
    # not asked for: absent
    plain = _stream(server, _inputs(grpcclient, stream=True, sampling=GREEDY))
    assert plain[-1].as_numpy("finish_reason") is None
    assert plain[-1].as_numpy("num_output_tokens") is None


def test_grpc_stream_whole_response(server: KilnProcess) -> None:
    want = _completion(server)["text"]
    # stream false on the stream: one final response, the prompt first (vLLM backend's
    # default), the request's parameters standing in for sampling_parameters
    responses = _stream(server, _inputs(grpcclient, stream=False), parameters=GREEDY)
    assert len(responses) == 1
    assert _text(responses[0]) == PROMPT + want
    excluded = _stream(
        server,
        _inputs(grpcclient, sampling=GREEDY, exclude_input_in_output=True,
                return_num_output_tokens=True, return_finish_reason=True),
    )  # fmt: skip
    assert len(excluded) == 1
    assert _text(excluded[0]) == want
    assert int(excluded[0].as_numpy("num_output_tokens")[0]) == GREEDY["max_tokens"]
    assert excluded[0].as_numpy("finish_reason")[0] == b"length"


def test_grpc_stream_refusals(server: KilnProcess) -> None:
    # Triton's vLLM backend's own refusal: the prompt cannot lead a stream of deltas
    bad = _stream(server, _inputs(grpcclient, stream=True, exclude_input_in_output=False))
    assert isinstance(bad[-1], InferenceServerException)
    assert "`exclude_input_in_output` = False is not allowed" in bad[-1].message()
    unknown = _stream(server, _inputs(grpcclient, stream=True, sampling={"beam_width": 2}))
    assert isinstance(unknown[-1], InferenceServerException)
    assert "beam_width" in unknown[-1].message()


def test_http_and_grpc_infer_whole_output(server: KilnProcess) -> None:
    want = _completion(server)["text"]
    # sampling values as strings, as the vLLM backend's CI sends them
    strings = {"temperature": "0", "top_p": "1", "max_tokens": "8", "ignore_eos": "true"}
    with httpclient.InferenceServerClient(server.http_url) as http:
        result = http.infer(MODEL, _inputs(httpclient, sampling=strings))
        assert _text(result) == PROMPT + want
        excluded = http.infer(
            MODEL,
            _inputs(httpclient, sampling=GREEDY, exclude_input_in_output=True,
                    return_num_input_tokens=True),
        )  # fmt: skip
        assert _text(excluded) == want
        assert excluded.as_numpy("num_input_tokens").dtype == np.uint32
        assert excluded.as_numpy("finish_reason") is None  # not asked for
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = grpc.infer(MODEL, _inputs(grpcclient, sampling=GREEDY))
        assert _text(result) == PROMPT + want
    finally:
        grpc.close()


@pytest.mark.parametrize(
    ("sampling", "named"),
    [
        ("{not json", "sampling_parameters"),
        ({"temperature": 0, "beam_width": 2}, "beam_width"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 8.5}, "max_tokens"),
        ({"n": 2}, "'n'"),
        ("[1, 2]", "sampling_parameters"),
        ({"lora_name": "a"}, "LoRA is not enabled"),
    ],
)
def test_bad_sampling_parameters_named(server: KilnProcess, sampling: Any, named: str) -> None:
    url = f"http://{server.http_url}/v2/models/{MODEL}/infer"
    text = sampling if isinstance(sampling, str) else json.dumps(sampling)
    body = {
        "inputs": [
            {"name": "text_input", "datatype": "BYTES", "shape": [1], "data": [PROMPT]},
            {"name": "sampling_parameters", "datatype": "BYTES", "shape": [1], "data": [text]},
        ]
    }
    reply = requests.post(url, json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert named in reply.json()["error"]
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with pytest.raises(InferenceServerException) as caught:
            grpc.infer(MODEL, _inputs(grpcclient, sampling=sampling))
        assert caught.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert named in caught.value.message()
    finally:
        grpc.close()


def test_infer_refuses_stream_and_unknown_inputs(server: KilnProcess) -> None:
    with httpclient.InferenceServerClient(server.http_url) as http:
        with pytest.raises(InferenceServerException, match="'stream'"):
            http.infer(MODEL, _inputs(httpclient, stream=True))
        # the vLLM backend's return_logprobs is not served: refused by name, not ignored
        with pytest.raises(InferenceServerException, match="return_logprobs"):
            http.infer(MODEL, _inputs(httpclient, return_logprobs=True))


def test_generate_endpoints(server: KilnProcess) -> None:
    want = _completion(server)["text"]
    base = f"http://{server.http_url}/v2/models/{MODEL}"
    sampling = json.dumps(GREEDY)
    reply = requests.post(
        f"{base}/generate", json={"text_input": PROMPT, "sampling_parameters": sampling}, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == PROMPT + want
    stream = requests.post(
        f"{base}/generate_stream",
        json={"text_input": PROMPT, "parameters": {**GREEDY, "return_finish_reason": True}},
        timeout=60,
        stream=True,
    )
    events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith(b"data: ")]
    assert "".join(e["text_output"] for e in events) == want
    assert events[-1]["finish_reason"] == "length"


def test_metadata_and_config_auto_completed(server: KilnProcess) -> None:
    with httpclient.InferenceServerClient(server.http_url) as http:
        meta = http.get_model_metadata(MODEL)
        config = http.get_model_config(MODEL)
    inputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["inputs"]}
    assert inputs["text_input"] == ("BYTES", [1])
    assert inputs["sampling_parameters"] == ("BYTES", [1])
    assert inputs["stream"] == ("BOOL", [1])
    outputs = {t["name"]: (t["datatype"], t["shape"]) for t in meta["outputs"]}
    assert outputs["text_output"] == ("BYTES", [-1])
    assert outputs["cumulative_logprob"] == ("FP32", [-1])
    assert outputs["num_input_tokens"] == ("UINT32", [1])
    assert config["model_transaction_policy"]["decoupled"] is True
    optional = {t["name"]: t.get("optional", False) for t in config["input"]}
    assert optional["text_input"] is False
    assert optional["return_finish_reason"] is True


def _metric(server: KilnProcess, name: str) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    for line in text.splitlines():
        if line.startswith(name + "{") and f'"{MODEL}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


def _running(server: KilnProcess) -> float:
    return _metric(server, "vllm:num_requests_running")


def test_cancelled_stream_aborts_the_sequence(server: KilnProcess) -> None:
    """A client that cancels its stream mid-generation ends its sequence in the engine (it
    would otherwise run to max_tokens), and the model's statistics count it as failed."""
    got: queue.Queue[Any] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    long = {"temperature": 0, "max_tokens": 240, "ignore_eos": True}
    before = _metric(server, "vllm:generation_tokens_total")
    client.start_stream(callback=lambda result, error: got.put(error or result))
    client.async_stream_infer(MODEL, inputs=_inputs(grpcclient, stream=True, sampling=long))
    got.get(timeout=60)  # generation has started
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = 600  # polls of 0.1 s: the engine's thread sees the abort at its next step
    while _running(server) and deadline:
        deadline -= 1
        time.sleep(0.1)
    assert _running(server) == 0
    assert _metric(server, "vllm:generation_tokens_total") - before < 240  # aborted
    stats = requests.get(f"http://{server.http_url}/v2/models/{MODEL}/stats", timeout=10).json()
    fail = stats["model_stats"][0]["inference_stats"]["fail"]
    assert fail["count"] >= 1
