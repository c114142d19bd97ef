"""Model control mode ``poll``: pick up added, changed and removed models while serving.

Every ``--repository-poll-secs`` the repository is scanned (off the event loop) and each
model folder is reduced to a fingerprint: the config file and every file under its
version folders, by path, size and modification time. A new or changed fingerprint loads
the model (new versions come up beside the old ones, then swap in); a vanished folder
unloads it (requests in flight on it complete first).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path

from kiln.core.errors import KilnError
from kiln.repository.manager import RepositoryManager

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple[str, int, int], ...]


def fingerprint(model_dir: Path) -> Fingerprint:
    """(relative path, size, mtime_ns) of every file that defines the model."""
    entries = []
    for root, dirs, files in os.walk(model_dir):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            path = Path(root) / name
            try:
                st = path.stat()
            except OSError:  # removed while we walk: the next poll sees the result
                continue
            entries.append((str(path.relative_to(model_dir)), st.st_size, st.st_mtime_ns))
    return tuple(entries)


def scan(manager: RepositoryManager) -> dict[str, Fingerprint]:
    result = {}
    for name in manager.model_names():
        try:
            result[name] = fingerprint(manager.model_dir(name))
        except KilnError:
            continue  # an invalid folder name: never loadable, nothing to track
    return result


class RepositoryPoller:
    def __init__(self, manager: RepositoryManager, interval: float) -> None:
        self.manager = manager
        self.interval = interval
        self.seen: dict[str, Fingerprint] = {}
        self._task: asyncio.Task[None] | None = None

    async def snapshot(self) -> None:
        """Remember the repository as it is (call before the initial load)."""
        self.seen = await asyncio.get_running_loop().run_in_executor(None, scan, self.manager)

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

        await asyncio.gather(*(load(n) for n in changed))
