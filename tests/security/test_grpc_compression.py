"""A compressed gRPC message must be exactly one stream, as an HTTP body must
(``tests/security/test_http_compression.py``): zlib stops at the end of the first gzip
member, so trailing bytes or a second member would otherwise be dropped unseen."""

from __future__ import annotations

import gzip
import zlib

import pytest

from kiln.frontends.grpc.h2 import rpc

DATA = b"kiln" * 64


@pytest.mark.parametrize(
    ("payload", "encoding"),
    [
        (gzip.compress(DATA) + b"garbage", b"gzip"),
        (gzip.compress(DATA) + gzip.compress(b"second member"), b"gzip"),
        (zlib.compress(DATA) + b"\0", b"deflate"),
    ],
    ids=["gzip trailing bytes", "gzip second member", "deflate trailing bytes"],
)
def test_anything_after_the_stream_is_refused(payload: bytes, encoding: bytes) -> None:
    with pytest.raises(ValueError, match="follow the end"):
        rpc.inflate(payload, encoding, 2**20)


def test_one_whole_stream_still_inflates() -> None:
    assert rpc.inflate(gzip.compress(DATA), b"gzip", 2**20) == DATA
    assert rpc.inflate(zlib.compress(DATA), b"deflate", 2**20) == DATA
