"""vLLM's HTTP-server flags on ``kiln serve``: CORS (--allowed-origins, --allowed-methods,
--allowed-headers, --allow-credentials), --enable-request-id-headers, --ssl-ciphers,
--ssl-cert-reqs, the h11 header limits, --shutdown-timeout and --uds reach the server's
options with vLLM's meaning, and bad values are refused naming the flag."""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path
from typing import Any

import click
import pytest

from kiln.cli.serve import serve
from kiln.cli.vllm_command import VLLM_SERVE_FLAGS

FLAGS = ["--allowed-origins", "--allowed-methods", "--allowed-headers", "--allow-credentials",
         "--enable-request-id-headers", "--ssl-ciphers", "--ssl-cert-reqs",
         "--h11-max-header-count", "--h11-max-incomplete-event-size", "--shutdown-timeout",
         "--uds"]  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> Path:
    path = tmp_path / "m.gguf"
    path.write_bytes(b"")
    return path


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("tls")
    crt, key = folder / "server.crt", folder / "server.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
         "-out", str(crt), "-days", "1", "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )  # fmt: skip
    return crt, key


def _launched(monkeypatch: pytest.MonkeyPatch, args: list[str]) -> tuple[Any, Any]:
    """(ServerOptions, Endpoints) that ``kiln serve args`` would launch."""
    seen: list[tuple[Any, Any]] = []

    def fake_launch(options: Any, endpoints: Any) -> int:
        seen.append((options, endpoints))
        return 0

    monkeypatch.setattr("kiln.launch.launch", fake_launch)
    with pytest.raises(SystemExit) as done:
        serve.main(args, standalone_mode=False)
    assert done.value.code == 0
    return seen[0]


def _refused(args: list[str]) -> str:
    with pytest.raises(click.ClickException) as caught:
        serve.main(args, standalone_mode=False)
    return caught.value.format_message()


def test_each_flag_is_an_option_of_kiln_serve_not_a_refusal() -> None:
    known = {o for p in serve.params for o in (*p.opts, *getattr(p, "secondary_opts", ()))}
    for flag in FLAGS:
        assert flag in known, flag
    assert "--no-allow-credentials" in known
    assert set(FLAGS) <= VLLM_SERVE_FLAGS  # vLLM's own spellings


