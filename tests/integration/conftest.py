"""Fixtures shared by the integration tests that drive a module's ``server`` (a
``KilnProcess`` fixture each module defines): the real ``openai`` client on its ``/v1``,
and a raw ``httpx`` client for what the SDK has no method for. A module with other needs
defines its own of the same name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.conftest import KilnProcess


@pytest.fixture
def client(server: KilnProcess) -> Any:
    """``openai.OpenAI`` on the server's ``/v1`` (no retries: a failure shows at once)."""
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture
def http(server: KilnProcess) -> Iterator[Any]:
    """``httpx.Client`` on the server's root."""
    httpx = pytest.importorskip("httpx")
    with httpx.Client(base_url=f"http://{server.http_url}", timeout=60) as c:
        yield c
