"""Attacks on kiln's own HTTP/2 gRPC transport (issue #25, findings 14-19), sent raw to a
real server: each ends in a GOAWAY with the right code or a bounded outcome, and an
ordinary client (tritonclient) is answered after it."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import click
import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.h2 import frames as f
from kiln.frontends.grpc.h2 import huffman
from kiln.frontends.grpc.h2.connection import (
    MAX_EMPTY_FRAGMENTS,
    MAX_HEADER_BLOCK,
    MAX_HEADER_LIST,
    MAX_RESETS_PER_SECOND,
    MAX_SETTINGS_ENTRIES,
    MAX_SETTINGS_PER_SECOND,
    Limits,
)
from kiln.frontends.grpc.h2.hpack import Decoder, HeaderListTooLarge, encode, literal
from kiln.frontends.grpc.h2.sender import MAX_QUEUED_CONTROL
from kiln.frontends.grpc.servicer import STREAM_MAX_IN_FLIGHT
from kiln.security import DEFAULT_MAX_INPUT_BYTES, SecurityOptions
from tests.conftest import KilnProcess
from tests.h2_client import SERVER_LIVE, RawH2, in_process_server, message, request_headers

INFER = "/inference.GRPCInferenceService/ModelInfer"
STREAM_INFER = "/inference.GRPCInferenceService/ModelStreamInfer"


def u32(value: int) -> bytes:
    return value.to_bytes(4, "big")


def assert_other_client_served(port: int) -> None:
    """The behaviour that matters: an ordinary client is still answered."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    data = np.arange(16, dtype=np.int32).reshape(1, 16)
    inputs = [grpcclient.InferInput(n, [1, 16], "INT32") for n in ("INPUT0", "INPUT1")]
    for item in inputs:
        item.set_data_from_numpy(data)
    result = client.infer("simple", inputs, client_timeout=30)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), data * 2)
    client.close()


def open_streams(raw: RawH2, count: int) -> None:
    """``count`` ServerLive calls left open (request not finished)."""
    block = encode(request_headers(SERVER_LIVE))
    raw.send(b"".join(f.frame(f.HEADERS, f.END_HEADERS, 2 * i + 1, block) for i in range(count)))


def infer_body() -> bytes:
    msg = pb.ModelInferRequest(model_name="simple")
    for name in ("INPUT0", "INPUT1"):
        msg.inputs.add(name=name, datatype="INT32", shape=[1, 16])
        msg.raw_input_contents.append(np.arange(16, dtype=np.int32).tobytes())
    return msg.SerializeToString()


