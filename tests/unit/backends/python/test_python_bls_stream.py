"""The worker's side of decoupled BLS calls (``Channel.stream``), against a scripted server
on a socketpair: parts reach their stream even when another read takes them first."""

from __future__ import annotations

import json
from collections.abc import Iterator
from socket import socketpair

import numpy as np
import pytest

from kiln.backends.python import pb_utils
from kiln.backends.python.arena import Arena
from kiln.backends.python.wire import Wire
from kiln.backends.python.worker_channel import Channel


@pytest.fixture
def pipe() -> Iterator[tuple[Channel, Wire, Arena]]:
    ours, theirs = socketpair()
    arenas = [(Arena.create("kiln-test-in-"), Arena.create("kiln-test-out-"))]
    channel = Channel(Wire(ours), arenas)
    yield channel, Wire(theirs), arenas[0][0]
    for inbound, outbound in arenas:
        inbound.close()
        outbound.close()


def _request() -> pb_utils.InferenceRequest:
    return pb_utils.InferenceRequest(
        model_name="callee",
        inputs=[pb_utils.Tensor("IN", np.array([1, 2], np.int32))],
        requested_output_names=["OUT"],
    )


def test_parts_read_by_a_unary_call_reach_their_stream(
    pipe: tuple[Channel, Wire, Arena],
) -> None:
    channel, server, inbound = pipe
    stream = channel.stream(_request())
    kind, call = server.recv()
    assert kind == "bls" and call["stream"] == 0 and call["model_name"] == "callee"
    # the server answers out of order: a part of the stream, the next batch, then the
    # unary call's answer, then the rest of the stream
    first = inbound.write("OUT", np.array([10], np.int32))
    server.send(("bls_part", 0, [first], None, False, '{"step": 1}'))
    server.send(("execute", [], 0))
    server.send(("bls_result", [], None, '{"source": "unary"}'))
    server.send(("bls_part", 0, None, None, True, None))
    answer = channel.call(_request())
    assert not answer.has_error() and answer.output_tensors() == []
    assert json.loads(answer.parameters()) == {"source": "unary"}  # the callee's
    assert server.recv()[0] == "bls"  # the unary call went out
    got = list(stream)
    assert len(got) == 2
    assert pb_utils.get_output_tensor_by_name(got[0], "OUT").as_numpy().tolist() == [10]
    assert json.loads(got[0].parameters()) == {"step": 1}
    assert got[1].output_tensors() == []  # the FINAL flag alone
    assert got[1].parameters() == "{}"
    assert list(channel.backlog) == [("execute", [], 0)]  # runs after this batch
    assert channel.streams == {}


def test_an_error_part_ends_the_stream_and_drain_reads_what_is_left(
    pipe: tuple[Channel, Wire, Arena],
) -> None:
    channel, server, _ = pipe
    failed = channel.stream(_request())
    left = channel.stream(_request())
    server.recv()
    server.recv()
    server.send(("bls_part", 0, None, ("model 'callee' is not found", 2), True, None))
    server.send(("bls_part", 1, [], None, False, None))
    server.send(("bls_part", 1, None, None, True, None))
    (only,) = list(failed)
    assert only.has_error() and "not found" in only.error().message()
    channel.drain_streams()  # the model never read ``left``: the batch must not end early
    assert channel.streams == {} and list(left) == []
