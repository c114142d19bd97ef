"""kiln's HTTP/2 gRPC server in-process, with test routes: flow control both ways (seen
frame by frame from a raw client), the call layer's answers, and real grpcio clients for
cancellation, deadlines, metadata and many streams on one connection."""

from __future__ import annotations

import asyncio
import gc
import gzip
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kiln.core.access import AccessPolicy
from kiln.frontends.grpc.h2 import connection as conn_module
from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2 import rpc
from kiln.frontends.grpc.h2.calls import Call
from kiln.frontends.grpc.h2.hpack import encode
from tests.h2_client import InProcessServer, RawH2, in_process_server, message, request_headers

STREAM_WINDOW = conn_module.STREAM_WINDOW


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    with in_process_server() as s:
        yield s


def data_frames(raw: RawH2, sid: int, until_bytes: int) -> tuple[int, list[f.Frame]]:
    """DATA received on ``sid`` until ``until_bytes`` have come or the server stops
    sending (a short wait with nothing new)."""
    got, frames = 0, []
    try:
        while got < until_bytes:
            frame = raw.read_frame(timeout=0.5)
            if frame is None:
                break
            frames.append(frame)
            if frame[0] == f.DATA and frame[2] == sid:
                got += len(frame[3])
    except TimeoutError:
        pass
    return got, frames


# ---- flow control: what the server sends ------------------------------------------------
def test_response_respects_stream_window(server: InProcessServer) -> None:
    with RawH2(server.port, {f.INITIAL_WINDOW_SIZE: 1000}) as raw:
        raw.unary(1, "/t/Big", b"5000")
        got, frames = data_frames(raw, 1, 6000)
        assert got == 1000  # exactly the window, no more
        assert not any(t == f.HEADERS and fl & f.END_STREAM for t, fl, _, _ in frames)
        raw.frame(f.WINDOW_UPDATE, 0, 1, (2000).to_bytes(4, "big"))
        got, _ = data_frames(raw, 1, 6000)
        assert got == 2000
        raw.frame(f.WINDOW_UPDATE, 0, 1, (10_000).to_bytes(4, "big"))
        rest = raw.response(1)
        assert len(rest.data) == 5005 - 3000 and rest.status == 0


def test_response_respects_connection_window_and_frame_size(server: InProcessServer) -> None:
    # default windows (65,535) and frame size (16,384): a 200 kB answer needs the
    # connection's credit several times over and comes in frames no larger than allowed
    with RawH2(server.port, {f.INITIAL_WINDOW_SIZE: 2**30}) as raw:
        raw.unary(1, "/t/Big", b"200000")
        got, frames = data_frames(raw, 1, 300_000)
        assert got == 65_535
        assert max(len(p) for t, _, _, p in frames if t == f.DATA) <= 16_384
        total = got
        while total < 200_005:
            raw.frame(f.WINDOW_UPDATE, 0, 0, (65_535).to_bytes(4, "big"))
            got, frames = data_frames(raw, 1, 65_535)
            assert 0 < got <= 65_535
            total += got
            if any(t == f.HEADERS for t, *_ in frames):
                break
        assert total == 200_005


def test_lowered_initial_window_applies_to_open_streams(server: InProcessServer) -> None:
    with RawH2(server.port, {f.INITIAL_WINDOW_SIZE: 0}) as raw:
        raw.unary(1, "/t/Big", b"3000")
        got, _ = data_frames(raw, 1, 3000)
        assert got == 0  # a zero window: headers only
        raw.frame(f.SETTINGS, 0, 0, f.settings_frame({f.INITIAL_WINDOW_SIZE: 1000})[9:])
        got, _ = data_frames(raw, 1, 3000)
        assert got == 1000  # the new initial window applies to the open stream (§6.9.2)
        raw.frame(f.SETTINGS, 0, 0, f.settings_frame({f.INITIAL_WINDOW_SIZE: 65_535})[9:])
        assert len(raw.response(1).data) == 2005


def test_larger_peer_frame_size_is_used(server: InProcessServer) -> None:
    settings = {f.INITIAL_WINDOW_SIZE: 2**20, f.MAX_FRAME_SIZE: 2**17}
    with RawH2(server.port, settings) as raw:
        raw.frame(f.WINDOW_UPDATE, 0, 0, (2**20).to_bytes(4, "big"))
        raw.unary(1, "/t/Big", b"300000")
        sizes = []
        for ftype, flags, _sid, payload in raw.frames():
            if ftype == f.DATA:
                sizes.append(len(payload))
            if ftype == f.HEADERS and flags & f.END_STREAM:
                break
        assert max(sizes) == 2**17 and sum(sizes) == 300_005


