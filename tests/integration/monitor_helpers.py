"""Helpers shared by the history and alert integration tests."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sized
from typing import Any, TypeVar

import numpy as np
import tritonclient.http as httpclient

from tests.conftest import KilnProcess

T = TypeVar("T")


def get_json(server: KilnProcess, path: str, **params: str) -> tuple[int, Any]:
    url = f"http://{server.http_url}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def infer_simple(server: KilnProcess, n: int = 1) -> int:
    """n real tritonclient inferences on ``simple``; returns how many were correct."""
    client = httpclient.InferenceServerClient(server.http_url)
    a = np.arange(16, dtype=np.int32).reshape(1, 16)
    ok = 0
    for _ in range(n):
        inputs = [httpclient.InferInput(name, [1, 16], "INT32") for name in ("INPUT0", "INPUT1")]
        for i in inputs:
            i.set_data_from_numpy(a)
        result = client.infer("simple", inputs)
        ok += bool((result.as_numpy("OUTPUT0") == a + a).all())
    client.close()
    return ok


def wait_for(predicate: Callable[[], T | None], timeout: float, what: str) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = predicate()
        # An empty container is "not yet" too: ``rows and max(rows) > n`` yields [] early.
        empty = isinstance(result, Sized) and not isinstance(result, str) and len(result) == 0
        if result is not None and result is not False and not empty:
            return result
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not seen within {timeout}s")
