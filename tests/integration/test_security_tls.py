"""TLS and mutual TLS on HTTP and gRPC, with a test CA generated at test time."""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from tritonclient.utils import InferenceServerException

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess


@dataclass
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key_and_name(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Name]:
    return ec.generate_private_key(ec.SECP256R1()), x509.Name(
        [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    )


def _write(folder: Path, name: str, cert: x509.Certificate, key: object | None) -> Path:
    path = folder / f"{name}.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        (folder / f"{name}.key").write_bytes(
            key.private_bytes(  # type: ignore[attr-defined]
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
    return path


def make_pki(folder: Path) -> Pki:
    now = datetime.datetime.now(datetime.UTC)
    ca_key, ca_name = _key_and_name("kiln test CA")
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False),
                       critical=True)
        .sign(ca_key, hashes.SHA256())
    )  # fmt: skip

    def leaf(cn: str, usage: x509.ObjectIdentifier) -> tuple[x509.Certificate, object]:
        key, name = _key_and_name(cn)
        builder = (
            x509.CertificateBuilder().subject_name(name).issuer_name(ca_name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))
            ]), critical=False)
        )  # fmt: skip
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf("localhost", ExtendedKeyUsageOID.SERVER_AUTH)
    client, client_key = leaf("kiln test client", ExtendedKeyUsageOID.CLIENT_AUTH)
    return Pki(
        _write(folder, "ca", ca, None),
        _write(folder, "server", server, server_key),
        folder / "server.key",
        _write(folder, "client", client, client_key),
        folder / "client.key",
    )


def wait_https(server: KilnProcess, pki: Pki, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    url = f"https://{server.http_url}/v2/health/ready"
    while time.monotonic() < deadline:
        assert server.proc is not None
        if server.proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited:\n{server.log()}")
        try:
            r = requests.get(url, verify=str(pki.ca), cert=(str(pki.client_cert),
                             str(pki.client_key)), timeout=1)  # fmt: skip
            if r.status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise TimeoutError(server.log())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _start(tmp: Path, pki: Pki, mutual: bool) -> KilnProcess:
    repo = tmp / "models"
    build_example_repository(repo, ["simple"])
    args = [
        "--no-history",
        "--ssl-certfile", str(pki.server_cert), "--ssl-keyfile", str(pki.server_key),
        "--grpc-use-ssl", "--grpc-server-cert", str(pki.server_cert),
        "--grpc-server-key", str(pki.server_key),
    ]  # fmt: skip
    if mutual:
        args += ["--ssl-ca-certs", str(pki.ca), "--ssl-client-auth", "required",
                 "--grpc-root-cert", str(pki.ca), "--grpc-use-ssl-mutual"]  # fmt: skip
    server = KilnProcess(repo, args).start(wait_ready=False)
    wait_https(server, pki)
    return server


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[KilnProcess]:
    server = _start(tmp_path_factory.mktemp("tls"), pki, mutual=False)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[KilnProcess]:
    server = _start(tmp_path_factory.mktemp("mtls"), pki, mutual=True)
    yield server
    server.stop()


def _grpc_infer(client: grpcclient.InferenceServerClient) -> np.ndarray:
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        t = grpcclient.InferInput(name, [1, 16], "INT32")
        t.set_data_from_numpy(data)
        inputs.append(t)
    out = client.infer("simple", inputs).as_numpy("OUTPUT0")
    assert out is not None
    np.testing.assert_array_equal(out, data + data)
    return out


def test_https_round_trip(tls_server: KilnProcess, pki: Pki) -> None:
    r = requests.get(f"https://{tls_server.http_url}/v2", verify=str(pki.ca), timeout=10)
    assert r.status_code == 200 and r.json()["name"] == "kiln"
    with pytest.raises(requests.exceptions.SSLError):  # not trusted without the CA
        requests.get(f"https://{tls_server.http_url}/v2", timeout=10)
    with pytest.raises(requests.ConnectionError):  # plain HTTP is not served
        requests.get(f"http://{tls_server.http_url}/v2", timeout=10)


def test_grpc_tls_round_trip(tls_server: KilnProcess, pki: Pki) -> None:
    client = grpcclient.InferenceServerClient(
        tls_server.grpc_url, ssl=True, root_certificates=str(pki.ca)
    )
    assert client.is_server_live()
    _grpc_infer(client)
    plain = grpcclient.InferenceServerClient(tls_server.grpc_url)
    with pytest.raises(InferenceServerException):
        plain.is_server_live()


def test_https_mutual_tls(mtls_server: KilnProcess, pki: Pki) -> None:
    url = f"https://{mtls_server.http_url}/v2"
    cert = (str(pki.client_cert), str(pki.client_key))
    assert requests.get(url, verify=str(pki.ca), cert=cert, timeout=10).status_code == 200
    with pytest.raises((requests.exceptions.SSLError, requests.ConnectionError)):
        requests.get(url, verify=str(pki.ca), timeout=10)


def test_grpc_mutual_tls(mtls_server: KilnProcess, pki: Pki) -> None:
    client = grpcclient.InferenceServerClient(
        mtls_server.grpc_url,
        ssl=True,
        root_certificates=str(pki.ca),
        private_key=str(pki.client_key),
        certificate_chain=str(pki.client_cert),
    )
    _grpc_infer(client)
    anonymous = grpcclient.InferenceServerClient(
        mtls_server.grpc_url, ssl=True, root_certificates=str(pki.ca)
    )
    with pytest.raises(InferenceServerException):
        anonymous.is_server_live()
