"""``kiln serve --model PATH``: a Hugging Face folder served without a config.pbtxt, with
vLLM's engine flags, driven by the real ``openai`` client."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm, reference_generate  # noqa: E402

PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny-llama")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """No --model-repository at all: the folder alone, under two names, with the flags
    (the first as vLLM's positional MODEL, the second as --model), some of them from a
    vLLM config file and in vLLM's spellings."""
    home = tmp_path_factory.mktemp("home")
    config = home / "serve.yaml"
    config.write_text(
        "max_model_len: 128\nmax-num-seqs: 99\nblock-size: 4\nenable-prefix-caching: false\n"
    )
    args = [str(folder), "--model", str(folder), "--served-model-name", "tiny"]
    args += ["--config", str(config), "--max-num-seqs", "4"]  # the command line wins
    args += ["--dtype", "float32", "--max_num_batched_tokens", "64", "--kv-cache-memory", "1M"]
    args += ["--chat-template", "{{ messages[0]['content'] }}!"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _ids(folder: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    ids: list[int] = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    return ids


def _text(folder: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    text: str = Tokenizer.from_file(str(folder / "tokenizer.json")).decode(ids)
    return text


def test_each_model_is_served_under_its_name(client: openai.OpenAI) -> None:
    # the first --model takes --served-model-name, the second its folder's name
    assert sorted(m.id for m in client.models.list()) == ["tiny", "tiny-llama"]


def test_greedy_completion_matches_transformers(client: openai.OpenAI, folder: Path) -> None:
    expected = reference_generate(folder, _ids(folder, PROMPT), 8)
    for name in ("tiny", "tiny-llama"):
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == _text(folder, expected)


def test_flags_reach_the_engine(client: openai.OpenAI, folder: Path) -> None:
    # --max-model-len 128: a request past it is refused naming the limit
    with pytest.raises(openai.BadRequestError, match="128"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=200)
    # --chat-template (inline) replaced the tokenizer's: the prompt is the content and "!"
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": PROMPT}], max_tokens=2
    )
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == len(_ids(folder, PROMPT + "!"))


def test_default_kv_cache_is_logged(folder: Path, tmp_path: Path) -> None:
    proc = KilnProcess(tmp_path / "repo", args=["--model", str(folder)], with_repository=False)
    proc.start(timeout=120)
    try:
        assert "KV cache of" in proc.log() and "CPU default" in proc.log()
    finally:
        proc.stop()


def _serve_fails(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "serve", *args], capture_output=True, timeout=60
    )
    assert done.returncode != 0
    return done.stderr.decode()


def test_bad_command_lines_are_refused(folder: Path, tmp_path: Path) -> None:
    assert "--model-repository, or --model" in _serve_fails([])
    # a vLLM flag kiln lacks: named, with why
    refused = _serve_fails([str(folder), "--enable-eplb"])
    assert "vLLM's --enable-eplb is not supported by kiln: experts run on each" in refused
    # engine flags without a --model: they would silently do nothing
    assert "--max-num-seqs" in _serve_fails(
        ["--model-repository", str(tmp_path), "--max-num-seqs", "2"]
    )
    assert "two models named" in _serve_fails(["--model", str(folder), "--model", str(folder)])
    text = tmp_path / "weights.bin"
    text.write_bytes(b"x")
    assert "not a .gguf file" in _serve_fails(["--model", str(text)])
    (tmp_path / "tiny-llama").mkdir()
    assert "also a model of" in _serve_fails(
        ["--model-repository", str(tmp_path), "--model", str(folder)]
    )


@pytest.fixture(scope="module")
def llama_style(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a Llama-style tokenizer (its post-processor adds ``<s>``), a chat
    template that writes ``<s>`` itself, and a generation_config.json asking for greedy
    decoding and ending on an extra EOS id."""
    from tokenizers import Tokenizer, processors

    out = tmp_path_factory.mktemp("bos") / "llama-style"
    out.mkdir()
    for f in folder.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ bos_token }}" + config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    greedy = reference_generate(out, [bos, *_ids(folder, PROMPT)], 8)
    stop = next(t for i, t in enumerate(greedy) if i >= 2 and t not in greedy[:i])
    generation = {"temperature": 0.0, "eos_token_id": [stop], "max_new_tokens": 12}
    (out / "generation_config.json").write_text(json.dumps(generation))
    return out


@pytest.fixture(scope="module")
def bos_server(
    llama_style: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilnProcess]:
    home = tmp_path_factory.mktemp("bos-home")
    args = ["--model", str(llama_style), "--dtype", "float32", "--kv-cache-memory", "1M"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=120)
    yield proc
    proc.stop()


def test_completions_and_generate_get_bos_chat_does_not_double_it(
    bos_server: KilnProcess, llama_style: Path, folder: Path
) -> None:
    import requests

    client = openai.OpenAI(base_url=f"http://{bos_server.http_url}/v1", api_key="x")
    n = len(_ids(folder, PROMPT))  # the tiny tokenizer without a post-processor
    out = client.completions.create(model="llama-style", prompt=PROMPT, max_tokens=1)
    assert out.usage is not None and out.usage.prompt_tokens == n + 1
    body = {"text_input": PROMPT, "parameters": {"max_tokens": 1, "return_num_input_tokens": True}}
    url = f"http://{bos_server.http_url}/v2/models/llama-style/generate"
    assert requests.post(url, json=body, timeout=30).json()["num_input_tokens"] == n + 1
    # the template's own <s> is the only one
    messages = [{"role": "user", "content": PROMPT}]
    reply = client.chat.completions.create(model="llama-style", messages=messages, max_tokens=1)
    rendered = "<s><|user|>" + PROMPT + "</s><|assistant|>"
    assert reply.usage is not None and reply.usage.prompt_tokens == len(_ids(folder, rendered))


def test_generation_config_defaults_and_eos(bos_server: KilnProcess, llama_style: Path) -> None:
    from tokenizers import Tokenizer

    client = openai.OpenAI(base_url=f"http://{bos_server.http_url}/v1", api_key="x")
    bos = Tokenizer.from_file(str(llama_style / "tokenizer.json")).token_to_id("<s>")
    greedy = reference_generate(llama_style, [bos, *_ids(llama_style, PROMPT)[1:]], 8)
    stop = json.loads((llama_style / "generation_config.json").read_text())["eos_token_id"][0]
    expected = greedy[: greedy.index(stop)]
    # no temperature in the request: generation_config.json's 0.0 (greedy) applies, and its
    # extra EOS id ends the completion
    for _ in range(2):
        out = client.completions.create(
            model="llama-style", prompt=PROMPT, max_tokens=8, logprobs=0
        )
        assert out.choices[0].finish_reason == "stop"
        assert out.choices[0].logprobs is not None
        # the tokens up to the EOS id and that id (as in vLLM, its logprob is reported)
        shown = [_text(llama_style, [t]) for t in [*expected, stop]]
        assert out.choices[0].logprobs.tokens == shown
    # its max_new_tokens bounds every request's max_tokens, as in vLLM
    out = client.completions.create(
        model="llama-style", prompt=PROMPT, max_tokens=50, extra_body={"ignore_eos": True}
    )
    assert out.usage is not None and out.usage.completion_tokens == 12
    assert out.choices[0].finish_reason == "length"


def test_explicit_mode_loads_it_and_the_repository_api_reloads_it(
    folder: Path, tmp_path: Path
) -> None:
    import requests

    args = ["--model", str(folder), "--model-control-mode", "explicit"]
    args += ["--kv-cache-memory", "1M", "--dtype", "float32"]
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=120)
    try:
        base = f"http://{proc.http_url}"
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        assert [m.id for m in client.models.list()] == ["tiny-llama"]
        index = requests.post(f"{base}/v2/repository/index", json={}, timeout=30).json()
        assert [(m["name"], m["state"]) for m in index] == [("tiny-llama", "READY")]
        url = f"{base}/v2/repository/models/tiny-llama"
        assert requests.post(f"{url}/unload", json={}, timeout=60).status_code == 200
        assert [m.id for m in client.models.list()] == []
        assert requests.post(f"{url}/load", json={}, timeout=120).status_code == 200
        out = client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=2)
        assert out.usage is not None and out.usage.completion_tokens == 2
    finally:
        proc.stop()


def test_kserve_infer_takes_the_vllm_backends_tensors(
    server: KilnProcess, client: openai.OpenAI
) -> None:
    """A ``--model`` checkpoint answers KServe v2 infer (HTTP and gRPC, the real
    ``tritonclient``) with Triton's vLLM-backend tensors, as a repository model does; its
    metadata names them. Before, the in-memory config had no tensors and infer answered
    "unexpected inference input 'text_input'"."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    want = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    sampling = json.dumps({"temperature": 0, "max_tokens": 6})

    def inputs(module: object) -> list[object]:
        text = module.InferInput("text_input", [1], "BYTES")  # type: ignore[attr-defined]
        text.set_data_from_numpy(np.array([PROMPT.encode()], dtype=np.object_))
        params = module.InferInput("sampling_parameters", [1], "BYTES")  # type: ignore[attr-defined]
        params.set_data_from_numpy(np.array([sampling.encode()], dtype=np.object_))
        return [text, params]

    with httpclient.InferenceServerClient(server.http_url) as http:
        meta = http.get_model_metadata("tiny")
        assert "text_input" in [t["name"] for t in meta["inputs"]]
        assert "text_output" in [t["name"] for t in meta["outputs"]]
        result = http.infer("tiny", inputs(httpclient))
        text = result.as_numpy("text_output")[0].decode()
        assert text == PROMPT + want.choices[0].text
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = grpc.infer("tiny", inputs(grpcclient))
        assert result.as_numpy("text_output")[0].decode() == PROMPT + want.choices[0].text
    finally:
        grpc.close()


def test_vllms_tokenizer_template_and_generation_flags(folder: Path, tmp_path: Path) -> None:
    """``--tokenizer`` (weights and tokenizer in two folders), ``--default-chat-template-
    kwargs`` (under a request's own), ``--response-role`` and ``--override-generation-config``
    on one ``kiln serve`` command line, as vLLM reads them."""
    import httpx

    weights, tok = tmp_path / "weights", tmp_path / "tok"
    weights.mkdir()
    tok.mkdir()
    for f in folder.iterdir():
        target = tok if f.name.startswith("tokenizer") else weights
        (target / f.name).write_bytes(f.read_bytes())
    template = "{% if enable_thinking %}<think>{% endif %}{{ messages[0]['content'] }}"
    args = [str(weights), "--served-model-name", "tiny", "--tokenizer", str(tok),
            "--dtype", "float32", "--kv-cache-memory", "1M", "--chat-template", template,
            "--default-chat-template-kwargs", '{"enable_thinking": true}',
            "--response-role", "model", "--override-generation-config",
            '{"max_new_tokens": 3, "temperature": 0}', "--trust-request-chat-template",
            "--enable-force-include-usage", "--return-tokens-as-token-ids"]  # fmt: skip
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=120)
    try:
        with httpx.Client(base_url=f"http://{proc.http_url}", timeout=60) as http:
            messages = [{"role": "user", "content": PROMPT}]

            def rendered(**extra: Any) -> str:
                body = {"model": "tiny", "messages": messages, **extra}
                ids = http.post("/tokenize", json=body).json()["tokens"]
                return str(http.post("/detokenize", json={"tokens": ids}).json()["prompt"])

            assert rendered() == "<think>" + PROMPT  # the server's default
            off = {"chat_template_kwargs": {"enable_thinking": False}}
            assert rendered(**off) == PROMPT  # the request's own wins
            assert rendered(reasoning_effort="none") == PROMPT
            # --trust-request-chat-template: a request's own template, in the sandbox
            own = "{{ messages[0]['content'] }}?{% if enable_thinking %}!{% endif %}"
            assert rendered(chat_template=own) == PROMPT + "?!"
            bomb = {"model": "tiny", "messages": messages, "chat_template": "{{ 'a' * 10**9 }}"}
            reply = http.post("/v1/chat/completions", json=bomb)
            assert reply.status_code == 400 and "chat template" in reply.json()["error"]["message"]
            reply = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages,
                                                            "max_tokens": 2})  # fmt: skip
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["role"] == "model"
            # the override's max_new_tokens bounds every request; its temperature 0 is greedy
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 50, "ignore_eos": True}
            first = http.post("/v1/completions", json=body).json()
            assert first["usage"]["completion_tokens"] == 3
            assert http.post("/v1/completions", json=body).json()["choices"] == first["choices"]
            # --enable-force-include-usage: a stream ends with usage unasked
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as out:
                events = [line for line in out.iter_lines() if line.startswith("data: {")]
            assert json.loads(events[-1][6:])["usage"]["completion_tokens"] == 3

            # --return-tokens-as-token-ids: the default of the request's own field
            def tokens(extra: dict[str, Any]) -> list[str]:
                reply = http.post("/v1/completions", json={**body, "logprobs": 1, **extra})
                return list(reply.json()["choices"][0]["logprobs"]["tokens"])

            assert all(t.startswith("token_id:") for t in tokens({}))
            own = tokens({"return_tokens_as_token_ids": False})
            assert not any(t.startswith("token_id:") for t in own)
    finally:
        proc.stop()
    refused = _serve_fails([str(weights), "--tokenizer", str(tmp_path / "none")])
    assert "--tokenizer" in refused and "does not exist" in refused


