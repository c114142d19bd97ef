"""The response cache: outputs of earlier identical requests (Triton's ``--cache-config``).

One cache serves the whole server: ``local`` (an LRU within a byte budget, in this
process: ``local.py``) or ``redis`` (shared by several servers: ``redis.py`` over kiln's
own RESP client, ``resp.py``); a model opts in with ``response_cache { enable: true }``.
``config.py`` parses the flags, ``keys.py`` digests a request into its key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

from kiln.cache.config import CacheConfig
from kiln.core.types import InferOutput

Cached = tuple[list[InferOutput], dict[str, Any]]  # the outputs and the response's parameters


class Cache(Protocol):
    """What a model's runtime needs of the server's response cache, local or shared."""

    #: True when other servers read and write the same entries (Redis): a model's part of
    #: the key is then a fingerprint of its files, the same on every server.
    shared: ClassVar[bool]

    async def open(self) -> None:
        """Before the first model loads: a shared cache that cannot be reached fails here."""

    async def close(self) -> None: ...

    async def get(self, key: bytes) -> Cached | None: ...

    async def put(
        self,
        key: bytes,
        outputs: Sequence[InferOutput],
        owner: int,
        parameters: dict[str, Any] | None,
    ) -> bool: ...

    def drop_owner(self, owner: int) -> int: ...


def open_cache(config: CacheConfig) -> Cache:
    """The server's cache for its ``--cache-config`` (``open()`` it on the loop)."""
    # Imported here: both import this module (``Cached``).
    if config.redis is not None:
        from kiln.cache.redis import RedisResponseCache

        return RedisResponseCache(config.redis)
    from kiln.cache.local import ResponseCache

    return ResponseCache(config.size)
