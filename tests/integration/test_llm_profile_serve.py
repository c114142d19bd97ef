"""vLLM's ``/start_profile`` and ``/stop_profile`` on ``kiln serve --profiler-config``, with
the engine in its own process and on a thread: the trace holds the steps of the requests
run between the two calls, a second start is 409, bad overrides are 400 naming the field,
an oversized body 413, and a server without a profiler answers 404. Requests go through
the real ``openai`` client and ``httpx``."""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.llm_models import build_tiny_llm  # noqa: E402

ARGS = ["--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "4",
        "--kv-cache-memory", "1M", "--block-size", "4"]  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llm(tmp_path_factory.mktemp("ckpt") / "tiny")


def serve(folder: Path, home: Path, *extra: str) -> KilnProcess:
    args = ["--model", str(folder), *ARGS, *extra]
    return KilnProcess(home / "repo", args=args, with_repository=False).start(timeout=180)


def generate(server: KilnProcess, tokens: int) -> None:
    api = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="x", max_retries=0)
    answer = api.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=tokens,
                                    temperature=0.0, extra_body={"ignore_eos": True})  # fmt: skip
    assert answer.usage is not None and answer.usage.completion_tokens == tokens


def steps_in(trace: Path) -> int:
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    return sum(1 for e in events if e.get("name") == "kiln::step" and e.get("ph") == "X")


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_a_session_traces_the_steps_between_start_and_stop(
    folder: Path, tmp_path: Path, mode: str
) -> None:
    traces = tmp_path / "traces"
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(traces),
                         "torch_profiler_with_stack": False})  # fmt: skip
    extra = ["--no-enable-multiprocessing"] if mode == "thread" else []
    server = serve(folder, tmp_path, "--profiler-config", config, *extra)
    try:
        base = f"http://{server.http_url}"
        generate(server, 3)  # before the session: not in its trace
        # vLLM ignores a stop without a session
        assert httpx.post(f"{base}/stop_profile").status_code == 200
        start = httpx.post(f"{base}/start_profile", json={"profile_prefix": "run1"})
        assert start.status_code == 200, start.text
        again = httpx.post(f"{base}/start_profile")
        assert again.status_code == 409
        assert "already active" in again.json()["error"]["message"]
        generate(server, 4)  # a prefill step and three decode steps
        assert httpx.post(f"{base}/stop_profile", timeout=60).status_code == 200
        [trace] = traces.glob("run1_tiny_tp0.*.pt.trace.json.gz")
        assert steps_in(trace) == 4
        assert "kiln::step" in (traces / "run1_tiny_tp0.profiler_out.txt").read_text()
        # max_iterations ends the session by itself; the trace is complete before /stop
        start = httpx.post(f"{base}/start_profile", content=b'{"profile_prefix": "two", '
                           b'"max_iterations": 2}')  # fmt: skip
        assert start.status_code == 200, start.text
        generate(server, 6)
        [trace] = traces.glob("two_tiny_tp0.*.pt.trace.json.gz")
        assert steps_in(trace) == 2
        assert httpx.post(f"{base}/stop_profile").status_code == 200
        # no body at all: the configured defaults, the model's name alone
        assert httpx.post(f"{base}/start_profile").status_code == 200
        generate(server, 1)
        assert httpx.post(f"{base}/stop_profile").status_code == 200
        assert len(list(traces.glob("tiny_tp0.*.pt.trace.json.gz"))) == 1
    finally:
        server.stop()


@pytest.fixture(scope="module")
def profiled(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    """One server for the bad-body cases (each case leaves it with no session)."""
    home = tmp_path_factory.mktemp("profiled")
    config = json.dumps({"profiler": "torch", "torch_profiler_dir": str(home / "t")})
    server = serve(folder, home, "--profiler-config", config)
    yield server
    server.stop()


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        (b'{"profile_prefix": "../../etc/x"}', 400, "profile_prefix", "ASCII characters"),
        (b'{"profile_prefix": "a b"}', 400, "profile_prefix", "contain only letters"),
        (b'{"delay_iterations": -1}', 400, "delay_iterations", "between 0 and 4294967295"),
        (b'{"max_iterations": 8589934592}', 400, "max_iterations", "between 0"),
        (b'{"max_iterations": 99999999999999999999}', 400, "max_iterations", "an integer"),
        (b'{"max_iterations": "3"}', 400, "max_iterations", "must be an integer"),
        (b"[1, 2]", 400, None, "must be a JSON object"),
        (b"{", 400, None, "not valid JSON"),
        (b'{"profile_prefix": "' + b"a" * 5000 + b'"}', 413, None, "more than 4096"),
    ],
)
def test_bad_start_bodies_are_refused_before_anything_starts(
    profiled: KilnProcess, body: bytes, status: int, param: str | None, message: str
) -> None:
    base = f"http://{profiled.http_url}"
    answer = httpx.post(f"{base}/start_profile", content=body)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert message in error["message"] and error["param"] == param
    # nothing was started: a good start goes through
    assert httpx.post(f"{base}/start_profile").status_code == 200
    assert httpx.post(f"{base}/stop_profile").status_code == 200


def test_a_declared_oversized_body_is_refused_before_it_is_read(profiled: KilnProcess) -> None:
    """A head that announces 100 MB gets its 413 at once: the server never waits for, nor
    buffers, a body the route would refuse."""
    from tests.security.http_wire import connect, post

    sock, reader = connect(profiled.http_port)
    try:
        sock.sendall(post("/start_profile", b"", length=100_000_000))
        status, _, body = reader.response()
    finally:
        sock.close()
    assert status == 413 and b"more than 4096" in body


def test_kiln_bench_profile_traces_the_timed_requests(profiled: KilnProcess) -> None:
    """vLLM's ``bench serve --profile``: the warm-up request is not in the trace."""
    from kiln.bench.openai import run

    traces = profiled.repository.parent / "t"  # the fixture's torch_profiler_dir
    before = set(traces.glob("*.pt.trace.json.gz"))
    result = run(url=profiled.http_url, num_prompts=3, input_len=4, output_len=5,
                 vocab_size=50, ignore_eos=True, max_concurrency=1, profile=True)  # fmt: skip
    assert not [r.error for r in result.results if r.error]
    [trace] = set(traces.glob("*.pt.trace.json.gz")) - before
    # three requests one after another: a prefill and four decode steps each
    assert steps_in(trace) == 15


def test_without_a_profiler_config_the_paths_are_404(folder: Path, tmp_path: Path) -> None:
    from kiln.bench import BenchError
    from kiln.bench.openai import run

    server = serve(folder, tmp_path)
    try:
        for path in ("/start_profile", "/stop_profile"):
            answer = httpx.post(f"http://{server.http_url}{path}")
            assert answer.status_code == 404
            assert "--profiler-config" in answer.json()["error"]["message"]
        with pytest.raises(BenchError, match=r"start_profile.*start the server with --profiler"):
            run(
                url=server.http_url,
                num_prompts=1,
                input_len=4,
                output_len=2,
                vocab_size=50,
                profile=True,
            )
    finally:
        server.stop()
