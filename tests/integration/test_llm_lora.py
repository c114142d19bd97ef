"""Multi-LoRA served as vLLM serves it: ``kiln serve --enable-lora --lora-modules``, the
real ``openai`` client choosing an adapter by ``model``, ``/v1/models``, runtime load and
unload behind ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``, each bad input refused by name, and the
engine in its own process (killed: the adapters still served by the next one)."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

openai = pytest.importorskip("openai")
pytest.importorskip("peft")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import (  # noqa: E402
    build_lora_adapter,
    build_tiny_llm,
    reference_generate_lora,
)
from tests.procs import engine_pid, gone  # noqa: E402

PROMPT = list(range(30, 70))  # 40 tokens: 10 blocks of 4 the prefix cache could share
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_llm(root / "base")
    allowed = root / "allowed"
    return {
        "base": base,
        "a": build_lora_adapter(base, root / "operator" / "a", seed=1, r=8),
        "b": build_lora_adapter(
            base, root / "operator" / "b", seed=2, r=4, target_modules=("q_proj", "v_proj")
        ),
        "c": build_lora_adapter(
            base, allowed / "c", seed=3, r=8, target_modules=("o_proj", "down_proj")
        ),
        "wide": build_lora_adapter(base, allowed / "wide", seed=4, r=32),
        "outside": build_lora_adapter(base, root / "outside", seed=5, r=4),
        "allowed": allowed,
    }


@pytest.fixture(scope="module")
def expected(files: dict[str, Path]) -> dict[str | None, str]:
    """PEFT's greedy tokens with each adapter alone, as text."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(files["base"] / "tokenizer.json"))
    texts = {}
    for name in (None, "a", "b", "c"):
        adapter = files[name] if name else None
        ids = reference_generate_lora(files["base"], adapter, PROMPT, MAX_TOKENS)
        texts[name] = tokenizer.decode(ids)
    assert len(set(texts.values())) == 4, "each adapter changes the output"
    return texts


def _serve(files: dict[str, Path], home: Path, allow_runtime: bool) -> KilnProcess:
    b = json.dumps({"name": "b", "path": str(files["b"]), "base_model_name": "base"})
    args = ["--model", str(files["base"]), "--served-model-name", "base", "--enable-lora"]
    args += ["--lora-modules", f"a={files['a']}", "--lora-modules", b, "--max-loras", "2"]
    args += ["--max-lora-rank", "16", "--allowed-lora-path", str(files["allowed"])]
    args += ["--dtype", "float32", "--kv-cache-memory", "1M", "--block-size", "4"]
    saved = os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
    if allow_runtime:
        os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    try:
        return KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=180)
    finally:
        os.environ.pop("VLLM_ALLOW_RUNTIME_LORA_UPDATING", None)
        if saved is not None:
            os.environ["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = saved


@pytest.fixture(scope="module")
def server(
    files: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KilnProcess]:
    proc = _serve(files, tmp_path_factory.mktemp("home"), allow_runtime=True)
    yield proc
    proc.stop()


@pytest.fixture
def client(server: KilnProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


def _completion(client: openai.OpenAI, model: str) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert out.model == model
    return out.choices[0].text


def _prefix_hits(server: KilnProcess) -> float:
    text = requests.get(server.metrics_url, timeout=10).text
    found = re.search(
        r'^vllm:prefix_cache_hits_total\{[^}]*model_name="base"[^}]*\} (\S+)', text, re.M
    )
    assert found, "vllm:prefix_cache_hits_total for base"
    return float(found[1])


def test_adapters_are_listed_with_their_base_model(client: openai.OpenAI) -> None:
    cards = {m.id: m for m in client.models.list()}
    assert set(cards) == {"base", "a", "b"}
    assert cards["a"].parent == "base" and cards["b"].parent == "base"  # type: ignore[attr-defined]
    assert cards["base"].parent is None  # type: ignore[attr-defined]


def test_each_adapter_matches_peft_and_the_cache_is_keyed_by_it(
    client: openai.OpenAI, server: KilnProcess, expected: dict[str | None, str]
) -> None:
    before = _prefix_hits(server)
    for model, name in (("a", "a"), ("b", "b"), ("base", None)):
        assert _completion(client, model) == expected[name], model
    assert _prefix_hits(server) == before, "a prompt reused K/V computed under another adapter"
    assert _completion(client, "a") == expected["a"]
    assert _prefix_hits(server) > before  # the same adapter again: its own blocks
    # concurrently: the engine batches them into shared steps
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda m: _completion(client, m), ["a", "base", "b"] * 2))
    assert got == [expected["a"], expected[None], expected["b"]] * 2
    # vLLM's LoRA gauge (nothing runs now: no adapter names)
    metrics = requests.get(server.metrics_url, timeout=10).text
    assert re.search(r'^vllm:lora_requests_info\{[^}]*max_lora="2"', metrics, re.M)


