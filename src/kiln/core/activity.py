"""How many inference requests one server is serving right now, across every model.

The ``Server`` owns one ``Activity`` and hands it to every model runtime it builds, which
counts requests in and out and sets it on its backends (``Backend.activity``). A backend
reads it to tell a lone request (nothing else for the event loop to do meanwhile) from a
busy server, e.g. to decide whether busy-polling for a worker's answer may hold the loop
(``loopcall.py``) or a short call may run inline (``Instance.submit``).
"""

from __future__ import annotations


class Activity:
    """The in-flight request count of one server (one per ``Server``, never global)."""

    __slots__ = ("inflight",)

    def __init__(self) -> None:
        self.inflight = 0

    def alone(self) -> bool:
        """Whether the request asking is the only one in flight in this server."""
        return self.inflight <= 1
