"""The ``redis`` response cache end to end: a real ``redis-server`` (Debian package, started
here) shared by two ``kiln serve`` processes, driven by tritonclient. One server's answer
is the other's hit; a changed model file misses; a Redis that goes away, or holds records
that are not kiln's, costs misses and never a request; a Redis out of reach at start stops
the server with its address."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import numpy as np
import pytest
import redis
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from tests.conftest import KilnProcess, free_port
from tests.integration.test_response_cache import (
    ENABLE,
    TAGGED_CONFIG,
    TAGGED_MODEL,
    check_simple,
    delta,
    infer_grpc,
    infer_http,
    simple_inputs,
    stats,
)

REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (scripts/system-deps.sh)"
)


class RedisProcess:
    def __init__(self, workdir: Path, password: str = "") -> None:
        self.port = free_port()
        self.workdir = workdir
        self.password = password
        self.proc: subprocess.Popen[bytes] | None = None

    def listen(self) -> list[str]:
        """The ``redis-server`` flags that say where it listens."""
        return ["--port", str(self.port)]

    def start(self) -> Self:
        assert REDIS_SERVER is not None
        self.proc = subprocess.Popen(
            [
                REDIS_SERVER,
                *self.listen(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
                *(["--requirepass", self.password] if self.password else []),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
        )
        client = self.client()
        for _ in range(200):
            try:
                client.ping()
                return self
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password or None)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.proc = None

    def flags(self) -> list[str]:
        return [
            "--cache-config",
            "redis,host=127.0.0.1",
            "--cache-config",
            f"redis,port={self.port}",
            "--cache-config",
            "redis,socket_timeout=2000",
        ]


def _repo(example_repo: Path, dest: Path, tagged_offset: int = 1) -> Path:
    """simple and a Python model (Y = X + offset) opt in to the cache."""
    repo = dest / "repo"
    repo.mkdir(parents=True)
    shutil.copytree(example_repo / "simple", repo / "simple")
    config = repo / "simple" / "config.pbtxt"
    config.write_text(config.read_text() + ENABLE)
    (repo / "py_tagged" / "1").mkdir(parents=True)
    source = TAGGED_MODEL.replace("as_numpy() + 1", f"as_numpy() + {tagged_offset}")
    assert source != TAGGED_MODEL or tagged_offset == 1
    (repo / "py_tagged" / "1" / "model.py").write_text(source)
    (repo / "py_tagged" / "config.pbtxt").write_text(TAGGED_CONFIG + ENABLE)
    return repo


def _serve_once(repo: Path, flags: list[str]) -> subprocess.CompletedProcess[str]:
    """``kiln serve`` that is expected to stop at start: its exit and its words."""
    return subprocess.run(
        [sys.executable, "-m", "kiln", "serve", "--model-repository", str(repo),
         "--http-port", str(free_port()), "--grpc-port", str(free_port()),
         "--metrics-port", str(free_port()), *flags],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    proc = RedisProcess(tmp_path_factory.mktemp("redis")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pair(
    example_repo: Path, redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[KilnProcess, KilnProcess]]:
    """Two servers, each with its own copy of the same models, sharing one Redis."""
    servers = [
        KilnProcess(_repo(example_repo, tmp_path_factory.mktemp(f"r{i}")), redis_server.flags())
        for i in range(2)
    ]
    for server in servers:
        server.start()
    yield servers[0], servers[1]
    for server in servers:
        server.stop()


def _tagged(server: KilnProcess, x: list[float]) -> Any:
    client = httpclient.InferenceServerClient(server.http_url)
    tensor = httpclient.InferInput("X", [2], "FP32")
    tensor.set_data_from_numpy(np.array(x, np.float32))
    return client.infer("py_tagged", [tensor])


def test_one_servers_answer_is_the_other_servers_hit(
    pair: tuple[KilnProcess, KilnProcess],
) -> None:
    first, second = pair
    a, b = simple_inputs(101)
    before = [stats(s, "simple") for s in pair]
    check_simple(infer_http(first, a, b, binary=True), a, b)
    check_simple(infer_grpc(second, a, b), a, b)  # another server, another protocol
    check_simple(infer_http(second, a, b, binary=False), a, b)
    after = [stats(s, "simple") for s in pair]
    assert delta(before[0], after[0]) == {
        "hit": 0, "miss": 1, "success": 1, "executions": 1, "inferences": 1,
    }  # fmt: skip
    assert delta(before[1], after[1]) == {
        "hit": 2, "miss": 0, "success": 2, "executions": 0, "inferences": 0,
    }  # fmt: skip


def test_a_python_models_response_parameters_come_back_from_redis(
    pair: tuple[KilnProcess, KilnProcess],
) -> None:
    first, second = pair
    miss = _tagged(first, [1.5, 2.5])
    hit = _tagged(second, [1.5, 2.5])
    np.testing.assert_array_equal(hit.as_numpy("Y"), [2.5, 3.5])
    assert hit.get_response()["parameters"] == miss.get_response()["parameters"]
    assert stats(second, "py_tagged")["execution_count"] == 0


def test_a_changed_model_file_never_answers_with_the_old_ones_outputs(
    example_repo: Path, redis_server: RedisProcess, tmp_path: Path,
    pair: tuple[KilnProcess, KilnProcess],
) -> None:  # fmt: skip
    first, _ = pair
    np.testing.assert_array_equal(_tagged(first, [7.0, 8.0]).as_numpy("Y"), [8.0, 9.0])
    changed = KilnProcess(_repo(example_repo, tmp_path, tagged_offset=100), redis_server.flags())
    changed.start()
    try:
        np.testing.assert_array_equal(_tagged(changed, [7.0, 8.0]).as_numpy("Y"), [107.0, 108.0])
        assert stats(changed, "py_tagged")["inference_stats"]["cache_hit"]["count"] == 0
    finally:
        changed.stop()


def test_records_that_are_not_kilns_are_misses_answered_by_the_model(
    pair: tuple[KilnProcess, KilnProcess], redis_server: RedisProcess
) -> None:
    first, second = pair
    a, b = simple_inputs(202)
    infer_http(first, a, b, binary=True)
    client = redis_server.client()
    keys = list(client.scan_iter(match=b"kiln:rc:*"))
    assert keys  # kiln's entries are there, under its prefix
    for key in keys:
        client.set(key, b"\x80\x04 not a kiln record")
    before = stats(second, "simple")
    check_simple(infer_grpc(second, a, b), a, b)
    assert delta(before, stats(second, "simple"))["executions"] == 1
    # the model's answer replaced the bad record: the next one is a hit
    before = stats(first, "simple")
    check_simple(infer_grpc(first, a, b), a, b)
    assert delta(before, stats(first, "simple"))["hit"] == 1


def test_a_redis_that_goes_away_costs_misses_not_requests(
    example_repo: Path, tmp_path: Path
) -> None:
    own = RedisProcess(tmp_path).start()
    server = KilnProcess(_repo(example_repo, tmp_path / "models"), own.flags()).start()
    try:
        a, b = simple_inputs(303)
        check_simple(infer_http(server, a, b, binary=True), a, b)
        own.stop()
        before = stats(server, "simple")
        for _ in range(2):
            check_simple(infer_grpc(server, a, b), a, b)  # answered by the model
        got = delta(before, stats(server, "simple"))
        assert (got["hit"], got["success"], got["executions"]) == (0, 2, 2)
        assert f"redis cache at 127.0.0.1:{own.port}: lookup failed" in server.log()
        assert server.proc is not None and server.proc.poll() is None  # still serving
    finally:
        server.stop()
        own.stop()


def test_a_redis_out_of_reach_at_start_stops_the_server_naming_it(
    example_repo: Path, tmp_path: Path
) -> None:
    port = free_port()  # nothing listens there
    flags = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", f"redis,port={port}",
             "--cache-config", "redis,connect_timeout=2000"]  # fmt: skip
    result = _serve_once(_repo(example_repo, tmp_path), flags)
    assert result.returncode == 1
    assert f"cannot reach the redis cache at 127.0.0.1:{port}" in result.stderr


def test_bad_redis_settings_are_refused_naming_the_setting(example_repo: Path) -> None:
    flags = ["--cache-config", "redis,host=localhost", "--cache-config", "redis,port=http"]
    result = _serve_once(example_repo, flags)
    assert result.returncode == 2
    assert "redis cache setting port must be an integer, got 'http'" in result.stderr


def test_grpc_client_sees_the_same_cached_tensors(pair: tuple[KilnProcess, KilnProcess]) -> None:
    first, second = pair
    a, b = simple_inputs(404)
    plain = infer_grpc(first, a, b)
    cached = grpcclient.InferenceServerClient(second.grpc_url)
    items = [grpcclient.InferInput(n, list(a.shape), "INT32") for n in ("INPUT0", "INPUT1")]
    items[0].set_data_from_numpy(a)
    items[1].set_data_from_numpy(b)
    result = cached.infer("simple", items)
    for name in ("OUTPUT0", "OUTPUT1"):
        np.testing.assert_array_equal(result.as_numpy(name), plain.as_numpy(name))


def test_a_password_protected_redis_with_its_acl_user_and_db(
    example_repo: Path, tmp_path: Path
) -> None:
    own = RedisProcess(tmp_path, password="s3cret").start()
    flags = [*own.flags(), "--cache-config", "redis,user=default", "--cache-config",
             "redis,password=s3cret", "--cache-config", "redis,db=3"]  # fmt: skip
    server = KilnProcess(_repo(example_repo, tmp_path / "models"), flags).start()
    try:
        a, b = simple_inputs(505)
        for _ in range(2):
            check_simple(infer_http(server, a, b, binary=True), a, b)
        assert stats(server, "simple")["inference_stats"]["cache_hit"]["count"] == 1
        client = own.client()
        client.select(3)
        assert list(client.scan_iter(match=b"kiln:rc:*"))  # in the db it was told to use
        wrong = [*own.flags(), "--cache-config", "redis,password=wrong"]
        result = _serve_once(example_repo, wrong)
        assert result.returncode == 1
        assert f"cannot reach the redis cache at 127.0.0.1:{own.port}" in result.stderr
        assert "WRONGPASS" in result.stderr  # Redis's own reason
    finally:
        server.stop()
        own.stop()