# ---- flow control: what the server lets in ----------------------------------------------
def test_server_credits_consumed_request_bytes(server: InProcessServer) -> None:
    body = b"r" * (3 * 2**20)
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Echo"))
        wire = message(body)
        for i in range(0, len(wire), 2**20):
            raw.data(1, wire[i : i + 2**20], end_stream=i + 2**20 >= len(wire))
        updates: dict[int, int] = {}
        data = b""
        for ftype, _flags, sid, payload in raw.frames():
            if ftype == f.WINDOW_UPDATE:
                updates[sid] = updates.get(sid, 0) + f.read_u32(payload)
            elif ftype == f.DATA:
                data += payload
                if len(data) >= len(wire):
                    break
                raw.frame(f.WINDOW_UPDATE, 0, 1, len(payload).to_bytes(4, "big"))
                raw.frame(f.WINDOW_UPDATE, 0, 0, len(payload).to_bytes(4, "big"))
        # credit comes back once half the stream window has been consumed
        assert updates[1] == STREAM_WINDOW // 2
        assert data == wire


def test_client_exceeding_a_stalled_streams_window_is_reset(server: InProcessServer) -> None:
    # /t/Stall never reads its requests: after a backlog the server stops giving credit,
    # and a client that keeps sending beyond the window gets FLOW_CONTROL_ERROR
    chunk = message(b"m" * 300_000)
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Stall"))
        for _ in range(30):
            raw.data(1, chunk)
        response = raw.response(1)
        assert response.reset == f.FLOW_CONTROL_ERROR
        raw.unary(3, "/t/Echo", b"still fine")
        assert raw.response(3).data == message(b"still fine")


# ---- the call layer ---------------------------------------------------------------------
def test_status_codes_and_messages(server: InProcessServer) -> None:
    with RawH2(server.port) as raw:
        raw.unary(1, "/t/Abort", "not here: 100% \n ŝ".encode())
        r = raw.response(1)
        assert (r.status, r.message) == (5, "not here: 100% \n ŝ")
        assert r.data == b"" and r.header(":status") == "200"  # trailers-only
        raw.unary(3, "/t/Fail")
        r = raw.response(3)
        assert r.status == rpc.UNKNOWN and "ValueError" in r.message
        raw.unary(5, "/t/Nope")
        r = raw.response(5)
        assert (r.status, r.message) == (rpc.UNIMPLEMENTED, "Method not found: /t/Nope")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ([(b":method", b"GET")], "405"),
        ([(b"content-type", b"text/plain")], "415"),
    ],
)
def test_http_level_refusals(
    server: InProcessServer, headers: list[tuple[bytes, bytes]], status: str
) -> None:
    base = dict(request_headers("/t/Echo"))
    base.update(headers)
    with RawH2(server.port) as raw:
        raw.headers(1, list(base.items()), end_stream=True)
        assert raw.response(1).header(":status") == status


@pytest.mark.parametrize(
    "headers",
    [
        [(b"content-type", b"application/grpc"), (b":path", b"/t/Echo")],  # pseudo after
        [(b":path", b"/t/Echo"), (b":status", b"200")],  # a response pseudo-header
        [(b":path", b"/t/Echo"), (b"X-Upper", b"1")],
        [(b":path", b"/t/Echo"), (b"connection", b"close")],
        [(b":path", b"/t/Echo"), (b"te", b"gzip")],
        [(b":method", b"POST"), (b"content-type", b"application/grpc")],  # no :path
    ],
    ids=["pseudo-after-regular", "unknown-pseudo", "uppercase", "connection", "te", "no-path"],
)
def test_malformed_requests_are_reset(
    server: InProcessServer, headers: list[tuple[bytes, bytes]]
) -> None:
    with RawH2(server.port) as raw:
        raw.headers(1, [(b":method", b"POST"), (b":scheme", b"http"), *headers])
        assert raw.response(1).reset == f.PROTOCOL_ERROR
        raw.unary(3, "/t/Echo", b"ok")
        assert raw.response(3).data == message(b"ok")