def test_cors_flags_read_vllms_json_lists(monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    _, endpoints = _launched(monkeypatch, [str(model)])
    sec = endpoints.security
    assert sec.cors_origins == () and sec.cors_methods is None and sec.cors_headers is None
    assert sec.cors_credentials is False and sec.request_id_headers is False
    args = [str(model), "--http-cors-allow-origin", "https://a.example",
            "--allowed-origins", '["https://b.example", "https://a.example"]',
            "--allowed-methods", '["GET", "POST", "PUT"]', "--allowed-headers", '["*"]',
            "--allow-credentials", "--enable-request-id-headers"]  # fmt: skip
    sec = _launched(monkeypatch, args)[1].security
    assert sec.cors_origins == ("https://a.example", "https://b.example")
    assert sec.cors_methods == ("GET", "POST", "PUT") and sec.cors_headers == ("*",)
    assert sec.cors_credentials is True and sec.request_id_headers is True
    sec = _launched(monkeypatch, [*args, "--no-allow-credentials"])[1].security
    assert sec.cors_credentials is False


@pytest.mark.parametrize(
    ("flag", "value", "why"),
    [
        ("--allowed-origins", "https://a.example", "not JSON"),
        ("--allowed-origins", '"https://a.example"', "must be a JSON list of strings"),
        ("--allowed-origins", '{"a": 1}', "must be a JSON list of strings"),
        ("--allowed-origins", '["a.example"]', "'a.example' is not valid"),
        ("--allowed-methods", "[1]", "must be a JSON list of strings"),
        ("--allowed-methods", '["GET POST"]', "'GET POST' is not valid"),
        ("--allowed-headers", '["x-a\\r\\nx-b: 1"]', "is not valid"),
        ("--allowed-headers", "[", "not JSON"),
        ("--http-cors-allow-origin", "evil\nx", "is not an origin"),
    ],
)
def test_bad_cors_values_are_refused_naming_the_flag(
    model: Path, flag: str, value: str, why: str
) -> None:
    message = _refused([str(model), flag, value])
    assert flag in message and why in message


def test_ssl_cert_reqs_is_vllms_spelling_of_ssl_client_auth(
    monkeypatch: pytest.MonkeyPatch, model: Path, cert: tuple[Path, Path]
) -> None:
    crt, key = cert
    tls = [str(model), "--ssl-certfile", str(crt), "--ssl-keyfile", str(key),
           "--ssl-ca-certs", str(crt)]  # fmt: skip
    assert _launched(monkeypatch, tls)[1].security.http_tls.cert_reqs == ssl.CERT_NONE
    for value, reqs in (("0", ssl.CERT_NONE), ("1", ssl.CERT_OPTIONAL), ("2", ssl.CERT_REQUIRED)):
        http_tls = _launched(monkeypatch, [*tls, "--ssl-cert-reqs", value])[1].security.http_tls
        assert http_tls.cert_reqs == reqs
    # agreeing with kiln's flag is fine; contradicting it is refused
    args = [*tls, "--ssl-cert-reqs", "2", "--ssl-client-auth", "required"]
    assert _launched(monkeypatch, args)[1].security.http_tls.client_auth == "required"
    message = _refused([*tls, "--ssl-cert-reqs", "1", "--ssl-client-auth", "required"])
    assert "--ssl-cert-reqs" in message and "contradicts --ssl-client-auth required" in message
    assert "not in the range 0<=x<=2" in _refused([*tls, "--ssl-cert-reqs", "3"])
    # asking for client certificates without TLS is an error; 0 asks for nothing
    assert "--ssl-cert-reqs needs --ssl-certfile" in _refused([str(model), "--ssl-cert-reqs", "2"])
    assert _launched(monkeypatch, [str(model), "--ssl-cert-reqs", "0"])[1].security.http_tls is None


def test_ssl_ciphers_are_checked_and_reach_tls(
    monkeypatch: pytest.MonkeyPatch, model: Path, cert: tuple[Path, Path]
) -> None:
    crt, key = cert
    tls = [str(model), "--ssl-certfile", str(crt), "--ssl-keyfile", str(key)]
    assert _launched(monkeypatch, tls)[1].security.http_tls.ciphers is None
    ciphers = "ECDHE+AESGCM:ECDHE+CHACHA20"
    http_tls = _launched(monkeypatch, [*tls, "--ssl-ciphers", ciphers])[1].security.http_tls
    assert http_tls.ciphers == ciphers
    from kiln.launch import _uvicorn

    config = _uvicorn(object(), "127.0.0.1", 0, 1.0, _launched(
        monkeypatch, [*tls, "--ssl-ciphers", ciphers])[1].security).config  # fmt: skip
    assert config.ssl_ciphers == ciphers
    assert "selects no cipher" in _refused([*tls, "--ssl-ciphers", "NO-SUCH-CIPHER"])
    assert "not an OpenSSL cipher list" in _refused([*tls, "--ssl-ciphers", " "])
    assert "--ssl-ciphers needs --ssl-certfile" in _refused([str(model), "--ssl-ciphers", ciphers])


def test_h11_limits_are_kilns_header_limits(monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    args = [str(model), "--h11-max-header-count", "32", "--h11-max-incomplete-event-size", "8192"]
    sec = _launched(monkeypatch, args)[1].security
    assert (sec.http_max_headers, sec.http_max_header_size) == (32, 8192)
    assert "--h11-max-header-count" in _refused([str(model), "--h11-max-header-count", "0"])


def test_shutdown_timeout_is_the_exit_timeout(monkeypatch: pytest.MonkeyPatch, model: Path) -> None:
    from kiln.launch import _uvicorn

    assert _launched(monkeypatch, [str(model)])[0].exit_timeout_secs == 30.0
    for value in ("0", "7"):
        options = _launched(monkeypatch, [str(model), "--shutdown-timeout", value])[0]
        assert options.exit_timeout_secs == float(value)
        # 0: uvicorn cancels in-flight requests at once (it waited a second before)
        config = _uvicorn(object(), "127.0.0.1", 0, options.exit_timeout_secs).config
        assert config.timeout_graceful_shutdown == int(value)
    assert "--shutdown-timeout" in _refused([str(model), "--shutdown-timeout", "-1"])


def test_uds_path_is_checked(monkeypatch: pytest.MonkeyPatch, model: Path, tmp_path: Path) -> None:
    endpoints = _launched(monkeypatch, [str(model)])[1]
    assert endpoints.uds is None and endpoints.http_address == "127.0.0.1:8000"
    path = str(tmp_path / "kiln.sock")
    endpoints = _launched(monkeypatch, [str(model), "--uds", path])[1]
    assert endpoints.uds == path and endpoints.http_address == f"unix:{path}"
    assert "at most 107" in _refused([str(model), "--uds", "/tmp/" + "s" * 120])
    assert "is not a folder" in _refused([str(model), "--uds", str(tmp_path / "no" / "k.sock")])
    assert "is a folder" in _refused([str(model), "--uds", str(tmp_path)])
    assert "needs a file path" in _refused([str(model), "--uds", ""])


def test_bind_unix_socket_replaces_only_a_stale_socket(tmp_path: Path) -> None:
    import socket

    from kiln.launch import bind_unix_socket

    path = str(tmp_path / "k.sock")
    live = bind_unix_socket(path)
    live.listen()
    with pytest.raises(OSError, match="another server listens"):
        bind_unix_socket(path)
    live.close()  # the file stays: a stale socket, replaced
    again = bind_unix_socket(path)
    again.listen()
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
    again.close()
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix_socket(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "x"
