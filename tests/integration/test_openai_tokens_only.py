"""vLLM's ``--tokens-only`` (its Disaggregated Everything server) on a real checkpoint (the
SmolLM2-135M-Instruct GGUF), through the ``openai`` client and ``httpx``: the scale-out
routes without ``--enable-scale-out``, generate never detokenizing, the text routes
answering as vLLM's do without a tokenizer (``skip_tokenizer_init``: 400), completions of
token ids running undetokenized, and the legacy ``POST /abort_requests``."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import SMOLLM2, smollm2_gguf  # noqa: E402

NAME = SMOLLM2
#: vLLM's renderer, asked for its tokenizer under skip_tokenizer_init
NO_TOKENIZER = "Tokenizer not available when `skip_tokenizer_init=True`"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
IDS = [1, 504, 3458, 282, 4649]  # a prompt of token ids


def _server(tmp_path_factory: pytest.TempPathFactory, env: dict[str, str]) -> KilnProcess:
    home = tmp_path_factory.mktemp("smollm2-tokens-only")
    args = ["--model", str(smollm2_gguf()), "--max-model-len", "1024", "--max-num-seqs", "4",
            "--tokens-only"]  # fmt: skip
    return KilnProcess(home / "repo", args=args, with_repository=False, env=env).start(timeout=600)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    proc = _server(tmp_path_factory, {})
    yield proc
    proc.stop()


def _refused(reply: Any, param: str | None = None) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["param"] == param
    message: str = error["message"]
    return message


def test_the_scale_out_routes_are_served_without_enable_scale_out(http: Any) -> None:
    rendered = http.post("/v1/completions/render", json={"model": NAME, "prompt": IDS})
    assert rendered.status_code == 200, rendered.text
    (request,) = rendered.json()
    assert request["token_ids"] == IDS
    request["sampling_params"] = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    generated = http.post("/inference/v1/generate", json=request)
    assert generated.status_code == 200, generated.text
    (choice,) = generated.json()["choices"]
    assert len(choice["token_ids"]) == 8 and "text" not in choice


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"sampling_params": {"stop": ["."]}}, "sampling_params.stop", "use stop_token_ids"),
        ({"sampling_params": {}, "output_mode": "text"}, "output_mode", "requires a tokenizer"),
    ],
)
def test_generate_never_detokenizes(
    http: Any, body: dict[str, Any], param: str, words: str
) -> None:
    """vLLM's force_no_detokenize: what needs the text is refused in its words."""
    reply = http.post("/inference/v1/generate", json={"token_ids": IDS, **body})
    assert words in _refused(reply, param)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": NAME, "prompt": "Once upon a time"}),
        ("/v1/completions", {"model": NAME, "prompt": [IDS, "Once upon a time"]}),
        ("/v1/chat/completions", {"model": NAME, "messages": CHAT}),
        ("/v1/chat/completions/render", {"model": NAME, "messages": CHAT}),
        ("/v1/completions/render", {"model": NAME, "prompt": "Once"}),
        ("/v1/responses", {"model": NAME, "input": "hi"}),
        ("/tokenize", {"model": NAME, "prompt": "hi"}),
        ("/detokenize", {"model": NAME, "tokens": IDS}),
        ("/v1/completions/derender", {"generate_responses": []}),
        ("/invocations", {"model": NAME, "messages": CHAT}),
        ("/invocations", {"model": NAME, "prompt": "Once upon a time"}),
    ],
)  # fmt: skip
def test_text_routes_answer_as_vllms_without_a_tokenizer(
    http: Any, path: str, body: dict[str, Any]
) -> None:
    assert _refused(http.post(path, json=body)) == NO_TOKENIZER


def test_the_openai_client_sees_vllms_error(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=4)
    assert caught.value.status_code == 400 and NO_TOKENIZER in str(caught.value)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=NAME, prompt="Once upon a time", max_tokens=4)
    assert NO_TOKENIZER in str(caught.value)


def test_completions_of_token_ids_run_undetokenized(client: Any) -> None:
    """As vLLM's no-op detokenizer: the choices' text is "", the tokens are generated."""
    whole = client.completions.create(
        model=NAME, prompt=IDS, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert [c.text for c in whole.choices] == [""]
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=NAME, prompt=IDS, max_tokens=64, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert "".join(c.text for chunk in chunks for c in chunk.choices) == ""
    assert chunks[-1].choices[0].finish_reason == "length"
    assert len(chunks) > 2  # streamed as the tokens come, not only at the end


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": ["."]}, "stop"),
        ({"echo": True}, "echo"),
        ({"logprobs": 1}, "logprobs"),
        ({"use_beam_search": True, "n": 2}, "use_beam_search"),
        ({"response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)
def test_completions_of_token_ids_refuse_what_needs_text(
    http: Any, fields: dict[str, Any], param: str
) -> None:
    body = {"model": NAME, "prompt": IDS, "max_tokens": 4, **fields}
    assert _refused(http.post("/v1/completions", json=body), param)


def test_logprobs_named_by_token_id_need_no_text(http: Any) -> None:
    body = {"model": NAME, "prompt": IDS, "max_tokens": 3, "logprobs": 1,
            "return_tokens_as_token_ids": True}  # fmt: skip
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    tokens = reply.json()["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 3 and all(t.startswith("token_id:") for t in tokens)


def test_the_legacy_abort_requests_ends_a_generation(server: KilnProcess, http: Any) -> None:
    body = {"request_id": "legacy", "token_ids": IDS, "stream": True,
            "sampling_params": {"max_tokens": 900, "ignore_eos": True}}  # fmt: skip
    with (
        httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other,
        http.stream("POST", "/inference/v1/generate", json=body) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        aborted = threading.Event()

        def abort() -> None:
            ids = {"request_ids": ["generate-tokens-legacy"]}
            assert other.post("/abort_requests", json=ids).status_code == 200
            aborted.set()

        worker = threading.Thread(target=abort)
        worker.start()
        events = [line[6:] for line in lines if line.startswith("data: ")]
        worker.join(60)
    assert aborted.is_set() and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    missing = http.post("/abort_requests", json={})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "request_ids"
    for ids in (["x"] * 1025, ["x" * 600]):  # counted and measured, as generate's route
        too_much = http.post("/abort_requests", json={"request_ids": ids})
        assert too_much.status_code == 400 and too_much.json()["error"]["param"] == "request_ids"


def test_dev_mode_keeps_its_own_abort_requests(tmp_path_factory: pytest.TempPathFactory) -> None:
    """vLLM registers the legacy path only where the RL dev router has none."""
    proc = _server(tmp_path_factory, {"VLLM_SERVER_DEV_MODE": "1"})
    try:
        reply = httpx.post(f"http://{proc.http_url}/abort_requests", json={"request_ids": ["x"]})
        assert reply.json() == {"status": "aborted", "aborted": 1}  # the dev route's answer
    finally:
        proc.stop()
