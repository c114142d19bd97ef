"""The messages of one ModelStreamInfer call on their way to a client
(``frontends.grpc.servicer._Outbox``): bounded, with a high and a low water mark."""

from __future__ import annotations

import asyncio

from kiln.frontends.grpc import grpc_service_pb2 as pb
from kiln.frontends.grpc.servicer import OUTBOX_HIGH, OUTBOX_LOW, _Outbox


def _message(i: int) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(error_message=str(i))


async def test_puts_wait_from_the_high_mark_until_the_low_mark() -> None:
    box = _Outbox()
    for i in range(OUTBOX_HIGH - 1):
        await asyncio.wait_for(box.put(_message(i)), 1)  # room: no wait
    last = asyncio.ensure_future(box.put(_message(OUTBOX_HIGH - 1)))
    await asyncio.sleep(0)
    assert not last.done()  # at the high mark: the request's task waits
    taken = []
    while len(taken) < OUTBOX_HIGH - OUTBOX_LOW - 1:
        taken.append(await box.get())
        await asyncio.sleep(0)
        assert not last.done()  # above the low mark: still waiting, no wake-up per message
    taken.append(await box.get())  # down to the low mark
    await asyncio.wait_for(last, 1)
    box.close()
    while (message := await box.get()) is not None:
        taken.append(message)
    assert [int(m.error_message) for m in taken] == list(range(OUTBOX_HIGH))  # in order


async def test_the_end_goes_in_even_when_full() -> None:
    box = _Outbox()
    waiting = [asyncio.ensure_future(box.put(_message(i))) for i in range(OUTBOX_HIGH + 3)]
    await asyncio.sleep(0)
    box.close()  # the reader of requests ended: never blocks
    got = []
    while (message := await box.get()) is not None:
        got.append(message)
    assert len(got) == OUTBOX_HIGH + 3
    await asyncio.wait_for(asyncio.gather(*waiting), 1)
