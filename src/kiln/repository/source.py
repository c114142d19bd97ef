"""Where a model repository's files come from: a local folder, or a bucket in object storage.

``RepositoryManager`` and the poller see every repository through this one interface:
list the model names, fingerprint each model (poll mode), and ``locate`` a model as a
local folder. A local source hands out its own folder; a remote source (``s3.py``)
fetches the model's objects into a local cache first. Methods of a remote source do
network I/O: call them off the event loop.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

from kiln.core.errors import invalid_arg
from kiln.repository.safety import check_model_name

# (path relative to the model folder, size, mtime_ns for a file or ETag for an object)
Fingerprint = tuple[tuple[str, int, int | str], ...]


class RepositoryError(Exception):
    """A repository that cannot be read: the message names its URL and the cause."""


class RepositorySource(Protocol):
    url: str  # as given to --model-repository, for messages and metric labels
    errors: int  # failed reads of the repository (listings, fetches), for metrics
    downloads: int  # objects fetched into the local cache (0 for a local folder)

    def refresh(self) -> None:
        """Read the list of models again (raises ``RepositoryError``)."""

    def model_names(self) -> list[str]:
        """The model folders found by the last ``refresh`` (a local folder: now)."""
        ...

    def fingerprints(self) -> dict[str, Fingerprint]:
        """Every model's fingerprint, read now (raises ``RepositoryError``)."""
        ...

    def locate(self, name: str) -> Path | None:
        """The local folder holding model ``name``'s files, fetched first where they are
        remote; ``None`` when this repository has no such model."""
        ...


class LocalSource:
    """A model repository folder on this machine."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path).resolve()
        self.url = str(path)
        self.errors = 0
        self.downloads = 0

    def refresh(self) -> None:
        pass  # read at each call

    def model_names(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(
            p.name for p in self.path.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    def fingerprints(self) -> dict[str, Fingerprint]:
        result = {}
        for name in self.model_names():
            try:
                folder = self.locate(name)
            except Exception:  # an invalid name or a link out: never loadable, not tracked
                continue
            if folder is not None:
                result[name] = folder_fingerprint(folder)
        return result

    def locate(self, name: str) -> Path | None:
        check_model_name(name)
        candidate = self.path / name
        if not candidate.is_dir():
            return None
        # a symlinked model folder must still resolve inside its repository
        if not candidate.resolve().is_relative_to(self.path):
            raise invalid_arg(f"model '{name}' resolves outside the model repository")
        return candidate


def folder_fingerprint(model_dir: Path) -> Fingerprint:
    """(relative path, size, mtime_ns) of every file that defines the model."""
    entries: list[tuple[str, int, int | str]] = []
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


def open_source(text: str) -> RepositorySource:
    """``--model-repository``'s value as a source: a folder, ``s3://``, ``gs://`` or
    ``as://...`` (Triton's URL forms).

    Raises ``RepositoryError`` for a URL kiln cannot serve (the message says why)."""
    scheme, sep, _ = text.partition("://")
    if not sep:
        return LocalSource(Path(text))
    if scheme == "s3":
        from kiln.repository.s3 import S3Source

        return S3Source(text)
    if scheme == "gs":
        from kiln.repository.gcs import GCSSource

        return GCSSource(text)
    if scheme == "as":
        from kiln.repository.azure import AzureSource

        return AzureSource(text)
    raise RepositoryError(
        f"model repository '{text}': unknown scheme '{scheme}://' (a folder, s3://, gs:// or as://)"
    )
