"""The worker's message framing (``kiln.backends.python.wire``): messages that arrive
together, in pieces, larger than the buffer; a closed peer; ``poll`` timeouts."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import time

import pytest

from kiln.backends.python.wire import Wire


@pytest.fixture
def pair() -> tuple[Wire, Wire]:
    a, b = socket.socketpair()
    return Wire(a), Wire(b)


def test_messages_round_trip_in_order(pair: tuple[Wire, Wire]) -> None:
    left, right = pair
    sent = [("execute", [{"inputs": [("INPUT0", "<f4", (1, 4), 0, 16)]}]), ("finalize",), None]
    for message in sent:
        left.send(message)
    # all three are in the socket: one read takes them, and recv hands them out one by one
    assert [right.recv() for _ in sent] == sent
    right.send(("executed", [], None))
    assert left.recv() == ("executed", [], None)


def test_a_message_larger_than_the_buffer_arrives_whole(pair: tuple[Wire, Wire]) -> None:
    left, right = pair
    big = ("bls", {"parameters": "x" * (3 << 16)})  # ~200 KB against a 64 KB buffer
    writer = threading.Thread(target=left.send, args=(big,))
    writer.start()
    assert right.recv() == big
    writer.join()
    left.send(("small",))
    assert right.recv() == ("small",)


def test_a_message_sent_in_pieces_is_put_back_together(pair: tuple[Wire, Wire]) -> None:
    left, right = pair
    payload = pickle.dumps(("response", 3, [], None, True, False))
    frame = struct.pack("!I", len(payload)) + payload
    received: list[object] = []
    reader = threading.Thread(target=lambda: received.append(right.recv()))
    reader.start()
    for i in range(len(frame)):  # a byte at a time: header split too
        left.sock.send(frame[i : i + 1])
        time.sleep(0.001)
    reader.join(5)
    assert received == [("response", 3, [], None, True, False)]


def test_a_closed_peer_reads_as_eof(pair: tuple[Wire, Wire]) -> None:
    left, right = pair
    left.send(("last",))
    left.close()
    assert right.recv() == ("last",)  # what was sent before the close still arrives
    with pytest.raises(EOFError):
        right.recv()


def test_poll_times_out_then_sees_a_message(pair: tuple[Wire, Wire]) -> None:
    left, right = pair
    assert right.poll(0.01) is False
    left.send(("hello",))
    assert right.poll(1.0) is True
    assert right.recv() == ("hello",)
    left.send(("a",))
    left.send(("b",))
    assert right.recv() == ("a",)
    assert right.poll(0) is True  # the second is already buffered: no system call needed
    assert right.recv() == ("b",)
