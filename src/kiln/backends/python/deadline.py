"""When a Python-backend batch must be finished: its requests' deadlines and the model's
``execute_timeout_secs``.

A request carries a deadline (``time.monotonic_ns()``, 0 = none) only where the dynamic
batcher's queue policy gives it a timeout that REJECTs (see ``scheduling/dynamic.py``). A
batch must end by the earliest of its requests' deadlines and by ``execute_timeout_secs``
after it started, whichever comes first: a client's short timeout cannot be stretched by
the operator's bound, nor can a request loosen that bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from kiln.backends.base import BackendRequest, RequestOutcome
from kiln.core.errors import KilnError, Status


@dataclass(frozen=True, slots=True)
class BatchDeadline:
    at_ns: int = 0  # time.monotonic_ns() value; 0 = the batch may run forever
    from_request: bool = False  # True: a request's timeout set it, not execute_timeout_secs

    @property
    def seconds(self) -> float | None:
        """As ``WorkerProcess.recv`` takes it (a ``time.monotonic()`` value), or None."""
        return self.at_ns / 1e9 if self.at_ns else None


def batch_deadline(
    request_deadlines: Iterable[int], now_ns: int, execute_timeout_s: float | None
) -> BatchDeadline:
    earliest = min((d for d in request_deadlines if d > 0), default=0)
    bound = now_ns + int(execute_timeout_s * 1e9) if execute_timeout_s else 0
    if earliest and (not bound or earliest <= bound):
        return BatchDeadline(earliest, from_request=True)
    return BatchDeadline(bound, from_request=False)


def expired(deadline_ns: int, now_ns: int) -> bool:
    return 0 < deadline_ns <= now_ns


def fail_expired(
    model: str, requests: list[BackendRequest], outcomes: list[RequestOutcome | None]
) -> None:
    """Each request still to run (its outcome None) whose deadline has passed fails with
    ``not_started``."""
    now = time.monotonic_ns()
    for i, request in enumerate(requests):
        if outcomes[i] is None and expired(request.deadline_ns, now):
            outcomes[i] = not_started(model)


# Triton's text leads each message: clients written for Triton match on it. UNAVAILABLE
# (503), as Triton answers a request whose timeout expired in the queue.


def not_started(model: str) -> KilnError:
    """Its deadline passed before the worker could take it (e.g. it waited for a restart)."""
    return KilnError(
        f"Request timeout expired: model '{model}' could not start executing it before its timeout",
        Status.UNAVAILABLE,
    )


def timed_out(model: str, deadlines: list[int], now_ns: int) -> list[KilnError]:
    """The batch overran a request's deadline: that request fails, and so do its batch
    mates, whose worker was killed under them (they may simply be sent again)."""
    return [
        KilnError(
            f"Request timeout expired: model '{model}' was still executing it when its "
            "timeout passed; the Python worker was killed and is being restarted",
            Status.UNAVAILABLE,
        )
        if expired(deadline, now_ns)
        else KilnError(
            f"model '{model}': the Python worker was killed because another request of the "
            "same batch exceeded its timeout; this request did not complete",
            Status.UNAVAILABLE,
        )
        for deadline in deadlines
    ]
