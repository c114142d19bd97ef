"""The Responses API's stored responses (``store``): kept in memory for
``previous_response_id`` and ``GET /v1/responses/{id}``, in a bounded store (count and
bytes), oldest out first, so a busy server forgets rather than grows."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from kiln.frontends.openai.protocol import OpenAIError

#: the store's bounds: responses kept, and their conversations' JSON bytes in all
MAX_STORED = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


def _not_found(response_id: str, what: str = "Response") -> OpenAIError:
    return OpenAIError(f"{what} with id '{response_id[:100]}' not found.", 404, code="not_found")


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    #: the chat messages the response ended (its instructions left out, as OpenAI's
    #: ``previous_response_id`` does), its answer last
    messages: list[dict[str, Any]]
    size: int


class ResponseStore:
    """Stored responses, least recently used out first past :data:`MAX_STORED` or
    :data:`MAX_STORED_BYTES`. The event loop's only: no lock."""

    def __init__(self, max_count: int = MAX_STORED, max_bytes: int = MAX_STORED_BYTES) -> None:
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._bytes = 0
        self._max_count, self._max_bytes = max_count, max_bytes

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        size = len(orjson.dumps(response)) + len(orjson.dumps(messages))
        old = self._items.pop(response["id"], None)  # a background response, finished
        if old is not None:
            self._bytes -= old.size
        if size > self._max_bytes:
            return  # larger than the whole store: kept nowhere (GET answers 404)
        self._items[response["id"]] = _Stored(response, messages, size)
        self._bytes += size
        while len(self._items) > self._max_count or self._bytes > self._max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= old.size

    def _entry(self, response_id: str) -> _Stored:
        entry = self._items.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        self._items.move_to_end(response_id)
        return entry

    def get(self, response_id: str) -> dict[str, Any]:
        return self._entry(response_id).response

    def conversation(self, response_id: str) -> list[dict[str, Any]]:
        try:
            return list(self._entry(response_id).messages)
        except OpenAIError:
            raise OpenAIError(
                f"Previous response with id '{response_id[:100]}' not found.",
                404,
                param="previous_response_id",
                code="previous_response_not_found",
            ) from None

    def delete(self, response_id: str) -> dict[str, Any]:
        entry = self._items.pop(response_id, None)
        if entry is None:
            raise _not_found(response_id)
        self._bytes -= entry.size
        return {"id": response_id, "object": "response.deleted", "deleted": True}
