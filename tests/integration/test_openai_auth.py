"""OpenAI routes under ``--api-key``: the real ``openai`` client's ``Authorization: Bearer``."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

from tests.conftest import KilnProcess  # noqa: E402
from tests.integration.test_openai_api import CONFIG  # noqa: E402
from tests.llm_models import tiny_llm_repository  # noqa: E402

KEY = "sk-kiln-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KilnProcess]:
    repo = tiny_llm_repository(tmp_path_factory.mktemp("llm_auth"), CONFIG)
    proc = KilnProcess(repo, args=["--api-key", KEY]).start(timeout=120)
    yield proc
    proc.stop()


def _client(server: KilnProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=key, max_retries=0)


def test_bearer_key_is_accepted(server: KilnProcess) -> None:
    client = _client(server, KEY)
    assert [m.id for m in client.models.list()] == ["tiny"]
    done = client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens >= 1


@pytest.mark.parametrize("key", ["wrong-key", ""])
def test_missing_or_wrong_key_is_refused(server: KilnProcess, key: str) -> None:
    client = _client(server, key or "unset")
    if not key:
        client = openai.OpenAI(
            base_url=f"http://{server.http_url}/v1", api_key="x", max_retries=0,
            default_headers={"Authorization": ""},
        )  # fmt: skip
    with pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert err.value.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
