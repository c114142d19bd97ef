"""vLLM's ``use_beam_search`` over the OpenAI API on a ``kiln serve`` process, driven by
the real ``openai`` client: completions and chat, whole and streamed, lists of prompts,
``echo`` and logprobs, against a beam search over ``transformers``' logits; every kind of
bad input answers 400 naming its field. A client that leaves before a whole answer stops
the work done for it: a search, samples, Triton's ``generate``."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_ending_llm, llm_config, reference_beam_search  # noqa: E402

CONFIG = llm_config(block_size="4", max_num_seqs="16", num_gpu_blocks="256", dtype="float32")
PROMPTS = [[0, 5, 9, 14, 20], [0, 7, 7]]
BEAM: dict[str, Any] = {"use_beam_search": True}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("beam") / "repo"
    folder = build_ending_llm(repo / "tiny" / "1")
    # sampling defaults of the checkpoint's: beam search leaves them (a penalty from the
    # model would be refused as though the client had sent it)
    generation = folder / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.exists() else {}
    generation.write_text(json.dumps({**config, "repetition_penalty": 1.3, "temperature": 0.6}))
    # the same weights without the prefix cache, which beam search needs
    uncached = llm_config("uncached", block_size="4", num_gpu_blocks="64", dtype="float32",
                          enable_prefix_caching="false", model_path=str(folder))  # fmt: skip
    (repo / "uncached" / "1").mkdir(parents=True)
    (repo / "uncached" / "config.pbtxt").write_text(uncached)
    # room for three requests at once, running or waiting
    narrow = llm_config("narrow", block_size="4", num_gpu_blocks="256", dtype="float32",
                        max_num_seqs="2", max_waiting="1", model_path=str(folder))  # fmt: skip
    (repo / "narrow" / "1").mkdir(parents=True)
    (repo / "narrow" / "config.pbtxt").write_text(narrow)
    (repo / "tiny" / "config.pbtxt").write_text(CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(model: Path) -> Iterator[KilnProcess]:
    proc = KilnProcess(model).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from kiln.llm.tokenizer import Tokenizer

    return Tokenizer.load(model / "tiny" / "1")


def _expected(model: Path, tokenizer: Any, prompt: list[int], n: int, penalty: float) -> list[str]:
    eos = tokenizer.eos_token_id
    beams = reference_beam_search(model / "tiny" / "1", prompt, n, 8, eos, penalty)
    return [tokenizer.decode(tokens) for tokens, _ in beams]


def _metric(server: KilnProcess, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics").read()
    for line in text.decode().splitlines():
        if line.startswith(name + "{") and 'model_name="tiny"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


@pytest.mark.parametrize("penalty", [1.0, 0.0])
def test_completions_beams_are_the_reference_search(
    client: openai.OpenAI, model: Path, tokenizer: Any, penalty: float
) -> None:
    out = client.completions.create(
        model="tiny", prompt=PROMPTS, n=3, max_tokens=8,
        extra_body={**BEAM, "length_penalty": penalty},
    )  # fmt: skip
    assert [c.index for c in out.choices] == list(range(6))
    for i, prompt in enumerate(PROMPTS):
        choices = out.choices[3 * i : 3 * i + 3]
        assert [c.text for c in choices] == _expected(model, tokenizer, prompt, 3, penalty)
        assert {c.finish_reason for c in choices} <= {"stop", "length"}
    assert out.usage is not None and out.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert out.usage.completion_tokens > 0


def test_streamed_beams_equal_the_whole_answer(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model="tiny", prompt=PROMPTS[0], n=3, max_tokens=8, extra_body=BEAM)
    whole = client.completions.create(**kw)
    texts = {i: "" for i in range(3)}
    reasons: dict[int, str | None] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]
    assert [reasons[i] for i in range(3)] == [c.finish_reason for c in whole.choices]


def test_chat_beams_search_the_rendered_prompt(
    client: openai.OpenAI, http: httpx.Client, model: Path, tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    ids = http.post("/tokenize", json={"model": "tiny", "messages": messages}).json()["tokens"]
    chat = client.chat.completions.create(
        model="tiny",
        messages=messages,
        n=2,
        max_tokens=8,
        extra_body=BEAM,  # type: ignore[arg-type]
    )
    want = _expected(model, tokenizer, ids, 2, 1.0)
    assert [c.message.content for c in chat.choices] == want
    chunks = client.chat.completions.create(
        model="tiny",
        messages=messages,
        n=2,
        max_tokens=8,
        stream=True,
        extra_body=BEAM,  # type: ignore[arg-type]
    )
    streamed = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert [streamed[0], streamed[1]] == want


def test_echo_logprobs_and_stop_strings(client: openai.OpenAI, tokenizer: Any) -> None:
    prompt = tokenizer.decode(PROMPTS[0])
    out = client.completions.create(
        model="tiny", prompt=prompt, n=2, max_tokens=8, echo=True, logprobs=2, extra_body=BEAM
    )
    plain = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=8,
                                      extra_body=BEAM)  # fmt: skip
    for echoed, alone in zip(out.choices, plain.choices, strict=True):
        assert echoed.text == prompt + alone.text
        lp = echoed.logprobs
        assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
        assert lp.token_logprobs[0] is None  # the prompt's first token: nothing predicts it
        # the two likeliest and the token itself, by text (vLLM's: up to logprobs + 1)
        tops = lp.top_logprobs[1:]
        assert all(1 <= len(top) <= 3 for top in tops)
        assert all(tok in top for tok, top in zip(lp.tokens[1:], tops, strict=True))
        assert "".join(lp.tokens) == echoed.text
    # a stop string cut from the best beams' text ends those beams there
    best = plain.choices[0].text
    stop = best[2:4] if len(best) >= 4 else None
    if stop:
        cut = client.completions.create(model="tiny", prompt=prompt, n=2, max_tokens=8,
                                        stop=[stop], extra_body=BEAM)  # fmt: skip
        assert all(stop not in c.text for c in cut.choices)
        assert any(c.finish_reason == "stop" for c in cut.choices)


def test_beam_search_without_the_prefix_cache_is_refused(http: httpx.Client) -> None:
    """Each step's requests hold their whole sequence: without the prefix cache every beam
    would be recomputed from the prompt's start at every step."""
    body = {"model": "uncached", "prompt": "hello", "max_tokens": 4, **BEAM}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "use_beam_search"
    assert "prefix cache" in reply.json()["error"]["message"]
    plain = http.post("/v1/completions", json={**body, "use_beam_search": False})
    assert plain.status_code == 200, plain.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"length_penalty": 0.5}, "length_penalty"),  # without use_beam_search
        ({**BEAM, "length_penalty": 1e9}, "length_penalty"),
        ({**BEAM, "length_penalty": "long"}, "length_penalty"),
        ({"use_beam_search": "yes"}, "use_beam_search"),
        ({**BEAM, "n": 11}, "n"),  # 22 candidates a beam: more than max_logprobs (20)
        ({**BEAM, "presence_penalty": 0.5}, "presence_penalty"),
        ({**BEAM, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({**BEAM, "logit_bias": {"5": 3}}, "logit_bias"),
        ({**BEAM, "allowed_token_ids": [5, 6]}, "allowed_token_ids"),
        ({**BEAM, "bad_words": ["the"]}, "bad_words"),
        ({**BEAM, "response_format": {"type": "json_object"}}, "use_beam_search"),
        ({**BEAM, "n": 2, "best_of": 3}, "best_of"),
    ],
)
def test_bad_beam_search_requests_are_400(
    http: httpx.Client, extra: dict[str, Any], param: str
) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


