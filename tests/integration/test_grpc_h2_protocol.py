"""Protocol errors over a raw socket against ``kiln serve``: each gets the code RFC 9113
asks for (GOAWAY for a connection error, RST_STREAM for a stream error), and the server
keeps serving its other connections and new ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2.connection import (
    MAX_CONCURRENT,
    MAX_FRAME,
    MAX_HEADER_BLOCK,
    MAX_RESETS_PER_SECOND,
)
from kiln.frontends.grpc.h2.hpack import encode
from tests.conftest import KilnProcess
from tests.h2_client import SERVER_LIVE, RawH2, request_headers

U32 = 2**31 - 1


def u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def live_block() -> bytes:
    return encode(request_headers(SERVER_LIVE))


def open_live(raw: RawH2, sid: int = 1) -> None:
    """A ServerLive call whose request is not finished: the stream stays open."""
    raw.headers(sid, request_headers(SERVER_LIVE))


Send = Callable[[RawH2], None]

CONNECTION_ERRORS: dict[str, tuple[Send, int]] = {
    "headers-on-stream-0": (lambda r: r.frame(f.HEADERS, f.END_HEADERS, 0, live_block()),
                            f.PROTOCOL_ERROR),
    "even-stream-id": (lambda r: r.frame(f.HEADERS, f.END_HEADERS, 2, live_block()),
                       f.PROTOCOL_ERROR),
    "data-on-idle-stream": (lambda r: r.data(5, b"\0\0\0\0\0"), f.PROTOCOL_ERROR),
    "data-on-stream-0": (lambda r: r.data(0, b"x"), f.PROTOCOL_ERROR),
    "frame-too-large": (lambda r: r.send(f.frame_head(f.DATA, 0, 1, MAX_FRAME + 1)),
                        f.FRAME_SIZE_ERROR),
    "hpack-index-beyond-table": (lambda r: r.frame(f.HEADERS, f.END_HEADERS, 1, b"\xbe"),
                                 f.COMPRESSION_ERROR),
    "hpack-bad-huffman": (lambda r: r.frame(f.HEADERS, f.END_HEADERS, 1, b"\x04\x82\xff\xff"),
                          f.COMPRESSION_ERROR),
    "hpack-truncated": (lambda r: r.frame(f.HEADERS, f.END_HEADERS, 1, b"\x40\x0aab"),
                        f.COMPRESSION_ERROR),
    "continuation-unexpected": (lambda r: r.frame(f.CONTINUATION, f.END_HEADERS, 1, b"\x82"),
                                f.PROTOCOL_ERROR),
    "frame-inside-header-block": (
        lambda r: (r.frame(f.HEADERS, 0, 1, live_block()), r.frame(f.PING, 0, 0, b"8 bytes!")),
        f.PROTOCOL_ERROR),
    "continuation-of-another-stream": (
        lambda r: (r.frame(f.HEADERS, 0, 1, live_block()),
                   r.frame(f.CONTINUATION, f.END_HEADERS, 3, b"")),
        f.PROTOCOL_ERROR),
    "header-block-too-large": (
        lambda r: (r.frame(f.HEADERS, 0, 1, live_block()),
                   *(r.frame(f.CONTINUATION, 0, 1, b"\0" * 65536)
                     for _ in range(MAX_HEADER_BLOCK // 65536 + 1))),
        f.ENHANCE_YOUR_CALM),
    "headers-padding-too-long": (
        lambda r: r.frame(f.HEADERS, f.END_HEADERS | f.PADDED, 1, b"\xff" + live_block()),
        f.PROTOCOL_ERROR),
    "data-padding-too-long": (
        lambda r: (open_live(r), r.frame(f.DATA, f.PADDED, 1, b"\x09abc")), f.PROTOCOL_ERROR),
    "headers-priority-too-short": (
        lambda r: r.frame(f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 1, b"\0\0"),
        f.FRAME_SIZE_ERROR),
    "priority-on-stream-0": (lambda r: r.frame(f.PRIORITY, 0, 0, b"\0" * 5), f.PROTOCOL_ERROR),
    "rst-on-stream-0": (lambda r: r.frame(f.RST_STREAM, 0, 0, u32(0)), f.PROTOCOL_ERROR),
    "rst-wrong-size": (lambda r: (open_live(r), r.frame(f.RST_STREAM, 0, 1, b"\0")),
                       f.FRAME_SIZE_ERROR),
    "rst-on-idle-stream": (lambda r: r.frame(f.RST_STREAM, 0, 7, u32(8)), f.PROTOCOL_ERROR),
    "settings-on-a-stream": (lambda r: r.frame(f.SETTINGS, 0, 1, b""), f.PROTOCOL_ERROR),
    "settings-ack-with-payload": (lambda r: r.frame(f.SETTINGS, f.ACK, 0, b"\0" * 6),
                                  f.FRAME_SIZE_ERROR),
    "settings-wrong-size": (lambda r: r.frame(f.SETTINGS, 0, 0, b"\0" * 5), f.FRAME_SIZE_ERROR),
    "settings-window-too-large": (
        lambda r: r.send(f.settings_frame({f.INITIAL_WINDOW_SIZE: 2**31})),
        f.FLOW_CONTROL_ERROR),
    "settings-frame-size-too-small": (
        lambda r: r.send(f.settings_frame({f.MAX_FRAME_SIZE: 16383})), f.PROTOCOL_ERROR),
    "settings-frame-size-too-large": (
        lambda r: r.send(f.settings_frame({f.MAX_FRAME_SIZE: 2**24})), f.PROTOCOL_ERROR),
    "settings-enable-push-2": (lambda r: r.send(f.settings_frame({f.ENABLE_PUSH: 2})),
                               f.PROTOCOL_ERROR),
    "settings-window-overflows-a-stream": (
        lambda r: (open_live(r), r.frame(f.WINDOW_UPDATE, 0, 1, u32(U32 - 65535)),
                   r.send(f.settings_frame({f.INITIAL_WINDOW_SIZE: 65536}))),
        f.FLOW_CONTROL_ERROR),
    "push-promise": (lambda r: r.frame(f.PUSH_PROMISE, f.END_HEADERS, 1, u32(2) + b"\x82"),
                     f.PROTOCOL_ERROR),
    "ping-on-a-stream": (lambda r: r.frame(f.PING, 0, 1, b"8 bytes!"), f.PROTOCOL_ERROR),
    "ping-wrong-size": (lambda r: r.frame(f.PING, 0, 0, b"7 bytes"), f.FRAME_SIZE_ERROR),
    "goaway-on-a-stream": (lambda r: r.frame(f.GOAWAY, 0, 1, u32(0) + u32(0)),
                           f.PROTOCOL_ERROR),
    "goaway-too-short": (lambda r: r.frame(f.GOAWAY, 0, 0, u32(0)), f.FRAME_SIZE_ERROR),
    "window-update-wrong-size": (lambda r: r.frame(f.WINDOW_UPDATE, 0, 0, b"\0\0\1"),
                                 f.FRAME_SIZE_ERROR),
    "window-update-0": (lambda r: r.frame(f.WINDOW_UPDATE, 0, 0, u32(0)), f.PROTOCOL_ERROR),
    "window-update-idle-stream": (lambda r: r.frame(f.WINDOW_UPDATE, 0, 9, u32(1)),
                                  f.PROTOCOL_ERROR),
    "connection-window-overflow": (lambda r: r.frame(f.WINDOW_UPDATE, 0, 0, u32(U32)),
                                   f.FLOW_CONTROL_ERROR),
}  # fmt: skip

STREAM_ERRORS: dict[str, tuple[Send, int]] = {
    "stream-window-overflow": (
        lambda r: (open_live(r), r.frame(f.WINDOW_UPDATE, 0, 1, u32(U32))), f.FLOW_CONTROL_ERROR),
    "stream-window-update-0": (
        lambda r: (open_live(r), r.frame(f.WINDOW_UPDATE, 0, 1, u32(0))), f.PROTOCOL_ERROR),
    "trailers-without-end-stream": (
        lambda r: (open_live(r), r.headers(1, [(b"x-trailer", b"1")])), f.PROTOCOL_ERROR),
    "priority-wrong-size": (lambda r: (open_live(r), r.frame(f.PRIORITY, 0, 1, b"\0" * 4)),
                            f.FRAME_SIZE_ERROR),
    "stream-id-reused": (
        lambda r: (r.unary(1, SERVER_LIVE), r.response(1),
                   r.headers(1, request_headers(SERVER_LIVE))),
        f.STREAM_CLOSED),
}  # fmt: skip


@pytest.fixture
def bystander(kiln_server: KilnProcess) -> Iterator[RawH2]:
    """Another connection, open before the bad one, that must be unaffected."""
    with RawH2(kiln_server.grpc_port) as raw:
        raw.unary(1, SERVER_LIVE)
        assert raw.response(1).status == 0
        yield raw
        raw.unary(3, SERVER_LIVE)
        assert raw.response(3).status == 0


@pytest.mark.parametrize("case", list(CONNECTION_ERRORS))
def test_connection_error_sends_goaway(
    case: str, kiln_server: KilnProcess, bystander: RawH2
) -> None:
    send, code = CONNECTION_ERRORS[case]
    with RawH2(kiln_server.grpc_port) as raw:
        send(raw)
        assert raw.goaway()[1] == code
        assert raw.read_frame() is None  # and the connection closes


@pytest.mark.parametrize("case", list(STREAM_ERRORS))
def test_stream_error_resets_only_the_stream(
    case: str, kiln_server: KilnProcess, bystander: RawH2
) -> None:
    send, code = STREAM_ERRORS[case]
    with RawH2(kiln_server.grpc_port) as raw:
        send(raw)
        assert raw.response(1).reset == code
        raw.unary(101, SERVER_LIVE)  # the same connection goes on
        assert raw.response(101).status == 0


def test_bad_preface(kiln_server: KilnProcess, bystander: RawH2) -> None:
    with RawH2(kiln_server.grpc_port, preface=False) as raw:
        raw.send(b"POST / HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.goaway()[1] == f.PROTOCOL_ERROR
    with RawH2(kiln_server.grpc_port, preface=False) as raw:
        raw.send(f.PREFACE + f.frame(f.PING, 0, 0, b"8 bytes!"))  # SETTINGS must come first
        assert raw.goaway()[1] == f.PROTOCOL_ERROR


def test_too_many_concurrent_streams_are_refused(
    kiln_server: KilnProcess, bystander: RawH2
) -> None:
    with RawH2(kiln_server.grpc_port) as raw:
        block = encode(request_headers(SERVER_LIVE))
        raw.send(
            b"".join(
                f.frame(f.HEADERS, f.END_HEADERS, 2 * i + 1, block)
                for i in range(MAX_CONCURRENT + 1)
            )
        )
        assert raw.response(2 * MAX_CONCURRENT + 1).reset == f.REFUSED_STREAM
        raw.data(1, b"\0\0\0\0\0", end_stream=True)  # the open ones still work
        assert raw.response(1).status == 0


def test_rapid_reset_closes_the_connection(kiln_server: KilnProcess, bystander: RawH2) -> None:
    with RawH2(kiln_server.grpc_port) as raw:
        block = encode(request_headers(SERVER_LIVE))
        raw.send(
            b"".join(
                f.frame(f.HEADERS, f.END_HEADERS, sid, block) + f.rst_stream(sid, f.CANCEL)
                for sid in range(1, 2 * (MAX_RESETS_PER_SECOND + 10), 2)
            )
        )
        assert raw.goaway()[1] == f.ENHANCE_YOUR_CALM


def test_unknown_frame_types_and_pings_are_handled(
    kiln_server: KilnProcess, bystander: RawH2
) -> None:
    with RawH2(kiln_server.grpc_port) as raw:
        raw.frame(0x42, 0xFF, 1, b"whatever")  # ignored (§5.5)
        raw.frame(f.PING, 0, 0, b"pingpong")
        for ftype, flags, _, payload in raw.frames():
            if ftype == f.PING:
                assert flags & f.ACK and payload == b"pingpong"
                break
        raw.unary(1, SERVER_LIVE)
        assert raw.response(1).status == 0


def test_client_goaway_lets_calls_finish(kiln_server: KilnProcess) -> None:
    with RawH2(kiln_server.grpc_port) as raw:
        open_live(raw)
        raw.frame(f.GOAWAY, 0, 0, u32(1) + u32(0))
        raw.data(1, b"\0\0\0\0\0", end_stream=True)
        assert raw.response(1).status == 0
        assert raw.read_frame() is None  # then the server closes


def test_tritonclient_after_all_errors(kiln_server: KilnProcess) -> None:
    client = grpcclient.InferenceServerClient(kiln_server.grpc_url)
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(data)
    np.testing.assert_array_equal(client.infer("simple", inputs).as_numpy("OUTPUT0"), data * 2)
