"""How many inference requests this process is serving right now, across every model.

The model runtimes count requests in and out; a backend reads ``inflight`` to tell a lone
request (nothing else for the event loop to do meanwhile) from a busy server, e.g. to
decide whether busy-polling for a worker's answer may hold the loop (``loopcall.py``).
"""

from __future__ import annotations

inflight = 0


def alone() -> bool:
    """Whether the request asking is the only one in flight in this process."""
    return inflight <= 1