LONG = {"max_tokens": 240, "ignore_eos": True}


@pytest.mark.parametrize(
    ("path", "body", "asked", "wait"),
    [
        # 10 beams for 240 steps, and 64 samples of 240 tokens: seconds of work anywhere
        ("/v1/completions", {"prompt": "a long story", "n": 10, "use_beam_search": True,
                             "model": "tiny", **LONG}, 2400, 0.3),
        ("/v1/completions", {"prompt": ["a long story"] * 4, "n": 16, "temperature": 0,
                             "model": "tiny", **LONG}, 15360, 0.3),
        # Triton's generate: one sequence of 240 tokens, a few tenths of a second
        ("/v2/models/tiny/generate", {"text_input": "a long story", "parameters": LONG},
         240, 0.05),
    ],
    ids=["beam-search", "samples", "triton-generate"],
)  # fmt: skip
def test_a_client_that_leaves_before_its_answer_stops_its_work(
    server: KilnProcess, path: str, body: dict[str, Any], asked: int, wait: float
) -> None:
    """A long request (not streamed) whose client disconnects before the answer: its
    engine requests are aborted, nothing keeps running for nobody."""
    before = _metric(server, "vllm:generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"http://{server.http_url}{path}", json=body, timeout=wait)
    # the counters settle (the last step's tokens are counted), then stay
    settled, deadline = -1.0, time.monotonic() + 30
    while time.monotonic() < deadline:
        now = _metric(server, "vllm:generation_tokens_total")
        if now == settled and not _metric(server, "vllm:num_requests_running"):
            break
        settled = now
        time.sleep(0.5)
    time.sleep(1.0)
    assert _metric(server, "vllm:num_requests_running") == 0
    assert _metric(server, "vllm:generation_tokens_total") == settled
    # far fewer tokens than were asked for
    assert settled - before < asked / 2


def test_a_step_the_queue_cannot_take_fails_the_search_with_its_status(
    server: KilnProcess,
) -> None:
    """Each step's beams are requests of the engine: when its queue is full (two other
    streams hold two of its three places), the search fails with the queue's 503, in
    OpenAI's shape, not a server error; the other clients are untouched."""
    url = f"http://{server.http_url}/v1/completions"
    long = {"model": "narrow", "prompt": "a long story", "max_tokens": 200, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with (
        httpx.Client(timeout=60) as a,
        httpx.Client(timeout=60) as b,
        a.stream("POST", url, json=long) as one,
        b.stream("POST", url, json=long) as two,
    ):
        streams = [one.iter_lines(), two.iter_lines()]
        for lines in streams:
            assert next(lines).startswith('data: {"id"')
        beams = {"model": "narrow", "prompt": "hello", "n": 2, "max_tokens": 4, **BEAM}
        reply = httpx.post(url, json=beams, timeout=60)
        assert reply.status_code == 503, reply.text
        assert "queue is full" in reply.json()["error"]["message"]
        for lines in streams:
            assert [line for line in lines if line.startswith("data: ")][-1] == "data: [DONE]"
