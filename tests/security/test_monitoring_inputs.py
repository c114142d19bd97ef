"""Hostile input to the monitoring side: ``/api/history``'s durations, against a real
``kiln serve``. A number too large for a float was an ``OverflowError`` that left as a 500
with a traceback; a duration is now refused like any other bad value, naming its field."""

from __future__ import annotations

import pytest
import requests

from kiln.monitoring.promql import parse_duration
from tests.conftest import KilnProcess

HUGE = "9" * 400  # fits Python's int, not a float


@pytest.fixture
def base(kiln_server: KilnProcess) -> str:
    return f"http://{kiln_server.http_url}"


@pytest.mark.parametrize(
    ("query", "words"),
    [
        (f"step={HUGE}s", "'step' must be seconds or a duration like 30s"),
        (f"start=now-{HUGE}s", "'start': duration"),
        (f"end=now-1h{HUGE}ms", "'end': duration"),
        (f"start=now-{'9' * 5000}s", "'start': duration"),  # past int()'s digit limit
    ],
)
def test_history_durations_too_large_are_400(base: str, query: str, words: str) -> None:
    r = requests.get(f"{base}/api/history?metric=throughput&{query}", timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert words in error and "out of range" in error
    assert "set_int_max_str_digits" not in error


@pytest.mark.parametrize("text", [f"{HUGE}s", f"{'1' * 20}ms", "300000000y"])
def test_a_duration_beyond_int64_milliseconds_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="out of range"):
        parse_duration(text)
    assert parse_duration("292y") == 292 * 365 * 86400  # still fine