def test_chat_takes_the_adapter_too(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="b", messages=[{"role": "user", "content": "hello world"}], max_tokens=3
    )
    assert reply.model == "b" and reply.usage is not None and reply.usage.completion_tokens == 3


def test_an_unknown_adapter_is_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


def _post(server: KilnProcess, path: str, body: dict[str, str]) -> requests.Response:
    return requests.post(f"http://{server.http_url}/v1/{path}", json=body, timeout=60)


def test_load_and_unload_at_runtime(
    client: openai.OpenAI, server: KilnProcess, files: dict[str, Path],
    expected: dict[str | None, str],
) -> None:  # fmt: skip
    loaded = _post(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(files["c"])})
    assert loaded.status_code == 200, loaded.text
    assert "c" in {m.id for m in client.models.list()}
    assert _completion(client, "c") == expected["c"]
    # three adapters, two slots: they take turns, each still its own tokens
    with ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda m: _completion(client, m), ["a", "b", "c"]))
    assert got == [expected["a"], expected["b"], expected["c"]]
    again = _post(server, "load_lora_adapter", {"lora_name": "c", "lora_path": str(files["c"])})
    assert again.status_code == 400 and "already been loaded" in again.text
    gone = _post(server, "unload_lora_adapter", {"lora_name": "c"})
    assert gone.status_code == 200, gone.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="c", prompt="hi", max_tokens=2)
    unknown = _post(server, "unload_lora_adapter", {"lora_name": "c"})
    assert unknown.status_code == 404 and "The lora adapter 'c' cannot be found" in unknown.text


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("wide", "rank 32 is above --max-lora-rank (16)"),
        ("outside", "is outside the folders allowed for LoRA adapters"),
        ("link", "is outside the folders allowed for LoRA adapters"),
        ("base", "already been loaded (or a model has that name)"),
    ],
)
def test_bad_runtime_loads_are_refused_naming_why(
    server: KilnProcess, files: dict[str, Path], name: str, why: str
) -> None:
    path = files.get(name, files["allowed"])
    if name == "link":  # a link inside the allowed folder to one outside it
        link = files["allowed"] / "link"
        if not link.exists():
            link.symlink_to(files["outside"])
        path = link
    reply = _post(server, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
    assert reply.status_code == 400, reply.text
    assert why in reply.json()["error"]["message"]


def test_runtime_updates_need_the_operators_switch(files: dict[str, Path], tmp_path: Path) -> None:
    proc = _serve(files, tmp_path, allow_runtime=False)
    try:
        reply = _post(proc, "load_lora_adapter", {"lora_name": "c", "lora_path": str(files["c"])})
        assert reply.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in reply.text
        # the adapters of --lora-modules are served all the same
        assert {
            m["id"]
            for m in requests.get(f"http://{proc.http_url}/v1/models", timeout=10).json()["data"]
        } == {"base", "a", "b"}
    finally:
        proc.stop()


def test_triton_generate_takes_lora_name(client: openai.OpenAI, server: KilnProcess) -> None:
    """Triton's vLLM backend names the adapter in its sampling parameters."""
    text = "the quick brown fox"
    want = client.completions.create(model="a", prompt=text, max_tokens=6, temperature=0)
    url = f"http://{server.http_url}/v2/models/base/generate"
    body = {"text_input": text, "exclude_input_in_output": True,
            "parameters": {"lora_name": "a", "max_tokens": 6, "temperature": 0}}  # fmt: skip
    reply = requests.post(url, json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["text_output"] == want.choices[0].text
    body["parameters"]["lora_name"] = "nope"  # type: ignore[index]
    reply = requests.post(url, json=body, timeout=60)
    assert reply.status_code == 400 and "lora_name 'nope' is not an adapter" in reply.text


def test_kserve_infer_takes_lora_name(client: openai.OpenAI, server: KilnProcess) -> None:
    """KServe v2 infer (the real ``tritonclient``, HTTP and gRPC) with Triton's vLLM-backend
    tensors: ``lora_name`` in ``sampling_parameters`` picks the adapter; a name that is not
    served is refused naming it and the adapters that are."""
    import numpy as np
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from tritonclient.utils import InferenceServerException

    text = "the quick brown fox"
    want = client.completions.create(model="b", prompt=text, max_tokens=6, temperature=0)
    base = client.completions.create(model="base", prompt=text, max_tokens=6, temperature=0)
    assert want.choices[0].text != base.choices[0].text

    def inputs(module: object, lora: str) -> list[object]:
        sampling = {"temperature": 0, "max_tokens": 6, "lora_name": lora}
        tensors = []
        for name, value in (("text_input", text), ("sampling_parameters", json.dumps(sampling))):
            t = module.InferInput(name, [1], "BYTES")  # type: ignore[attr-defined]
            t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
            tensors.append(t)
        flag = module.InferInput("exclude_input_in_output", [1], "BOOL")  # type: ignore[attr-defined]
        flag.set_data_from_numpy(np.array([True]))
        return [*tensors, flag]

    with httpclient.InferenceServerClient(server.http_url) as http:
        result = http.infer("base", inputs(httpclient, "b"))
        assert result.as_numpy("text_output")[0].decode() == want.choices[0].text
        with pytest.raises(InferenceServerException, match=r"lora_name 'nope'.*served: a, b"):
            http.infer("base", inputs(httpclient, "nope"))
    grpc = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        result = grpc.infer("base", inputs(grpcclient, "b"))
        assert result.as_numpy("text_output")[0].decode() == want.choices[0].text
    finally:
        grpc.close()


def test_a_vllm_backend_folder_serves_multi_lora_json(
    files: dict[str, Path], client: openai.OpenAI, tmp_path: Path
) -> None:
    """Triton's vLLM-backend model folder: ``enable_lora`` in ``1/model.json``, the adapters
    in ``1/multi_lora.json``; KServe infer picks one by ``lora_name`` and gets what the
    ``--lora-modules`` server (its outputs checked against PEFT above) gives for it."""
    import numpy as np
    import tritonclient.http as httpclient

    version = tmp_path / "repo" / "llama" / "1"
    version.mkdir(parents=True)
    (version.parent / "config.pbtxt").write_text('backend: "vllm"\n')
    engine = {"model": str(files["base"]), "dtype": "float32", "block_size": 4,
              "num_gpu_blocks_override": 256, "enable_lora": "true",
              "max_lora_rank": 16}  # fmt: skip
    (version / "model.json").write_text(json.dumps(engine))
    (version / "multi_lora.json").write_text(
        json.dumps({"a": str(files["a"]), "b": str(files["b"])})
    )
    text = "the quick brown fox"
    proc = KilnProcess(tmp_path / "repo").start(timeout=180)
    try:
        with httpclient.InferenceServerClient(proc.http_url) as http:
            for name in ("a", "b"):
                want = client.completions.create(model=name, prompt=text, max_tokens=6,
                                                 temperature=0)  # fmt: skip
                sampling = json.dumps({"temperature": 0, "max_tokens": 6, "lora_name": name})
                tensors = []
                for key, value in (("text_input", text), ("sampling_parameters", sampling)):
                    t = httpclient.InferInput(key, [1], "BYTES")
                    t.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
                    tensors.append(t)
                result = http.infer("llama", tensors)
                assert result.as_numpy("text_output")[0].decode() == text + want.choices[0].text
    finally:
        proc.stop()


def test_the_adapters_run_in_the_engine_process_and_outlive_its_restart(
    client: openai.OpenAI, server: KilnProcess, files: dict[str, Path],
    expected: dict[str | None, str],
) -> None:  # fmt: skip
    """With ``--enable-lora`` the engine runs in its own process too (vLLM's EngineCore):
    adapters load there, each request carries its own, and after the engine process is
    killed the new one reads an adapter's folder again when a request names it (a
    ``--lora-modules`` one and one loaded at runtime alike)."""
    loaded = _post(server, "load_lora_adapter", {"lora_name": "c2", "lora_path": str(files["c"])})
    assert loaded.status_code == 200, loaded.text
    pid = engine_pid(server)
    os.kill(pid, signal.SIGKILL)
    assert gone(pid)
    deadline = time.monotonic() + 180
    while True:  # a request sent before the server saw the process gone fails with 500
        try:
            first = _completion(client, "a")
            break
        except openai.InternalServerError:
            assert time.monotonic() < deadline, "no engine process after the kill"
            time.sleep(0.5)
    assert engine_pid(server) != pid
    assert first == expected["a"]
    assert _completion(client, "c2") == expected["c"]
    assert _completion(client, "base") == expected[None]
    assert _post(server, "unload_lora_adapter", {"lora_name": "c2"}).status_code == 200