def test_several_served_names_for_one_model_as_vllm(folder: Path, tmp_path: Path) -> None:
    """``vllm serve MODEL --served-model-name a b c``: the model answers to each name; the
    first is its name, and /v1/models lists all three (root: the model's)."""
    args = [str(folder), "--served-model-name", "tiny", "small", "little", "--dtype", "float32"]
    args += ["--kv-cache-memory", "1M", "--max-model-len", "64"]
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False).start(timeout=120)
    try:
        client = openai.OpenAI(
            base_url=f"http://{proc.http_url}/v1", api_key="unused", max_retries=0
        )
        cards = {m.id: m for m in client.models.list()}
        assert sorted(cards) == ["little", "small", "tiny"]
        assert {getattr(m, "root", None) for m in cards.values()} == {"tiny"}
        assert client.models.retrieve("little").id == "little"
        texts = {
            name: client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0)
            .choices[0]
            .text
            for name in ("tiny", "small")
        }
        assert texts["tiny"] == texts["small"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=1)
    finally:
        proc.stop()


class _Recording:
    """An httpx transport that notes when the stream's bytes held an SSE comment (the
    ``openai`` client skips comments: the test sees them here)."""

    def __init__(self) -> None:
        import threading

        import httpx

        self.inner = httpx.HTTPTransport()
        self.comment = threading.Event()

    def handle_request(self, request: Any) -> Any:
        import httpx

        response = self.inner.handle_request(request)
        seen = self.comment

        class Stream(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                for chunk in response.stream:
                    if b": keep-alive\n\n" in chunk:
                        seen.set()
                    yield chunk

            def close(self) -> None:
                response.stream.close()

        return httpx.Response(response.status_code, headers=response.headers,
                              stream=Stream(), extensions=response.extensions)  # fmt: skip

    def close(self) -> None:
        self.inner.close()


def test_vllms_frontend_and_admission_flags(
    server: KilnProcess, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """--sse-keep-alive-interval, --max-num-queued-reqs, --chat-template-content-format,
    --exclude-tools-when-tool-choice-none and --enable-tokenizer-info-endpoint on one
    command line. The engine is held deterministically: one sequence at a time
    (--max-num-seqs 1) and a first request that runs until the test closes it, so a
    second one waits in the queue for as long as the test wants."""
    import threading

    import httpx

    long_model = build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "long",
                                max_position_embeddings=4096)  # fmt: skip
    template = ("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}|"
                "{% endfor %}{% endfor %}{% if tools %}TOOLS{% endif %}")  # fmt: skip
    args = [str(long_model), "--served-model-name", "tiny", "--dtype", "float32",
            "--kv-cache-memory", "16M", "--max-model-len", "4096", "--max-num-seqs", "1",
            "--chat-template", template, "--sse-keep-alive-interval", "0.01",
            "--max-num-queued-reqs", "2", "--chat-template-content-format", "auto",
            "--exclude-tools-when-tool-choice-none",
            "--enable-tokenizer-info-endpoint"]  # fmt: skip
    home = tmp_path_factory.mktemp("home")
    proc = KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=120)
    base = f"http://{proc.http_url}"
    hold = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True,
            "stream": True}  # fmt: skip
    parts = [{"type": "text", "text": "the quick"}, {"type": "text", "text": "brown fox"}]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": parts}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    try:
        with httpx.Client(base_url=base, timeout=60) as http:
            # auto: the template loops over content, so it gets the parts
            ids = http.post("/tokenize", json={"model": "tiny", "messages": chat["messages"]})
            as_text = http.post("/tokenize", json={"model": "tiny", "add_special_tokens": False,
                                                   "prompt": "the quick|brown fox|"})  # fmt: skip
            assert ids.json()["tokens"] == as_text.json()["tokens"]

            # tool_choice none: no tools in the prompt (the /tokenize of them has them)
            tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
            bare = http.post("/v1/chat/completions", json=chat).json()["usage"]
            hidden = http.post("/v1/chat/completions",
                               json={**chat, "tools": tools, "tool_choice": "none"})  # fmt: skip
            assert hidden.status_code == 200
            assert hidden.json()["usage"]["prompt_tokens"] == bare["prompt_tokens"]
            listed = http.post("/tokenize", json={"model": "tiny", "messages": chat["messages"],
                                                  "tools": tools})  # fmt: skip
            assert listed.json()["count"] > bare["prompt_tokens"]

            # /tokenizer_info: on here, 404 on the server without the flag
            info = http.get("/tokenizer_info")
            assert info.status_code == 200
            body = info.json()
            assert body["chat_template"] == template and body["tokenizer_class"]
            assert "vocab_file" not in body
            unknown = http.get("/tokenizer_info", params={"model": "nope"})
            assert unknown.status_code == 404
            assert httpx.get(f"http://{server.http_url}/tokenizer_info").status_code == 404

            # keep-alive comments while a stream waits behind the one running
            with http.stream("POST", "/v1/completions", json=hold) as first:
                lines = first.iter_lines()
                assert next(line for line in lines if line.startswith("data: {"))
                waiting = {**chat, "stream": True}
                with http.stream("POST", "/v1/chat/completions", json=waiting) as second:
                    assert second.status_code == 200
                    # one iterator throughout: dropping one closes the connection
                    waited = second.iter_lines()
                    seen: list[str] = []
                    for line in waited:
                        seen.append(line)
                        if line == ": keep-alive":
                            break
                    # two requests in flight: a third is refused, vLLM's 503
                    third = http.post("/v1/chat/completions", json=chat)
                    assert third.status_code == 503
                    assert "currently busy" in third.json()["error"]["message"]
                    first.close()  # the running request is aborted: the second runs
                    seen += list(waited)
            events = [line[6:] for line in seen if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]
            assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert all(line in ("", ": keep-alive") or line.startswith("data: ") for line in seen)

            # the openai client reads a stream that carried comments
            transport = _Recording()
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                   http_client=httpx.Client(transport=transport))  # fmt: skip
            got: list[Any] = []
            with http.stream("POST", "/v1/completions", json=hold) as first:
                held = first.iter_lines()  # kept: dropping it closes the connection
                assert next(x for x in held if x.startswith("data: {"))

                failed: list[BaseException] = []

                def read() -> None:
                    try:
                        stream = client.chat.completions.create(
                            model="tiny", messages=chat["messages"], max_tokens=4,
                            temperature=0, stream=True,
                        )  # fmt: skip
                        got.extend(stream)
                    except BaseException as exc:  # seen by the test's thread
                        failed.append(exc)
                        transport.comment.set()

                reader = threading.Thread(target=read)
                reader.start()
                assert transport.comment.wait(60)  # a comment reached the client
                assert not failed, failed
                first.close()
            reader.join(60)
            assert not reader.is_alive()
            assert got[0].choices[0].delta.role == "assistant"
            assert got[-1].choices[0].finish_reason == "length"
            text = "".join(c.choices[0].delta.content or "" for c in got)
            whole = http.post("/v1/chat/completions", json=chat).json()
            assert text == whole["choices"][0]["message"]["content"]
    finally:
        proc.stop()
