"""kiln serves its OpenAPI document, and schemathesis fuzzes every operation in it against a
real ``kiln serve`` for a bounded number of examples: no 5xx, no crash."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from kiln.examples import build_example_repository
from tests.conftest import KilnProcess


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tmp_path_factory.mktemp("fuzz") / "models"
    build_example_repository(repo, ["simple"])
    # explicit mode: load/unload answer (4xx for fuzzed names) instead of 503 "not allowed"
    server = KilnProcess(
        repo, ["--model-control-mode", "explicit", "--load-model", "simple", "--no-history"]
    ).start()
    yield server
    server.stop()


def test_openapi_document_lists_the_kserve_routes(fuzzed: KilnProcess) -> None:
    doc = requests.get(f"http://{fuzzed.http_url}/v2/openapi.json", timeout=10).json()
    assert doc["openapi"].startswith("3.")
    for path in ("/v2", "/v2/health/ready", "/v2/models/{model}/infer",
                 "/v2/repository/index", "/v2/repository/models/{model}/load"):  # fmt: skip
        assert path in doc["paths"], path
    infer = doc["paths"]["/v2/models/{model}/infer"]["post"]
    assert (
        "InferenceRequest" in infer["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    )


def test_schemathesis_finds_no_server_errors(fuzzed: KilnProcess, tmp_path: Path) -> None:
    exe = shutil.which("schemathesis", path=str(Path(sys.executable).parent))
    assert exe, "schemathesis is part of the test extra (pip install -e '.[test]')"
    result = subprocess.run(
        [
            exe, "run", f"http://{fuzzed.http_url}/v2/openapi.json",
            "--checks", "not_a_server_error",
            "--max-examples", "15",
            "--workers", "1",
            "--generation-deterministic",
            "--phases", "examples,coverage,fuzzing",
        ],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    assert fuzzed.proc is not None and fuzzed.proc.poll() is None, fuzzed.log()[-4000:]
    assert requests.get(f"http://{fuzzed.http_url}/v2/health/live", timeout=10).status_code == 200
