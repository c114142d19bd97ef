"""The ``redis`` response cache over TLS (Triton's ``tls_enabled``, ``cacert``, ``cert``,
``key``, ``sni``), against a real ``redis-server`` listening only on a TLS port and asking
clients for a certificate: two ``kiln serve`` processes share entries through it; a server
without its client certificate, or one that does not trust Redis's, stops at start
naming the reason; credentials may come from Triton's environment variables."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.conftest import KilnProcess
from tests.integration.test_redis_cache import REDIS_SERVER, RedisProcess, _repo, _serve_once
from tests.integration.test_response_cache import (
    check_simple,
    delta,
    infer_grpc,
    infer_http,
    simple_inputs,
    stats,
)
from tests.integration.test_security_tls import Pki, make_pki

pytestmark = pytest.mark.skipif(
    REDIS_SERVER is None, reason="redis-server is not installed (scripts/system-deps.sh)"
)

PASSWORD = "tls-secret"


class TlsRedis(RedisProcess):
    """``redis-server`` with TLS only (``--port 0``), client certificates required, and a
    password."""

    def __init__(self, workdir: Path, pki: Pki) -> None:
        super().__init__(workdir, PASSWORD)
        self.pki = pki

    def listen(self) -> list[str]:
        return ["--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.pki.server_cert),
                "--tls-key-file", str(self.pki.server_key),
                "--tls-ca-cert-file", str(self.pki.ca), "--tls-auth-clients", "yes"]  # fmt: skip

    def client(self) -> redis.Redis:
        """An independent client (redis-py) to look inside."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=PASSWORD, ssl=True,
            ssl_ca_certs=str(self.pki.ca), ssl_certfile=str(self.pki.client_cert),
            ssl_keyfile=str(self.pki.client_key),
        )  # fmt: skip

    def flags(self, *, password: bool = True, client_cert: bool = True, **extra: str) -> list[str]:
        settings = {"host": "127.0.0.1", "port": str(self.port), "socket_timeout": "2000",
                    "tls_enabled": "true", "cacert": str(self.pki.ca)}  # fmt: skip
        if password:
            settings["password"] = PASSWORD
        if client_cert:
            settings["cert"] = str(self.pki.client_cert)
            settings["key"] = str(self.pki.client_key)
        settings.update(extra)
        return [arg for k, v in settings.items() for arg in ("--cache-config", f"redis,{k}={v}")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("redis-pki"))


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[TlsRedis]:
    proc = TlsRedis(tmp_path_factory.mktemp("redis-tls"), pki).start()
    yield proc
    proc.stop()


def test_two_servers_share_entries_over_tls(
    example_repo: Path, tls_redis: TlsRedis, tmp_path_factory: pytest.TempPathFactory
) -> None:
    servers = [
        KilnProcess(_repo(example_repo, tmp_path_factory.mktemp(f"t{i}")), tls_redis.flags())
        for i in range(2)
    ]
    for server in servers:
        server.start()
    try:
        first, second = servers
        a, b = simple_inputs(303)
        before = stats(second, "simple")
        check_simple(infer_http(first, a, b, binary=True), a, b)
        check_simple(infer_grpc(second, a, b), a, b)
        assert delta(before, stats(second, "simple"))["hit"] == 1
        keys = tls_redis.client().keys("kiln:rc:*")
        assert keys  # the entry is in the TLS-only Redis, seen by another client
    finally:
        for server in servers:
            server.stop()


def test_the_password_may_come_from_triton_s_environment_variable(
    example_repo: Path, tls_redis: TlsRedis, tmp_path: Path
) -> None:
    server = KilnProcess(_repo(example_repo, tmp_path), tls_redis.flags(password=False))
    os.environ["TRITONCACHE_REDIS_PASSWORD"] = PASSWORD
    try:
        server.start()  # without the password the start would fail (NOAUTH)
    finally:
        del os.environ["TRITONCACHE_REDIS_PASSWORD"]
    try:
        a, b = simple_inputs(404)
        check_simple(infer_http(server, a, b, binary=True), a, b)
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("case", "says"),
    [
        # Redis asks for a client certificate and gets none
        ("no client certificate", "certificate required"),
        # a CA that did not sign Redis's certificate
        ("untrusted server", "CERTIFICATE_VERIFY_FAILED"),
        # a name Redis's certificate does not carry
        ("wrong name", "CERTIFICATE_VERIFY_FAILED"),
        # a client certificate with another certificate's key
        ("mismatched key", "redis cache TLS settings: [X509: KEY_VALUES_MISMATCH]"),
    ],
)
def test_a_tls_failure_stops_the_start_naming_it(
    example_repo: Path, tls_redis: TlsRedis, tmp_path: Path, case: str, says: str
) -> None:
    if case == "no client certificate":
        flags = tls_redis.flags(client_cert=False)
    elif case == "untrusted server":
        (tmp_path / "other").mkdir()
        flags = tls_redis.flags(cacert=str(make_pki(tmp_path / "other").ca))
    elif case == "wrong name":
        flags = tls_redis.flags(sni="redis.example.com")
    else:
        flags = tls_redis.flags(key=str(tls_redis.pki.server_key))
    run = _serve_once(_repo(example_repo, tmp_path), flags)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "--cache-config:" in run.stderr and says in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        (["tls_enabled=yes"], "tls_enabled must be true or false, got 'yes'"),
        (["cacert=/ca.pem"], "cacert need tls_enabled=true"),
        (["tls_enabled=true", "cacert=/no/such/ca.pem"], "cacert: no file '/no/such/ca.pem'"),
        (["tls_enabled=true", "key=/etc/hostname"], "key needs cert"),
    ],
)
def test_bad_tls_settings_are_refused_naming_them(
    example_repo: Path, tmp_path: Path, settings: list[str], says: str
) -> None:
    flags = ["--cache-config", "redis,host=127.0.0.1", "--cache-config", "redis,port=6379"]
    for setting in settings:
        flags += ["--cache-config", f"redis,{setting}"]
    run = _serve_once(_repo(example_repo, tmp_path), flags)
    assert run.returncode != 0
    assert says in run.stderr, run.stderr[-2000:]
