"""What every object-storage repository shares (``s3://``, ``gs://``, ``as://``): the models
of a bucket prefix, their fingerprints for poll mode, and a local cache that fetches an
object again only when its ETag or size changed.

A model's objects are fetched into a local cache folder (``KILN_MODEL_CACHE_DIR``, else
Triton's ``TRITON_AWS_MOUNT_DIRECTORY``, else a private temporary folder removed at exit):
a restart with the same cache folder downloads nothing that is already there. Object keys
come from whoever can write to the bucket: a key with an empty, ``.`` or ``..`` component
is refused before anything is written, so no key can place a file outside the cache folder.
A service (``s3.py``, ``gcs.py``, ``azure.py``) lists objects, fetches one into an open
file, and words its client's exceptions.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO

from kiln.repository.safety import check_model_name
from kiln.repository.source import Fingerprint, RepositoryError

log = logging.getLogger(__name__)

CACHE_ENV = ("KILN_MODEL_CACHE_DIR", "TRITON_AWS_MOUNT_DIRECTORY")
_MANIFESTS = ".kiln-manifests"  # beside the model folders: (ETag, size) of each cached file

# (size, ETag) of each object of one model, by its path relative to the model folder
Objects = dict[str, tuple[int, str]]


def safe_relative(key: str, rel: str) -> str:
    """``rel`` (a key below a model's prefix) if it is a plain relative path, else raise."""
    parts = rel.split("/")
    if "\x00" in rel or any(p in ("", ".", "..") for p in parts):
        raise RepositoryError(
            f"object key '{key}' is not a plain relative path (an empty, '.' or '..' "
            "component, or an absolute path): refused, nothing of it is written"
        )
    return rel


def cache_root() -> Path:
    for var in CACHE_ENV:
        value = os.environ.get(var)
        if value:
            path = Path(value)
            path.mkdir(parents=True, exist_ok=True)
            return path.resolve()
    path = Path(tempfile.mkdtemp(prefix="kiln-model-cache-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path.resolve()


class ObjectStoreSource:
    """A repository under ``prefix`` in one bucket; subclasses talk to the service."""

    #: the cache folder's prefix ("s3", "gs", "as")
    scheme = ""

    def __init__(self, url: str, bucket: str, prefix: str, cache_dir: Path | None) -> None:
        self.url = url
        self.bucket = bucket
        self.prefix = prefix  # "" or "path/to/repository/"
        label = hashlib.sha256(url.encode()).hexdigest()[:12]
        self.cache = (cache_dir or cache_root()) / f"{self.scheme}-{bucket}-{label}"
        self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.errors = 0
        self.downloads = 0
        self._names: list[str] = []
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ---- what a service provides ------------------------------------------------------
    def list_objects(self, prefix: str) -> list[tuple[str, int, str]]:
        """(key, size, ETag) of every object whose key starts with ``prefix``."""
        raise NotImplementedError

    def fetch(self, key: str, out: BinaryIO) -> None:
        """Write object ``key`` into ``out``."""
        raise NotImplementedError

    def cause(self, exc: Exception) -> str:
        """Why a request failed, in words a user can act on."""
        return f"{type(exc).__name__}: {exc}"

    # ---- listing ---------------------------------------------------------------------
    def _list(self, prefix: str) -> list[tuple[str, int, str]]:
        try:
            return self.list_objects(prefix)
        except Exception as exc:
            self.errors += 1
            raise RepositoryError(f"model repository '{self.url}': {self.cause(exc)}") from None

    def _models(self) -> dict[str, Objects]:
        """Every model folder's objects (names that cannot be models are left out)."""
        models: dict[str, Objects] = {}
        for key, size, etag in self._list(self.prefix):
            rest = key[len(self.prefix) :]
            name, sep, rel = rest.partition("/")
            if not sep or name.startswith(".") or not name:
                continue  # a file at the repository's top, or a hidden folder
            models.setdefault(name, {})
            if rel and not rel.endswith("/"):  # "folder/" objects mark folders only
                models[name][rel] = (size, etag)
        return models

    def refresh(self) -> None:
        self._names = sorted(self._models())

    def model_names(self) -> list[str]:
        return list(self._names)

    def fingerprints(self) -> dict[str, Fingerprint]:
        models = self._models()
        self._names = sorted(models)
        result: dict[str, Fingerprint] = {}
        for name, objects in models.items():
            try:
                check_model_name(name)
            except Exception:
                continue
            result[name] = tuple((rel, size, etag) for rel, (size, etag) in sorted(objects.items()))
        return result

    # ---- fetching --------------------------------------------------------------------
    def locate(self, name: str) -> Path | None:
        check_model_name(name)
        prefix = f"{self.prefix}{name}/"
        objects: Objects = {}
        listed = self._list(prefix)
        if not listed:
            return None
        for key, size, etag in listed:
            rel = key[len(prefix) :]
            if rel and not rel.endswith("/"):
                try:
                    objects[safe_relative(key, rel)] = (size, etag)
                except RepositoryError as exc:
                    self.errors += 1
                    raise RepositoryError(
                        f"model repository '{self.url}', model '{name}': {exc}"
                    ) from None
        if name not in self._names:
            self._names = sorted({*self._names, name})
        with self._lock(name):
            return self._sync(name, objects)

    def _lock(self, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault(name, threading.Lock())

    def _sync(self, name: str, objects: Objects) -> Path:
        """Make ``cache/name`` hold exactly ``objects``, downloading only what changed."""
        folder = self.cache / name
        folder.mkdir(exist_ok=True)
        root = folder.resolve()
        manifest_path = self.cache / _MANIFESTS / f"{name}.json"
        manifest = _read_manifest(manifest_path)
        fetched = 0
        try:
            for rel, (size, etag) in sorted(objects.items()):
                target = folder / rel
                if not target.resolve().is_relative_to(root):  # a link planted in the cache
                    raise RepositoryError(f"'{rel}' resolves outside the cache folder")
                cached = manifest.get(rel)
                if cached == [etag, size] and target.is_file() and target.stat().st_size == size:
                    continue
                self._download(f"{self.prefix}{name}/{rel}", target)
                # the listed ETag: an object replaced between listing and fetch is listed
                # with another ETag at the next look, and fetched again then
                manifest[rel] = [etag, target.stat().st_size]
                fetched += 1
        except RepositoryError as exc:
            self.errors += 1
            raise RepositoryError(f"model repository '{self.url}', model '{name}': {exc}") from None
        except OSError as exc:
            self.errors += 1
            raise RepositoryError(
                f"model repository '{self.url}', model '{name}': cannot write the local cache "
                f"{self.cache}: {exc}"
            ) from None
        finally:
            _write_manifest(manifest_path, {k: v for k, v in manifest.items() if k in objects})
        _prune(folder, set(objects))
        self.downloads += fetched
        log.info(
            "model '%s' from %s: %d file(s) fetched, %d from the local cache %s",
            name,
            self.url,
            fetched,
            len(objects) - fetched,
            folder,
        )
        return folder

    def _download(self, key: str, target: Path) -> None:
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}.kiln-part")
        try:
            with open(part, "wb") as out:
                self.fetch(key, out)
        except OSError:
            part.unlink(missing_ok=True)
            raise
        except Exception as exc:
            part.unlink(missing_ok=True)
            raise RepositoryError(f"fetching '{key}': {self.cause(exc)}") from None
        os.replace(part, target)


def _read_manifest(path: Path) -> dict[str, list[Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_manifest(path: Path, manifest: dict[str, list[Any]]) -> None:
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, sort_keys=True))
    os.replace(tmp, path)


def _prune(folder: Path, keep: set[str]) -> None:
    """Remove cached files (and folders) whose objects left the bucket: a deleted version
    folder must not stay loadable from the cache."""
    keep_dirs = {str(Path(rel).parent) for rel in keep}
    keep_dirs |= {str(p) for rel in keep for p in Path(rel).parents}
    for dirpath, dirnames, filenames in os.walk(folder, topdown=False):
        base = Path(dirpath)
        for fname in filenames:
            path = base / fname
            if str(path.relative_to(folder)) not in keep:
                path.unlink(missing_ok=True)
        for dname in dirnames:
            path = base / dname
            if path.is_symlink():
                path.unlink()
            elif str(path.relative_to(folder)) not in keep_dirs:
                shutil.rmtree(path, ignore_errors=True)