def test_request_message_rules(server: InProcessServer) -> None:
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Echo"), end_stream=True)  # no message
        assert raw.response(1).status == rpc.INTERNAL
        raw.headers(3, request_headers("/t/Echo"))
        raw.data(3, message(b"a") + message(b"b"))  # two for a unary call: refused at once
        r = raw.response(3)
        assert r.status == rpc.INTERNAL and "more than one" in r.message
        raw.headers(5, request_headers("/t/Echo"))
        raw.data(5, message(b"abc")[:6], end_stream=True)  # cut short
        assert raw.response(5).status == rpc.INTERNAL


def test_message_split_across_frames(server: InProcessServer) -> None:
    wire = message(b"0123456789" * 1000)
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Echo"))
        for i in range(0, len(wire), 7):
            raw.data(1, wire[i : i + 7])
        raw.data(1, b"", end_stream=True)
        assert raw.response(1).data == wire


def test_padded_data_and_headers(server: InProcessServer) -> None:
    block = encode(request_headers("/t/Echo"))
    with RawH2(server.port) as raw:
        raw.frame(f.HEADERS, f.END_HEADERS | f.PADDED, 1, bytes([3]) + block + b"pad")
        raw.frame(f.DATA, f.END_STREAM | f.PADDED, 1, bytes([5]) + message(b"hi") + b"\0" * 5)
        assert raw.response(1).data == message(b"hi")
        # PRIORITY flag and a PRIORITY frame are accepted and ignored
        raw.frame(f.HEADERS, f.END_HEADERS | f.PRIORITY_FLAG, 3, b"\0\0\0\0\x10" + block)
        raw.frame(f.PRIORITY, 0, 3, b"\0\0\0\x01\x10")
        raw.data(3, message(b"yo"), end_stream=True)
        assert raw.response(3).data == message(b"yo")


def test_compressed_requests(server: InProcessServer) -> None:
    body = b"compress me " * 100
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Echo", (b"grpc-encoding", b"gzip")))
        raw.data(1, message(gzip.compress(body), compressed=True), end_stream=True)
        assert raw.response(1).data == message(body)  # answered uncompressed
        raw.headers(3, request_headers("/t/Echo", (b"grpc-encoding", b"snappy")))
        raw.data(3, message(b"x", compressed=True), end_stream=True)
        r = raw.response(3)
        assert r.status == rpc.UNIMPLEMENTED and "snappy" in r.message
        assert r.header("grpc-accept-encoding") == "identity,deflate,gzip"
        raw.headers(5, request_headers("/t/Echo"))  # flag set, no grpc-encoding
        raw.data(5, message(gzip.compress(body), compressed=True), end_stream=True)
        assert raw.response(5).status == rpc.INTERNAL
        raw.headers(7, request_headers("/t/Echo", (b"grpc-encoding", b"gzip")))
        raw.data(7, message(b"not gzip", compressed=True), end_stream=True)
        assert raw.response(7).status == rpc.INTERNAL


def test_message_size_limit_both_ways() -> None:
    with in_process_server(max_message_bytes=1000) as s, RawH2(s.port) as raw:
        raw.headers(1, request_headers("/t/Echo"))
        raw.data(1, rpc.prefix(5000) + b"x" * 100)  # refused before the rest arrives
        r = raw.response(1)
        assert r.status == rpc.RESOURCE_EXHAUSTED
        assert r.message == "Received message larger than max (5000 vs. 1000)"
        raw.unary(3, "/t/Big", b"2000")
        r = raw.response(3)
        assert r.status == rpc.RESOURCE_EXHAUSTED and "Sent message larger" in r.message
        raw.headers(5, request_headers("/t/Echo", (b"grpc-encoding", b"gzip")))
        raw.data(5, message(gzip.compress(b"\0" * 5000), compressed=True), end_stream=True)
        assert raw.response(5).status == rpc.RESOURCE_EXHAUSTED


def test_access_policy_refuses_before_the_handler() -> None:
    policy = AccessPolicy(api_keys=("k1",))
    with in_process_server(access=policy) as s, RawH2(s.port) as raw:
        raw.unary(1, "/t/Echo", b"x")
        r = raw.response(1)
        assert r.status == rpc.UNAUTHENTICATED and "missing API key" in r.message
        raw.unary(3, "/t/Echo", b"x", (b"x-api-key", b"k1"))
        assert raw.response(3).data == message(b"x")
    assert s.seen.metadata == [(("x-api-key", "k1"),)]


