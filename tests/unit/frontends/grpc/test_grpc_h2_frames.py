"""The frame reader gives the same frames however the bytes are cut, and refuses a bad
preface or an oversized frame as soon as it can tell."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.frontends.grpc.h2 import frames as f

FRAMES: list[f.Frame] = [
    (f.SETTINGS, 0, 0, f.settings_frame({f.INITIAL_WINDOW_SIZE: 1000})[9:]),
    (f.HEADERS, f.END_HEADERS, 1, b"\x83\x86\x84"),
    (f.DATA, 0, 1, b"x" * 1000),
    (f.DATA, f.END_STREAM, 1, b""),
    (f.PING, 0, 0, b"12345678"),
    (f.WINDOW_UPDATE, 0, 0, (5000).to_bytes(4, "big")),
    (0x42, 0xFF, 7, b"unknown type"),
    (f.DATA, 0, 3, bytes(range(256)) * 64),
]
STREAM = f.PREFACE + b"".join(f.frame(*fr) for fr in FRAMES)


def read_all(chunks: list[bytes], max_frame: int = f.DEFAULT_MAX_FRAME) -> list[f.Frame]:
    reader = f.FrameReader(max_frame)
    out: list[f.Frame] = []
    for chunk in chunks:
        out.extend(reader.feed(chunk))
    return out


def test_whole() -> None:
    assert read_all([STREAM]) == FRAMES


def test_byte_by_byte() -> None:
    assert read_all([STREAM[i : i + 1] for i in range(len(STREAM))]) == FRAMES


@pytest.mark.parametrize("seed", range(20))
def test_random_chunks(seed: int) -> None:
    rng = random.Random(seed)
    chunks, pos = [], 0
    while pos < len(STREAM):
        n = rng.choice([1, 2, 7, 9, 10, 100, 4096, 20000])
        chunks.append(STREAM[pos : pos + n])
        pos += n
    assert read_all(chunks) == FRAMES


@given(st.lists(st.integers(1, len(STREAM)), max_size=30))
def test_every_cut(cuts: list[int]) -> None:
    points = sorted({0, len(STREAM), *cuts})
    chunks = [STREAM[a:b] for a, b in itertools.pairwise(points)]
    assert read_all(chunks) == FRAMES


def test_wrong_preface_is_refused_at_the_first_differing_byte() -> None:
    reader = f.FrameReader()
    with pytest.raises(f.H2ConnectionError) as err:
        list(reader.feed(b"GET / HT"))
    assert err.value.code == f.PROTOCOL_ERROR
    reader = f.FrameReader()
    assert list(reader.feed(f.PREFACE[:10])) == []  # a correct beginning waits for more
    with pytest.raises(f.H2ConnectionError):
        list(reader.feed(b"X"))


def test_oversized_frame_refused_from_its_header() -> None:
    reader = f.FrameReader(max_frame_size=16384)
    head = f.frame_head(f.DATA, 0, 1, 16385)  # the payload never needs to arrive
    with pytest.raises(f.H2ConnectionError) as err:
        list(reader.feed(f.PREFACE + head))
    assert err.value.code == f.FRAME_SIZE_ERROR
    reader = f.FrameReader(max_frame_size=16384)
    assert len(list(reader.feed(f.PREFACE + f.frame(f.DATA, 0, 1, b"x" * 16384)))) == 1


def test_reserved_bit_of_stream_id_ignored() -> None:
    raw = bytearray(f.frame(f.DATA, 0, 5, b"ab"))
    raw[5] |= 0x80
    assert list(f.FrameReader(preface=False).feed(bytes(raw))) == [(f.DATA, 0, 5, b"ab")]


def test_headers_split_into_continuation() -> None:
    block = bytes(range(256)) * 100  # 25,600 bytes
    raw = f.headers_frames(3, block, end_stream=True, max_frame=16384)
    frames = list(f.FrameReader(preface=False).feed(raw))
    assert [(t, fl, s) for t, fl, s, _ in frames] == [
        (f.HEADERS, f.END_STREAM, 3),
        (f.CONTINUATION, f.END_HEADERS, 3),
    ]
    assert b"".join(p for *_, p in frames) == block
    small = list(f.FrameReader(preface=False).feed(f.headers_frames(3, b"ab", False, 16384)))
    assert small == [(f.HEADERS, f.END_HEADERS, 3, b"ab")]


def test_control_frames() -> None:
    assert f.parse_settings(f.settings_frame({1: 2, 4: 2**31 - 1})[9:]) == [(1, 2), (4, 2**31 - 1)]
    assert f.parse_goaway(f.goaway(7, f.ENHANCE_YOUR_CALM, b"why")[9:]) == (7, 11, b"why")
    assert f.read_u32(f.window_update(1, 99)[9:]) == 99
    assert f.read_u32(f.rst_stream(1, f.CANCEL)[9:]) == f.CANCEL
    assert f.ping_ack(b"abcdefgh") == f.frame(f.PING, f.ACK, 0, b"abcdefgh")
