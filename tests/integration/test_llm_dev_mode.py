"""vLLM's development / RL control routes (``VLLM_SERVER_DEV_MODE=1``) on a real kiln
server serving SmolLM2-135M-Instruct (GGUF), driven through httpx and the ``openai`` client:
prefix-cache reset, sleep and wake (levels 1 and 2, the engine process's memory measured),
the three pause modes, abort by id, the metrics, weight versions, and 404 without the
switch."""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("gguf")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import SMOLLM2, smollm2_gguf  # noqa: E402
from tests.procs import engine_pid  # noqa: E402

NAME = SMOLLM2
#: long enough for whole prefix-cache blocks (16 tokens each)
QUESTION = [
    {
        "role": "user",
        "content": "Name the three primary colors of paint, then explain in two sentences "
        "why mixing them gives brown rather than black.",
    }
]
LONG = {"ignore_eos": True}  # vLLM's field: a stream long enough to pause in the middle


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_gguf()


@pytest.fixture(scope="module")
def server(gguf_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    home = tmp_path_factory.mktemp("dev")
    args = ["--model", str(gguf_file), "--max-model-len", "1024", "--max-num-seqs", "4",
            "--enable-scale-out"]  # fmt: skip
    proc = KilnProcess(home / "repo", args=args, with_repository=False,
                       env={"VLLM_SERVER_DEV_MODE": "1"}).start(timeout=600)  # fmt: skip
    yield proc
    proc.stop()


@pytest.fixture
def http(server: KilnProcess) -> Iterator[Any]:
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=120) as client:
        yield client


@pytest.fixture
def client(server: KilnProcess) -> Any:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused",
                         max_retries=0, timeout=300)  # fmt: skip


def greedy(client: Any, max_tokens: int = 24) -> Any:
    return client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=max_tokens, temperature=0.0
    )


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_the_server_says_dev_mode_is_on(server: KilnProcess) -> None:
    assert "SECURITY WARNING: Development endpoints are enabled!" in server.log()


def test_reset_prefix_cache_makes_the_next_request_compute_its_whole_prompt(
    client: Any, http: Any
) -> None:
    greedy(client, 2)
    again = greedy(client, 2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    reply = http.post("/reset_prefix_cache")
    assert reply.status_code == 200 and reply.json() == {"success": True}
    after = greedy(client, 2)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.choices[0].message.content == again.choices[0].message.content


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_holds_requests_releases_memory_and_wakes_to_the_same_tokens(
    server: KilnProcess, client: Any, http: Any, level: int
) -> None:
    before = greedy(client)
    pid = engine_pid(server)
    awake_kib = rss_kib(pid)
    reply = http.post("/sleep", params={"level": level})
    assert reply.status_code == 200
    assert reply.json() == {"status": "sleeping", "level": level}
    assert http.get("/is_sleeping").json() == {"is_sleeping": True}
    asleep_kib = rss_kib(pid)
    print(f"level {level}: engine RSS {awake_kib / 1024:.0f} MiB -> {asleep_kib / 1024:.0f} MiB")
    # the KV cache (and at level 2 the weights) went back to the system
    assert asleep_kib < awake_kib - 32 * 1024
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(greedy, client)
        # vLLM's answer to a request that arrives while asleep: it waits for the wake
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert not held.done()
        reply = http.post("/wake_up")
        assert reply.json() == {"status": "awake", "tags": None}
        assert held.result().choices[0].message.content == before.choices[0].message.content
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    after = greedy(client)
    assert after.choices[0].message.content == before.choices[0].message.content
    if level == 2:
        assert "reading the weights again" in server.log()


def test_wake_up_tags_one_at_a_time(http: Any) -> None:
    assert http.post("/sleep", params={"level": 1}).status_code == 200
    reply = http.post("/wake_up", params={"tags": "weights"})
    assert reply.json() == {"status": "sleeping", "tags": ["weights"]}
    reply = http.post("/wake_up", params=[("tags", "kv_cache"), ("tags", "scheduling")])
    assert reply.json() == {"status": "awake", "tags": ["kv_cache", "scheduling"]}
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}


def _stream(client: Any, max_tokens: int, started: threading.Event) -> tuple[str, str, str]:
    """(text, finish_reason, the answer's id) of a streamed greedy chat."""
    text, reason, rid = [], "", ""
    stream = client.chat.completions.create(
        model=NAME, messages=QUESTION, max_tokens=max_tokens, temperature=0.0, stream=True,
        extra_body=LONG,
    )  # fmt: skip
    for chunk in stream:
        rid = chunk.id
        for choice in chunk.choices:
            text.append(choice.delta.content or "")
            if choice.finish_reason:
                reason = choice.finish_reason
        if "".join(text):
            started.set()
    return "".join(text), reason, rid