def test_streaming_call_echoes_and_ends_on_half_close(server: InProcessServer) -> None:
    with RawH2(server.port) as raw:
        raw.headers(1, request_headers("/t/Stream"))
        raw.data(1, message(b"one") + message(b"two"))
        raw.data(1, message(b"three"), end_stream=True)
        r = raw.response(1)
        assert r.data == message(b"one") + message(b"two") + message(b"three")
        assert r.status == 0


# ---- with grpcio's client ---------------------------------------------------------------
def test_metadata_reaches_the_handler(server: InProcessServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        echo = channel.unary_unary("/t/Echo")
        assert echo(b"hi", metadata=(("x-id", "7"), ("blob-bin", b"\0\xff"))) == b"hi"
    metadata = dict(server.seen.metadata[-1])
    assert metadata["x-id"] == "7" and metadata["blob-bin"] == b"\0\xff"
    assert "user-agent" in metadata and not any(k.startswith(":") for k in metadata)


def test_client_cancellation_cancels_the_handler(server: InProcessServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        future = channel.unary_unary("/t/Sleep").future(b"")
        assert server.seen.started.wait(10)
        future.cancel()
        for _ in range(200):
            if server.seen.cancelled:
                break
            time.sleep(0.05)
        assert server.seen.cancelled == ["sleep"]
        assert channel.unary_unary("/t/Echo")(b"after") == b"after"
    assert server.call(lambda: len(server.server.dispatcher.calls)) == 0


def test_deadline_exceeded_cancels_the_handler(server: InProcessServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/t/Sleep")(b"", timeout=0.3)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for _ in range(200):
            if server.seen.cancelled:
                break
            time.sleep(0.05)
        assert server.seen.cancelled == ["sleep"]


def test_deadline_answered_by_the_server() -> None:
    # a raw client keeps listening past its own deadline: the server's status is seen
    with in_process_server() as s, RawH2(s.port) as raw:
        raw.unary(1, "/t/Sleep", b"", (b"grpc-timeout", b"200m"))
        r = raw.response(1)
        assert (r.status, r.message) == (rpc.DEADLINE_EXCEEDED, "Deadline Exceeded")
        for _ in range(200):
            if s.seen.cancelled:
                break
            time.sleep(0.05)
        assert s.seen.cancelled == ["sleep"]


def test_many_concurrent_streams_on_one_connection(server: InProcessServer) -> None:
    async def run() -> list[bytes]:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            echo = channel.unary_unary("/t/Echo")
            return await asyncio.gather(*(echo(b"%d" % i) for i in range(300)))

    assert asyncio.run(run()) == [b"%d" % i for i in range(300)]
    assert server.call(lambda: len(server.server.connections)) <= 1


def test_bidirectional_stream_with_grpcio(server: InProcessServer) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stream = channel.stream_stream("/t/Stream")
        assert list(stream(iter([b"a", b"b" * 100_000, b"c"]))) == [b"a", b"b" * 100_000, b"c"]


def test_large_messages_both_ways(server: InProcessServer) -> None:
    body = bytes(range(256)) * (2**18)  # 64 MiB
    options = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
    with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
        assert channel.unary_unary("/t/Echo")(body, timeout=120) == body


# ---- connection lifetime ---------------------------------------------------------------
def test_silent_client_is_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conn_module, "PREFACE_TIMEOUT", 0.2)
    with in_process_server() as s, RawH2(s.port, preface=False) as raw:
        assert raw.goaway()[1] == f.SETTINGS_TIMEOUT


def test_stop_lets_in_flight_calls_finish_and_refuses_new_streams(
    server: InProcessServer,
) -> None:
    with RawH2(server.port) as raw:
        raw.unary(1, "/t/Sleep")
        assert server.seen.started.wait(10)
        stopping = threading.Thread(
            target=lambda: asyncio.run_coroutine_threadsafe(
                server.server.stop(0.5), server.loop
            ).result(10)
        )
        stopping.start()
        assert raw.goaway() == (1, f.NO_ERROR)
        raw.unary(3, "/t/Echo")
        r3 = raw.response(3)
        assert r3.reset == f.REFUSED_STREAM
        r1 = raw.response(1)  # the grace ran out: cancelled with UNAVAILABLE
        assert r1.status == rpc.UNAVAILABLE
        stopping.join(10)
    assert server.seen.cancelled == ["sleep"]


def test_frames_after_end_stream_reset_the_stream(server: InProcessServer) -> None:
    with RawH2(server.port) as raw:
        raw.unary(1, "/t/Sleep")
        assert server.seen.started.wait(10)
        raw.data(1, b"more")  # the request was complete: STREAM_CLOSED
        assert raw.response(1).reset == f.STREAM_CLOSED
        for _ in range(200):
            if server.seen.cancelled:
                break
            time.sleep(0.05)
        assert server.seen.cancelled == ["sleep"]
        raw.unary(3, "/t/Sleep")
        raw.headers(3, [(b"x-trailer", b"1")], end_stream=True)  # trailers after the end
        assert raw.response(3).reset == f.STREAM_CLOSED
        raw.unary(5, "/t/Echo", b"fine")
        assert raw.response(5).data == message(b"fine")


def test_header_list_over_the_limit_is_refused(server: InProcessServer) -> None:
    big = [(b"x-big-%d" % i, b"v" * 4000) for i in range(17)]  # > 64 KiB as counted
    with RawH2(server.port) as raw:
        block = encode(request_headers("/t/Echo", *big))
        raw.frame(f.HEADERS, 0, 1, block[:30000])
        raw.frame(f.CONTINUATION, 0, 1, block[30000:60000])
        raw.frame(f.CONTINUATION, f.END_HEADERS, 1, block[60000:])
        r = raw.response(1)
        assert r.status == rpc.RESOURCE_EXHAUSTED and "header list" in r.message
        raw.unary(3, "/t/Echo", b"ok")
        assert raw.response(3).data == message(b"ok")


def test_binary_metadata_that_is_not_base64_arrives_as_sent(server: InProcessServer) -> None:
    with RawH2(server.port) as raw:
        raw.unary(1, "/t/Echo", b"x", (b"a-bin", b"AAEC"), (b"b-bin", b"!!not base64"))
        assert raw.response(1).status == 0
    metadata = dict(server.seen.metadata[-1])
    assert metadata == {"a-bin": b"\0\1\2", "b-bin": b"!!not base64"}


def test_held_request_bytes_return_to_zero() -> None:
    """Every way a call ends gives back what it held (calls.HELD_MESSAGES_PER_CONNECTION):
    a long-lived connection must not drift into refusing calls. The budget here is 4 KB."""
    with in_process_server(max_message_bytes=1000) as server, RawH2(server.port) as raw:

        def held() -> list[int]:
            return server.call(lambda: [c.held for c in server.server.connections])

        for i in range(20):  # answered unary calls: 20 KB through a 4 KB budget
            raw.unary(2 * i + 1, "/t/Echo", b"x" * 900)
            assert raw.response(2 * i + 1).status == rpc.OK
        raw.headers(41, request_headers("/t/Stream"))
        for _ in range(10):
            raw.data(41, message(b"y" * 900))
        raw.data(41, b"", end_stream=True)
        assert raw.response(41).data == message(b"y" * 900) * 10
        raw.headers(43, request_headers("/t/Echo"))
        raw.data(43, message(b"z" * 10)[:8])  # unfinished, then reset by the client
        raw.frame(f.RST_STREAM, 0, 43, (8).to_bytes(4, "big"))
        raw.headers(45, request_headers("/t/Echo"))
        raw.data(45, message(b"w" * 1001))  # over the message limit
        assert raw.response(45).status == rpc.RESOURCE_EXHAUSTED
        raw.headers(47, request_headers("/t/Echo"))
        raw.data(47, message(b"a") + message(b"b"))  # refused: two for a unary call
        assert raw.response(47).status == rpc.INTERNAL
        assert held() == [0]
        # unfinished messages past the budget: the call that crosses it is refused
        for sid in (49, 51, 53, 55, 57):
            raw.headers(sid, request_headers("/t/Echo"))
            raw.data(sid, rpc.prefix(1000) + b"u" * 900)
        r = raw.response(57)
        assert r.status == rpc.RESOURCE_EXHAUSTED
        assert r.message == (
            "the connection holds more than 4000 bytes of requests not yet handled "
            "(4 x --grpc-max-message-bytes)"
        )
        assert held() == [4 * 905]

        def unfinished() -> list[int]:  # calls still buffering a message, alive or garbage
            calls = [o for o in gc.get_objects() if isinstance(o, Call) and o.reader.partial]
            return sorted(c.stream.id for c in calls)

        # the refused call's bytes go at once, not when the collector finds it
        assert server.call(unfinished) == [49, 51, 53, 55]
        raw.data(49, b"u" * 100, end_stream=True)  # one finishes: answered, its bytes freed
        assert raw.response(49).status == rpc.OK
        assert held() == [3 * 905]
