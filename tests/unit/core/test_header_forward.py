"""``--http-header-forward-pattern`` / ``--grpc-header-forward-pattern`` as Triton reads
them: searched in the name, case-insensitive unless ``(?-i)``, reserved names never."""

from __future__ import annotations

import pytest

from kiln.core.header_forward import header_forward

HEADERS = [("X-User-Id", "alice"), ("x-user-tier", "gold"), ("accept", "*/*"),
           ("my-x-user-thing", "partial"), ("priority", "9"), ("timeout", "1"),
           ("triton_enable_empty_final_response", "true"), ("x-user-blob-bin", "raw")]  # fmt: skip


def test_a_pattern_is_searched_case_insensitively_and_names_are_lowered() -> None:
    forward = header_forward("x-user-", "--http-header-forward-pattern")
    assert forward is not None
    assert forward.select(HEADERS) == {
        "x-user-id": "alice",
        "x-user-tier": "gold",
        "my-x-user-thing": "partial",  # a search, as RE2's PartialMatch: ^ anchors
    }
    anchored = header_forward("^X-USER-", "--http-header-forward-pattern")
    assert anchored is not None
    assert anchored.select(HEADERS) == {"x-user-id": "alice", "x-user-tier": "gold"}


def test_case_sensitive_with_re2s_flag() -> None:
    forward = header_forward("(?-i)^x-user-", "--grpc-header-forward-pattern")
    assert forward is not None
    assert forward.select(HEADERS) == {"x-user-tier": "gold"}  # not "X-User-Id"


def test_reserved_parameters_and_binary_metadata_are_never_forwarded() -> None:
    forward = header_forward(".*", "--grpc-header-forward-pattern")
    assert forward is not None
    got = forward.select(HEADERS)
    assert not {"priority", "timeout", "triton_enable_empty_final_response"} & set(got)
    assert "x-user-blob-bin" not in got
    assert got["accept"] == "*/*"


def test_raw_http_headers_are_read_as_latin_1() -> None:
    forward = header_forward("^x-user-", "--http-header-forward-pattern")
    assert forward is not None
    assert forward.select_raw([(b"x-user-name", "J\u00f6rg".encode("latin-1"))]) == {
        "x-user-name": "J\u00f6rg"
    }


def test_no_pattern_is_no_forwarding_and_a_bad_one_names_its_flag() -> None:
    assert header_forward("", "--http-header-forward-pattern") is None
    assert header_forward(None, "--http-header-forward-pattern") is None
    with pytest.raises(ValueError, match=r"--http-header-forward-pattern: 'x\(' is not a reg"):
        header_forward("x(", "--http-header-forward-pattern")
