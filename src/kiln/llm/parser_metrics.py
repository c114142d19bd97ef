"""vLLM's ``vllm:tool_call_parser_invocations_total``: the runs of a model's
``--tool-call-parser`` over its answers, by ``mode`` (``streaming``, ``non_streaming``),
``outcome`` (``tool_call``, ``no_tool_call``) and ``request_type`` (``chat_completions``,
``responses``, ``other``). As in vLLM, an answer read whole counts once per choice; a
streamed one once per delta the parser reads (``tool_call`` when that delta carries
calls). Only ``tool_choice: auto`` runs the parser (``required`` and a named function are
read by their grammar, as in vLLM)."""

from __future__ import annotations

import threading
from itertools import product

MODES = ("streaming", "non_streaming")
OUTCOMES = ("tool_call", "no_tool_call")
REQUEST_TYPES = ("chat_completions", "responses", "other")
#: kiln's API names (``chat_setup``'s ``api``) -> vLLM's request type
_API_TYPES = {"Chat Completions": "chat_completions", "Responses": "responses"}


def request_type(api: str) -> str:
    """vLLM's ``request_type`` label of an API kiln names ``api`` in its messages."""
    return _API_TYPES.get(api, "other")


class ToolParserInvocations:
    """One model's counts, every label combination present from the start (vLLM creates
    them all when it starts). The event loop counts; a scrape reads a copy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(product(MODES, OUTCOMES, REQUEST_TYPES), 0)

    def record(self, kind: str, streaming: bool, called: bool) -> None:
        key = ("streaming" if streaming else "non_streaming",
               "tool_call" if called else "no_tool_call", kind)  # fmt: skip
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1

    def counts(self) -> dict[tuple[str, str, str], int]:
        """(mode, outcome, request_type) -> count."""
        with self._lock:
            return dict(self._counts)
