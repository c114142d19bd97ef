"""Model control mode ``poll``: pick up added, changed and removed models while serving.

Every ``--repository-poll-secs`` the repository is scanned (off the event loop) and each
model folder is reduced to a fingerprint: the config file and every file under its
version folders, by path, size and modification time (in a bucket: by key, size and
ETag). A new or changed fingerprint loads the model (new versions come up beside the old
ones, then swap in); a vanished folder unloads it (requests in flight on it complete
first). A bucket that cannot be read changes nothing: the models keep serving as loaded,
and a model whose fetch failed is tried again at the next poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from kiln.core.errors import KilnError, Status
from kiln.repository.manager import RepositoryManager
from kiln.repository.source import Fingerprint, RepositoryError, folder_fingerprint

__all__ = ["RepositoryPoller", "fingerprint", "scan"]

fingerprint = folder_fingerprint  # the older name

log = logging.getLogger(__name__)


def scan(manager: RepositoryManager[Any]) -> dict[str, Fingerprint]:
    return manager.fingerprints()


class RepositoryPoller:
    def __init__(self, manager: RepositoryManager[Any], interval: float) -> None:
        self.manager = manager
        self.interval = interval
        self.seen: dict[str, Fingerprint] = {}
        self._task: asyncio.Task[None] | None = None

    async def snapshot(self) -> None:
        """Remember the repository as it is (call before the initial load)."""
        try:
            self.seen = await asyncio.get_running_loop().run_in_executor(None, scan, self.manager)
        except RepositoryError as exc:  # the first poll that reads it loads what it finds
            log.error("poll: %s", exc)

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kiln-repository-poll")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.poll_once()
            except RepositoryError as exc:  # counted by its source; the models keep serving
                log.error("poll: %s; the models keep serving as loaded", exc)
            except Exception:  # a bad poll must not end polling
                log.exception("repository poll failed")

    async def poll_once(self) -> None:
        current = await asyncio.get_running_loop().run_in_executor(None, scan, self.manager)
        changed = [n for n, fp in current.items() if self.seen.get(n) != fp]
        removed = [n for n in self.seen if n not in current]
        self.seen = current
        for name in removed:
            log.info("poll: model '%s' was removed from the repository", name)
            await self.manager.unload(name)

        async def load(name: str) -> None:
            log.info("poll: model '%s' was added or changed", name)
            try:
                await self.manager.load(name)
            except KilnError as exc:  # the reason shows in the repository index
                log.error("%s", exc.message)
                if exc.status is Status.UNAVAILABLE:  # the bucket could not be read
                    self.seen.pop(name, None)

        await asyncio.gather(*(load(n) for n in changed))