def test_pause_abort_ends_a_stream_with_finish_reason_abort(client: Any, http: Any) -> None:
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, client, 900, started)
        assert started.wait(120)
        reply = http.post("/pause", params={"mode": "abort"})
        assert reply.status_code == 200 and reply.json() == {"status": "paused"}
        text, reason, _ = running.result()
    assert reason == "abort" and text
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.get("/is_paused").json() == {"is_paused": False}


def test_pause_keep_and_resume_gives_the_uninterrupted_tokens(client: Any, http: Any) -> None:
    done = threading.Event()
    whole, reason, _ = _stream(client, 120, done)
    assert reason == "length"
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, client, 120, started)
        assert started.wait(120)
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").json() == {"status": "resumed"}
        text, reason, _ = running.result()
    assert (text, reason) == (whole, "length")


def test_pause_wait_answers_once_the_stream_ended(client: Any, http: Any) -> None:
    started = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_stream, client, 60, started)
        assert started.wait(120)
        reply = http.post("/pause", params={"mode": "wait"})
        assert reply.json() == {"status": "paused"}
        # drained, not aborted: the stream ran to its length (its last event may reach
        # the client a moment after the pause's answer, as in vLLM)
        _, reason, _ = running.result()
        assert reason == "length"
    assert http.post("/resume").json() == {"status": "resumed"}


def test_abort_requests_by_the_answers_id(client: Any, http: Any) -> None:
    ids: list[str] = []
    started = threading.Event()

    def stream() -> str:
        chunks = client.chat.completions.create(
            model=NAME, messages=QUESTION, max_tokens=900, temperature=0.0, stream=True,
            extra_body=LONG,
        )  # fmt: skip
        reason = ""
        for chunk in chunks:
            ids.append(chunk.id)
            started.set()
            for choice in chunk.choices:
                reason = choice.finish_reason or reason
        return reason

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(stream)
        assert started.wait(120)
        reply = http.post("/abort_requests", json={"request_ids": [ids[0]]})
        assert reply.json() == {"status": "aborted", "aborted": 1}
        assert running.result() == "abort"