@pytest.fixture(scope="module")
def quick_server(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A server whose header-block and idle timeouts are short (the defaults: 30 s, 5 min)."""
    repo = tmp_path_factory.mktemp("h2sec") / "models"
    shutil.copytree(example_repo / "simple", repo / "simple")
    server = KilnProcess(
        repo, args=["--http-header-timeout-secs", "1", "--grpc-max-connection-idle-secs", "1"]
    ).start()
    yield server.grpc_port
    server.stop()


# ---- 14: SETTINGS amplification ---------------------------------------------------------
class TestSettingsAmplification:
    def test_too_many_entries_in_one_frame(self, kiln_server: KilnProcess) -> None:
        # before: every INITIAL_WINDOW_SIZE entry walked every open stream
        with RawH2(kiln_server.grpc_port) as raw:
            open_streams(raw, 64)
            entries = b"".join(
                (f.INITIAL_WINDOW_SIZE).to_bytes(2, "big") + u32(v)
                for v in range(1000, 1000 + 20_000)
            )
            raw.frame(f.SETTINGS, 0, 0, entries)
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_entries_up_to_the_cap_are_fine(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            entries = b"".join(
                (f.HEADER_TABLE_SIZE).to_bytes(2, "big") + u32(4096)
                for _ in range(MAX_SETTINGS_ENTRIES)
            )
            raw.frame(f.SETTINGS, 0, 0, entries)
            raw.unary(1, SERVER_LIVE)
            assert raw.response(1).status == 0

    def test_settings_flood(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            open_streams(raw, 16)
            frame = f.settings_frame({f.INITIAL_WINDOW_SIZE: 70_000})
            raw.send(frame * (MAX_SETTINGS_PER_SECOND * 5))
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_only_the_last_initial_window_applies(self, kiln_server: KilnProcess) -> None:
        # An intermediate value that would overflow an open stream's window is not
        # applied: only the frame's last INITIAL_WINDOW_SIZE counts, once.
        with RawH2(kiln_server.grpc_port) as raw:
            open_streams(raw, 1)
            raw.frame(f.WINDOW_UPDATE, 0, 1, u32(1000))
            entries = b"".join(
                (f.INITIAL_WINDOW_SIZE).to_bytes(2, "big") + u32(v)
                for v in (f.MAX_WINDOW, f.DEFAULT_WINDOW)
            )
            raw.frame(f.SETTINGS, 0, 0, entries)
            raw.data(1, message(b""), end_stream=True)
            assert raw.response(1, timeout=5).status == 0


# ---- 15: HPACK bomb ---------------------------------------------------------------------
class TestHpackBomb:
    def test_large_headers_frame(self, kiln_server: KilnProcess) -> None:
        # one 1 MiB HEADERS frame of one-byte fields: before, a million-field list
        with RawH2(kiln_server.grpc_port) as raw:
            raw.frame(f.HEADERS, f.END_HEADERS, 1, b"\x82" * 2**20)
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_table_reference_bomb(self, kiln_server: KilnProcess) -> None:
        # a 4 KiB table entry referenced by one byte, 100,000 times: 400 MB as decoded
        with RawH2(kiln_server.grpc_port) as raw:
            add = b"\x40" + literal(b"x-big", b"v" * 3900)[1:]  # incremental indexing
            block = add + b"\xbe" * 100_000
            assert len(block) < MAX_HEADER_BLOCK
            raw.frame(f.HEADERS, f.END_HEADERS, 1, block)
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_max_header_list_size_is_advertised(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            raw.unary(1, SERVER_LIVE)
            assert raw.response(1).status == 0
            assert raw.server_settings[f.MAX_HEADER_LIST_SIZE] == MAX_HEADER_LIST

    def test_list_over_the_limit_keeps_the_table_in_step(self) -> None:
        decoder = Decoder(max_list_size=1000)
        big = b"\x40" + literal(b"x-a", b"a" * 600)[1:] + b"\x40" + literal(b"x-b", b"b" * 600)[1:]
        with pytest.raises(HeaderListTooLarge) as info:
            decoder.decode(big)
        assert not info.value.fatal and info.value.size == 3 + 600 + 32 + 3 + 600 + 32
        # both entries were added: the next block's references resolve as the client meant
        assert decoder.table == [(b"x-b", b"b" * 600), (b"x-a", b"a" * 600)]
        assert decoder.decode(b"\xbf") == ((b"x-a", b"a" * 600),)

    def test_huffman_cache_is_bounded(self) -> None:
        decoder = Decoder(max_list_size=2**20)
        for i in range(600):
            value = huffman.encode(b"%d" % i + b"v" * 1000)
            name = literal(b"x-h", b"")[:-1]
            decoder.decode(name + bytes((0x80 | 0x7F,)) + _int_tail(len(value)) + value)
        retained = sum(len(k) + len(v) for k, v in decoder._huffman.items())
        assert retained < 256 * 2**10

    def test_block_cache_is_bounded(self) -> None:
        decoder = Decoder(max_list_size=2**30)
        for i in range(100):
            decoder.decode(bytes((0x82 + i % 10,)) * (5000 + i))  # indexed-only blocks
        retained = sum(len(k) + 8 * len(v) for k, v in decoder._blocks.items())
        assert retained < 256 * 2**10


def _int_tail(value: int) -> bytes:
    """HPACK integer continuation bytes for ``value`` after a full 7-bit prefix."""
    value -= 0x7F
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


# ---- 16: CONTINUATION -------------------------------------------------------------------
class TestContinuation:
    def test_empty_continuation_flood(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            raw.frame(f.HEADERS, 0, 1, encode(request_headers(SERVER_LIVE)))
            raw.send(f.frame(f.CONTINUATION, 0, 1) * 10_000)
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_a_few_empty_continuations_are_fine(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            raw.frame(f.HEADERS, 0, 1, encode(request_headers(SERVER_LIVE)))
            raw.send(f.frame(f.CONTINUATION, 0, 1) * (MAX_EMPTY_FRAGMENTS - 1))
            raw.frame(f.CONTINUATION, f.END_HEADERS, 1, b"")
            raw.data(1, message(b""), end_stream=True)
            assert raw.response(1).status == 0

    def test_unfinished_header_block_times_out(self, quick_server: int) -> None:
        # a slowloris that trickles a header block: closed after the header timeout (1 s
        # here) however it trickles
        with RawH2(quick_server) as raw:
            raw.unary(1, SERVER_LIVE)  # SETTINGS exchanged: nothing else for us to send
            assert raw.response(1).status == 0
            raw.frame(f.HEADERS, 0, 3, encode(request_headers(SERVER_LIVE)))
            try:
                for _ in range(40):
                    raw.frame(f.CONTINUATION, 0, 3, b"\x82")
                    time.sleep(0.25)
            except OSError:
                pass  # closed already
            assert raw.goaway(timeout=5)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(quick_server)


# ---- 17: induced control frames ---------------------------------------------------------
class TestControlFrameFlood:
    def test_ping_flood_from_a_client_that_does_not_read(self, kiln_server: KilnProcess) -> None:
        # Each PING makes the server queue a PING ACK; with nobody reading them they would
        # pile up in its memory without end. Now the connection is dropped.
        with RawH2(kiln_server.grpc_port, rcvbuf=4096) as raw:
            batch = f.frame(f.PING, 0, 0, b"8 bytes!") * 10_000
            try:
                for _ in range(4 * MAX_QUEUED_CONTROL // 1000 + 40):  # ~13 MB of PINGs
                    raw.send(batch)
            except OSError:
                pass  # dropped while we were still sending
            raw.sock.settimeout(30)
            closed = False
            try:
                while raw.sock.recv(1 << 20):
                    pass
                closed = True
            except ConnectionResetError:
                closed = True
            except TimeoutError:
                pass
            assert closed, "the server kept the connection (and its queue) open"
        assert_other_client_served(kiln_server.grpc_port)


# ---- 18: MadeYouReset -------------------------------------------------------------------
PROVOKED = {
    "window-update-0": lambda sid: (
        f.frame(f.HEADERS, f.END_HEADERS, sid, encode(request_headers(SERVER_LIVE)))
        + f.frame(f.WINDOW_UPDATE, 0, sid, u32(0))
    ),
    "malformed-headers": lambda sid: f.frame(
        f.HEADERS,
        f.END_HEADERS,
        sid,
        encode(request_headers(SERVER_LIVE, (b"Upper-Case", b"x"))),
    ),
}


class TestMadeYouReset:
    @pytest.mark.parametrize("case", list(PROVOKED))
    def test_provoked_resets_count_as_resets(self, case: str, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            frames = PROVOKED[case]
            raw.send(b"".join(frames(sid) for sid in range(1, 2 * (MAX_RESETS_PER_SECOND + 50), 2)))
            assert raw.goaway(timeout=10)[1] == f.ENHANCE_YOUR_CALM
        assert_other_client_served(kiln_server.grpc_port)

    def test_reset_stream_keeps_its_slot_until_the_handler_ends(self) -> None:
        limits = Limits(max_concurrent=4)
        with in_process_server(limits=limits) as server, RawH2(server.port) as raw:
            for sid in (1, 3, 5, 7):
                raw.unary(sid, "/t/Stubborn")
            for _ in range(200):  # until each handler runs
                if server.call(lambda: len(server.seen.running)) == 4:
                    break
                time.sleep(0.05)
            for sid in (1, 3, 5, 7):  # now provoke a stream error on each
                raw.frame(f.WINDOW_UPDATE, 0, sid, u32(0))
                assert raw.response(sid).reset == f.PROTOCOL_ERROR
            assert server.call(lambda: len(server.seen.running)) == 4
            raw.unary(9, "/t/Echo", b"x")  # the four handlers still hold the slots
            assert raw.response(9).reset == f.REFUSED_STREAM
            server.call(server.seen.release.set)
            for _ in range(100):
                if not server.call(lambda: len(server.seen.running)):
                    break
                time.sleep(0.05)
            server.call(lambda: None)  # the tasks' done callbacks have run
            raw.unary(11, "/t/Echo", b"x")
            assert raw.response(11).data == message(b"x")


# ---- 19: streams, idle connections, message size -----------------------------------------
def _success_count(client: grpcclient.InferenceServerClient) -> int:
    stats = client.get_inference_statistics("simple", as_json=True)
    return int(stats["model_stats"][0]["inference_stats"]["success"].get("count", 0))


class TestStreamInferInFlight:
    def test_requests_in_flight_on_one_stream_are_bounded(self, quick_server: int) -> None:
        # 3 x the cap on one ModelStreamInfer whose client never reads: before, every one
        # got a task and ran; now the stream stops being read at the cap.
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{quick_server}")
        before = _success_count(client)
        total = 3 * STREAM_MAX_IN_FLIGHT
        with RawH2(quick_server) as raw:
            raw.headers(1, request_headers(STREAM_INFER))
            body = message(infer_body())
            for i in range(0, total, 100):
                raw.data(1, body * min(100, total - i))
            ran, still = -1, 0
            while still < 3:  # until the count settles
                time.sleep(0.5)
                now = _success_count(client) - before
                still = still + 1 if now == ran else 0
                ran = now
            assert 0 < ran < total - STREAM_MAX_IN_FLIGHT // 2
            assert_other_client_served(quick_server)
        client.close()


class TestIdleConnection:
    def test_idle_connection_gets_goaway(self, quick_server: int) -> None:
        with RawH2(quick_server) as raw:
            raw.unary(1, SERVER_LIVE)
            assert raw.response(1).status == 0
            last, code = raw.goaway(timeout=10)  # idle 1 s here
            assert (last, code) == (1, f.NO_ERROR)
            assert raw.read_frame() is None

    def test_preface_only_connection_gets_goaway(self, quick_server: int) -> None:
        with RawH2(quick_server) as raw:
            assert raw.goaway(timeout=10) == (0, f.NO_ERROR)

    def test_a_connection_with_an_open_call_is_not_idle(self, quick_server: int) -> None:
        with RawH2(quick_server) as raw:
            raw.headers(1, request_headers(STREAM_INFER))
            types = []
            with pytest.raises(TimeoutError):  # 3 s: the idle timeout is 1 s
                for ftype, _, _, _ in raw.frames(timeout=3):
                    types.append(ftype)
            assert f.GOAWAY not in types
            raw.data(1, message(infer_body()), end_stream=True)
            response = raw.response(1)
            assert response.status == 0 and response.data
        assert_other_client_served(quick_server)


class TestMessageSizeDefault:
    def test_grpc_default_is_the_http_default(self) -> None:
        from kiln.cli.serve import serve
        from kiln.frontends.grpc.listener import MAX_MESSAGE_BYTES

        defaults = {p.name: p.default for p in serve.params if isinstance(p, click.Option)}
        assert defaults["grpc_max_message_bytes"] == defaults["http_max_input_size"]
        assert defaults["http_max_input_size"] == DEFAULT_MAX_INPUT_BYTES == 64 * 2**20
        assert SecurityOptions().grpc_max_message_bytes == DEFAULT_MAX_INPUT_BYTES
        assert MAX_MESSAGE_BYTES == DEFAULT_MAX_INPUT_BYTES  # grpcio's fallback too

    def test_message_over_64_mib_is_refused(self, kiln_server: KilnProcess) -> None:
        with RawH2(kiln_server.grpc_port) as raw:
            raw.headers(1, request_headers(INFER))
            raw.data(1, b"\0" + u32(DEFAULT_MAX_INPUT_BYTES + 1) + b"partial")
            response = raw.response(1, timeout=5)
            assert response.status == 8  # RESOURCE_EXHAUSTED
            assert str(DEFAULT_MAX_INPUT_BYTES) in response.message
        assert_other_client_served(kiln_server.grpc_port)


class TestUnfinishedRequests:
    """Flow control credits a unary call's bytes as they arrive (one message may be larger
    than every window), so the calls of one connection could hold a message of the largest
    size each: 1,024 streams of 64 MiB. What they hold before their handlers take it is
    bounded at four messages' worth a connection (finding: 40 streams held 640 MiB)."""

    def test_a_connection_holds_at_most_four_messages_worth(
        self, make_server: type[KilnProcess], example_repo: Path
    ) -> None:
        limit = 2**20
        server = make_server(example_repo, args=["--grpc-max-message-bytes", str(limit)]).start()
        part = b"\0" + u32(limit) + b"\0" * (600 * 2**10)  # 60 % of a message
        with RawH2(server.grpc_port) as raw:
            # streams 1 to 11 hold 3.6 MiB of unfinished messages together
            for sid in range(1, 13, 2):
                raw.headers(sid, request_headers(INFER))
                raw.data(sid, part)
            # stream 13 brings the connection past four messages' worth (4 MiB)
            raw.headers(13, request_headers(INFER))
            raw.data(13, part)
            response = raw.response(13, timeout=10)
            assert response.status == 8, response  # RESOURCE_EXHAUSTED
            assert response.message == (
                f"the connection holds more than {4 * limit} bytes of requests not yet "
                "handled (4 x --grpc-max-message-bytes)"
            )
            # what the other streams hold is theirs: one finishes and is answered
            body = infer_body()
            raw.headers(15, request_headers(INFER))
            raw.data(15, message(body), end_stream=True)
            assert raw.response(15, timeout=10).status == 0
        assert_other_client_served(server.grpc_port)
