"""An HTTP/2 client that shares no code with grpcio: curl (nghttp2), over h2c with prior
knowledge and over TLS with ALPN, against kiln's gRPC port."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.examples import build_example_repository
from kiln.frontends.grpc import grpc_service_pb2 as pb
from tests.conftest import KilnProcess
from tests.h2_client import message
from tests.integration.test_security_tls import Pki, make_pki


def _curl_has_http2() -> bool:
    if shutil.which("curl") is None:
        return False
    out = subprocess.run(["curl", "--version"], capture_output=True, text=True).stdout
    return "HTTP2" in out


pytestmark = pytest.mark.skipif(not _curl_has_http2(), reason="needs curl built with HTTP/2")

LIVE = "/inference.GRPCInferenceService/ServerLive"


def curl(url: str, body: bytes, tmp: Path, *extra: str) -> tuple[str, bytes]:
    """(curl's verbose log, the response body) of a gRPC POST."""
    request, response = tmp / "request.bin", tmp / "response.bin"
    request.write_bytes(body)
    done = subprocess.run(
        ["curl", "-sv", "-X", "POST", "-H", "content-type: application/grpc",
         "-H", "te: trailers", "--data-binary", f"@{request}", "-o", str(response),
         "--max-time", "30", *extra, url],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return done.stderr, response.read_bytes()


def test_h2c_prior_knowledge(kiln_server: KilnProcess, tmp_path: Path) -> None:
    url = f"http://{kiln_server.grpc_url}{LIVE}"
    log, body = curl(url, message(b""), tmp_path, "--http2-prior-knowledge")
    assert "< HTTP/2 200" in log and "< grpc-status: 0" in log
    assert body[:5] == b"\0\0\0\0\2"
    assert pb.ServerLiveResponse.FromString(body[5:]).live
    # An error status in the trailers, answered after the request's end. (An unknown method
    # is refused as soon as its HEADERS arrive, followed by RST_STREAM(NO_ERROR) while curl
    # may still be sending: RFC 9113 §8.1 and grpc's own servers do this, but curl 7.88
    # then drops the response half of the time. The raw-frame tests cover that path.)
    missing = pb.ModelMetadataRequest(name="no_such_model").SerializeToString()
    log, _ = curl(f"http://{kiln_server.grpc_url}/inference.GRPCInferenceService/ModelMetadata",
                  message(missing), tmp_path, "--http2-prior-knowledge")  # fmt: skip
    assert "< grpc-status: 5" in log and "no_such_model" in log


@pytest.fixture(scope="module")
def tls_grpc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KilnProcess, Pki]]:
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    repo = tmp_path_factory.mktemp("interop") / "models"
    build_example_repository(repo, ["simple"])
    args = [
        "--no-history", "--grpc-use-ssl", "--grpc-server-cert", str(pki.server_cert),
        "--grpc-server-key", str(pki.server_key),
    ]  # fmt: skip
    server = KilnProcess(repo, args).start()  # HTTP stays plain: only gRPC is under test
    yield server, pki
    assert server.stop() == 0


def test_tls_with_alpn_h2(tls_grpc: tuple[KilnProcess, Pki], tmp_path: Path) -> None:
    server, pki = tls_grpc
    url = f"https://localhost:{server.grpc_port}{LIVE}"
    log, body = curl(url, message(b""), tmp_path, "--http2", "--cacert", str(pki.ca),
                     "--resolve", f"localhost:{server.grpc_port}:127.0.0.1")  # fmt: skip
    assert "ALPN: server accepted h2" in log or "ALPN, server accepted to use h2" in log
    assert "< grpc-status: 0" in log
    assert pb.ServerLiveResponse.FromString(body[5:]).live