def test_abort_requests_reaches_a_completions_prompt_as_vllms_does(client: Any, http: Any) -> None:
    """vLLM's engine knows a completions prompt by ``cmpl-<id>-<i>``: that id ends it."""
    chunks = client.completions.create(
        model=NAME, prompt="Once upon a time", max_tokens=900, temperature=0.0, stream=True,
        extra_body={**LONG, "request_id": "dev-tale"},
    )  # fmt: skip
    first = next(iter(chunks))
    assert first.id == "cmpl-dev-tale"
    reply = http.post("/abort_requests", json={"request_ids": ["cmpl-dev-tale-0"]})
    assert reply.json() == {"status": "aborted", "aborted": 1}
    reasons = [c.finish_reason for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert reasons == ["abort"]


def test_server_info_world_size_and_the_no_op_caches(http: Any) -> None:
    assert http.get("/get_world_size").json() == {"world_size": 1}
    assert http.post("/reset_mm_cache").status_code == 200
    assert http.post("/reset_encoder_cache").status_code == 200
    info = http.get("/server_info").json()
    assert set(info) == {"vllm_config", "vllm_env", "system_env"}
    assert info["vllm_env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert isinstance(http.get("/server_info?config_format=json").json()["vllm_config"], dict)


def test_sleep_metrics_have_vllms_names(server: KilnProcess, http: Any) -> None:
    http.post("/sleep", params={"level": 1})
    assert server.metric("vllm:engine_sleep_state", NAME, 'sleep_state="awake"') == 0
    assert server.metric("vllm:engine_sleep_state", NAME, 'sleep_state="weights_offloaded"') == 1
    http.post("/wake_up")
    assert server.metric("vllm:engine_sleep_state", NAME, 'sleep_state="awake"') == 1
    text = httpx.get(server.metrics_url).text
    assert 'vllm:sleep_mode_operation_duration_seconds_count{operation="sleep"}' in text
    assert 'vllm:sleep_mode_operation_duration_seconds_count{operation="wake"}' in text
    assert 'vllm:sleep_mode_operations_in_flight{operation="sleep"} 0' in text


def test_an_engine_restarted_while_asleep_reads_awake(server: KilnProcess, http: Any) -> None:
    """The engine process dies asleep: the new one loads the model, and the gauge and
    /is_sleeping say so (the gauge read 'asleep' until the next wake)."""
    import os
    import signal
    import time

    assert http.post("/sleep", params={"level": 1}).status_code == 200
    assert server.metric("vllm:engine_sleep_state", NAME, 'sleep_state="awake"') == 0
    pid = engine_pid(server)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if engine_pid(server) != pid and not http.get("/is_sleeping").json()["is_sleeping"]:
                break
        except Exception:  # the model's engine is between processes
            pass
        time.sleep(0.2)
    assert http.get("/is_sleeping").json() == {"is_sleeping": False}
    assert server.metric("vllm:engine_sleep_state", NAME, 'sleep_state="awake"') == 1


def test_without_the_switch_the_routes_do_not_exist(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    proc = KilnProcess(repo, env={"VLLM_SERVER_DEV_MODE": "0"}).start(timeout=120)
    try:
        base = f"http://{proc.http_url}"
        for path in ("/sleep", "/wake_up", "/pause", "/resume", "/reset_prefix_cache",
                     "/abort_requests", "/release_kv_cache_memory", "/update_weight_version",
                     "/update_weights", "/finish_weight_update"):  # fmt: skip
            assert httpx.post(base + path).status_code == 404, path
        for path in ("/is_sleeping", "/is_paused", "/server_info", "/get_world_size",
                     "/weight_info"):  # fmt: skip
            assert httpx.get(base + path).status_code == 404, path
        assert "Development endpoints" not in proc.log()
    finally:
        proc.stop()


def test_the_engine_on_a_thread_sleeps_and_wakes_too(gguf_file: Path, tmp_path: Path) -> None:
    """``--no-enable-multiprocessing``: the same operations on the server's engine thread."""
    args = ["--model", str(gguf_file), "--max-model-len", "1024", "--max-num-seqs", "4",
            "--no-enable-multiprocessing"]  # fmt: skip
    proc = KilnProcess(tmp_path / "repo", args=args, with_repository=False,
                       env={"VLLM_SERVER_DEV_MODE": "1"}).start(timeout=600)  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"http://{proc.http_url}/v1", api_key="unused",
                               max_retries=0, timeout=300)  # fmt: skip
        before = greedy(client).choices[0].message.content
        with httpx.Client(base_url=f"http://{proc.http_url}", timeout=120) as http:
            assert http.post("/sleep", params={"level": 2}).json()["status"] == "sleeping"
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                held = pool.submit(greedy, client)
                assert http.get("/is_sleeping").json() == {"is_sleeping": True}
                assert not held.done()
                assert http.post("/wake_up").json() == {"status": "awake", "tags": None}
                assert held.result().choices[0].message.content == before
    finally:
        proc.stop()


def _generate(http: Any, max_tokens: int, stream: bool = False) -> Any:
    body = {"token_ids": [1, 2, 3], "stream": stream,
            "sampling_params": {"max_tokens": max_tokens, "ignore_eos": True,
                                "temperature": 0.0}}  # fmt: skip
    if not stream:
        reply = http.post("/inference/v1/generate", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()
    return http.stream("POST", "/inference/v1/generate", json=body)


def test_weight_versions_label_the_tokens_each_version_sampled(
    server: KilnProcess, http: Any
) -> None:
    """vLLM's RL weight versions: ``/update_weight_version`` labels the weights from the
    next step on; a generation that runs across the change reports both spans."""
    reply = http.post("/update_weight_version", json={"new_version": "policy-1"})
    assert reply.status_code == 200
    assert reply.json() == {"success": True, "new_version": "policy-1"}
    assert http.get("/weight_info").json() == {"weight_version": "policy-1"}
    whole = _generate(http, 6)["choices"][0]
    assert whole["weight_versions"] == [{"version": "policy-1", "start": 0, "end": 6}]
    with (
        httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as other,
        _generate(http, 160, stream=True) as reply,
    ):
        assert reply.status_code == 200
        lines = reply.iter_lines()
        first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
        assert first["choices"][0]["weight_versions"] is None  # the last chunk has them
        # freeze the generation mid-way (its tokens and KV cache kept), relabel, go on
        assert other.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        relabel = other.post("/update_weight_version", json={"new_version": "policy-2"})
        assert relabel.status_code == 200
        assert other.post("/resume").json() == {"status": "resumed"}
        events = [json.loads(line[6:]) for line in lines
                  if line.startswith("data: ") and line != "data: [DONE]"]  # fmt: skip
    chunks = [first, *events]
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 160
    assert all(c["choices"][0]["weight_versions"] is None for c in chunks[:-1])
    spans = chunks[-1]["choices"][0]["weight_versions"]
    assert [s["version"] for s in spans] == ["policy-1", "policy-2"]
    boundary = spans[0]["end"]
    assert spans[0]["start"] == 0 and spans[1] == {"version": "policy-2", "start": boundary,
                                                   "end": 160}  # fmt: skip
    assert len(first["choices"][0]["token_ids"]) <= boundary < 160
    assert http.get("/weight_info").json() == {"weight_version": "policy-2"}


def test_weight_transfer_is_refused_saying_why(http: Any) -> None:
    before = http.get("/weight_info").json()
    for path in ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
                 "/finish_weight_update", "/weight_checker"):  # fmt: skip
        reply = http.post(path, json={})
        assert reply.status_code == 501, path
        assert "no weight transfer engine" in reply.json()["error"]["message"]
    assert http.get("/weight_info").json() == before
