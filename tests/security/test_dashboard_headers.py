"""The dashboard page (issue #25, lows): it cannot be framed by another site
(``frame-ancestors 'none'``) nor sniffed into another type (``nosniff``), and the API key
never travels in its URL, where browser history, server logs and Referer headers keep it:
the page's form sends it once in a header to ``POST /dashboard/session``, which sets an
HttpOnly, SameSite=Strict cookie for ``/api/*``. Against a real ``kiln serve``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess

KEY = "dashboard-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    root = tmp_path_factory.mktemp("dashboard-headers") / "model_repository"
    build_example_repository(root, ["simple"])
    proc = KilnProcess(
        root,
        args=[
            "--api-key", KEY, "--model-control-mode", "explicit", "--load-model", "simple",
            "--no-allow-grpc", "--no-history",
        ],
    ).start()  # fmt: skip
    yield proc
    proc.stop()


@pytest.mark.parametrize(
    "path", ["/dashboard", "/dashboard/", "/dashboard/index.html", "/dashboard/dashboard.js",
             "/dashboard/dashboard.css", "/dashboard/vendor/uPlot.iife.min.js"]
)  # fmt: skip
def test_dashboard_responses_forbid_framing_and_sniffing(server: KilnProcess, path: str) -> None:
    r = requests.get(f"http://{server.http_url}{path}", allow_redirects=False, timeout=10)
    assert r.status_code in (200, 307)
    assert r.headers["x-content-type-options"] == "nosniff"
    directives = [d.strip() for d in r.headers["content-security-policy"].split(";")]
    assert "frame-ancestors 'none'" in directives


def test_api_key_is_not_taken_from_the_url(server: KilnProcess) -> None:
    base = f"http://{server.http_url}"
    with requests.Session() as s:
        r = s.get(f"{base}/dashboard/?api_key={KEY}", timeout=10)
        assert r.status_code == 200  # the page itself, which holds no data
        assert "set-cookie" not in r.headers
        assert s.get(f"{base}/api/live", timeout=10).status_code == 401
    page = requests.get(f"{base}/dashboard/dashboard.js", timeout=10).text
    assert "api_key" not in page and "/dashboard/session" in page


def test_key_in_a_header_opens_monitoring_reads_only(server: KilnProcess) -> None:
    base = f"http://{server.http_url}"
    session = f"{base}/dashboard/session"
    assert requests.post(session, timeout=10).status_code == 401
    wrong = requests.post(session, headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    with requests.Session() as s:
        r = s.post(session, headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        assert r.status_code == 204
        cookie = r.headers["set-cookie"]
        for attribute in ("Path=/api", "HttpOnly", "SameSite=Strict"):
            assert attribute in cookie
        assert s.get(f"{base}/api/live", timeout=10).status_code == 200
        # the cookie never authorises inference, model control or metadata
        assert s.get(f"{base}/v2", timeout=10).status_code == 401
        assert s.post(f"{base}/v2/repository/index", timeout=10).status_code == 401
    # another site cannot log the operator's browser in (nor probe keys) through it
    evil = {"Authorization": f"Bearer {KEY}", "Origin": "http://evil.example"}
    assert requests.post(session, headers=evil, timeout=10).status_code == 403


def test_no_key_warning_when_a_key_is_set(server: KilnProcess) -> None:
    assert "no API key is set" not in server.log()
