"""Model repositories in S3 and S3-compatible object storage (``pip install 'kiln[s3]'``).

Triton's URL forms: ``s3://bucket/path`` (AWS's endpoint and the region of the
environment), ``s3://host:port/bucket/path`` (an S3-compatible server over HTTP) and
``s3://https://host:port/bucket/path`` (over HTTPS; ``s3://http://...`` also works).
Credentials come from the environment as boto3 reads them: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, and the region from
``AWS_REGION`` / ``AWS_DEFAULT_REGION``.

A model's objects are fetched into a local cache folder (``KILN_MODEL_CACHE_DIR``, else
Triton's ``TRITON_AWS_MOUNT_DIRECTORY``, else a private temporary folder removed at exit)
and fetched again only when an object's ETag or size changed: a restart with the same
cache folder downloads nothing that is already there. Object keys come from whoever can
write to the bucket: a key with an empty, ``.`` or ``..`` component is refused before
anything is written, so no key can place a file outside the cache folder.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.repository.safety import check_model_name
from kiln.repository.source import Fingerprint, RepositoryError

log = logging.getLogger(__name__)

CACHE_ENV = ("KILN_MODEL_CACHE_DIR", "TRITON_AWS_MOUNT_DIRECTORY")
_MANIFESTS = ".kiln-manifests"  # beside the model folders: (ETag, size) of each cached file

# (size, ETag) of each object of one model, by its path relative to the model folder
Objects = dict[str, tuple[int, str]]


@dataclass(frozen=True, slots=True)
class S3Location:
    endpoint: str | None  # None: AWS's own endpoint for the region
    bucket: str
    prefix: str  # "" or "path/to/repository/"


def parse_url(url: str) -> S3Location:
    if not url.startswith("s3://"):
        raise RepositoryError(f"model repository '{url}': not an s3:// URL")
    rest = url[len("s3://") :]
    endpoint = None
    for scheme in ("http://", "https://"):
        if rest.startswith(scheme):
            host, _, rest = rest[len(scheme) :].partition("/")
            endpoint = scheme + host
            break
    else:
        first, _, tail = rest.partition("/")
        if ":" in first:  # host:port: bucket names have no ':'
            endpoint, rest = "http://" + first, tail
    bucket, _, path = rest.partition("/")
    if endpoint == "http://" or endpoint == "https://" or not bucket:
        raise RepositoryError(
            f"model repository '{url}': expected s3://bucket/path, s3://host:port/bucket/path "
            "or s3://https://host:port/bucket/path"
        )
    path = path.strip("/")
    return S3Location(endpoint, bucket, f"{path}/" if path else "")


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


class S3Source:
    def __init__(self, url: str, cache_dir: Path | None = None) -> None:
        self.url = url
        self.location = parse_url(url)
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise RepositoryError(
                f"model repository '{url}': s3:// repositories need boto3: pip install 'kiln[s3]'"
            ) from None
        loc = self.location
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if loc.endpoint is not None and not region:
            region = "us-east-1"  # S3-compatible servers still need one to sign with
        config = Config(
            connect_timeout=5,
            read_timeout=60,
            retries={"max_attempts": 3, "mode": "standard"},
            # Path-style addressing: an endpoint given as host:port has no per-bucket DNS.
            s3={"addressing_style": "path"} if loc.endpoint else {},
        )
        try:
            session = boto3.session.Session()
            self._client: Any = session.client(
                "s3", endpoint_url=loc.endpoint, region_name=region, config=config
            )
        except Exception as exc:  # a missing AWS_PROFILE, a malformed endpoint ...
            raise RepositoryError(f"model repository '{url}': {_cause(exc, loc)}") from None
        label = hashlib.sha256(url.encode()).hexdigest()[:12]
        self.cache = (cache_dir or cache_root()) / f"s3-{loc.bucket}-{label}"
        self.cache.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.errors = 0
        self.downloads = 0
        self._names: list[str] = []
        self._locks: dict[str, threading.Lock] = {}
        self._locks_guard = threading.Lock()

    # ---- listing ---------------------------------------------------------------------
    def _list(self, prefix: str) -> list[dict[str, Any]]:
        loc = self.location
        found: list[dict[str, Any]] = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=loc.bucket, Prefix=prefix
            )
            for page in pages:
                found.extend(page.get("Contents", []))
        except Exception as exc:
            self.errors += 1
            raise RepositoryError(f"model repository '{self.url}': {_cause(exc, loc)}") from None
        return found

    def _models(self) -> dict[str, Objects]:
        """Every model folder's objects (names that cannot be models are left out)."""
        models: dict[str, Objects] = {}
        for obj in self._list(self.location.prefix):
            rest = obj["Key"][len(self.location.prefix) :]
            name, sep, rel = rest.partition("/")
            if not sep or name.startswith(".") or not name:
                continue  # a file at the repository's top, or a hidden folder
            models.setdefault(name, {})
            if rel and not rel.endswith("/"):  # "folder/" objects mark folders only
                models[name][rel] = (int(obj["Size"]), str(obj.get("ETag", "")))
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
        prefix = f"{self.location.prefix}{name}/"
        objects: Objects = {}
        listed = self._list(prefix)
        if not listed:
            return None
        for obj in listed:
            rel = obj["Key"][len(prefix) :]
            if rel and not rel.endswith("/"):
                try:
                    objects[safe_relative(obj["Key"], rel)] = (int(obj["Size"]), str(obj["ETag"]))
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
                manifest[rel] = self._download(f"{self.location.prefix}{name}/{rel}", target)
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

    def _download(self, key: str, target: Path) -> list[Any]:
        target.parent.mkdir(parents=True, exist_ok=True)
        part = target.with_name(f".{target.name}.kiln-part")
        try:
            response = self._client.get_object(Bucket=self.location.bucket, Key=key)
            with open(part, "wb") as out:
                shutil.copyfileobj(response["Body"], out, 1 << 20)
        except OSError:
            part.unlink(missing_ok=True)
            raise
        except Exception as exc:
            part.unlink(missing_ok=True)
            raise RepositoryError(f"fetching '{key}': {_cause(exc, self.location)}") from None
        os.replace(part, target)
        return [str(response.get("ETag", "")), target.stat().st_size]


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


def _cause(exc: Exception, loc: S3Location) -> str:
    """The reason a request failed, in words a user can act on."""
    from botocore import exceptions as bx

    endpoint = loc.endpoint or "AWS's S3 endpoint"
    if isinstance(exc, bx.NoCredentialsError):
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    if isinstance(exc, bx.ProfileNotFound):
        return f"{exc} (AWS_PROFILE)"
    if isinstance(exc, bx.EndpointConnectionError | bx.ConnectTimeoutError | bx.ConnectionError):
        return f"cannot reach {endpoint}: {exc}"
    if isinstance(exc, bx.ClientError):
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        message = str(error.get("Message", "")) or str(exc)
        if code in ("NoSuchBucket", "404"):
            return f"bucket '{loc.bucket}' does not exist at {endpoint}"
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken"):
            return f"the credentials were refused ({code}): {message}"
        if code in ("AccessDenied", "403", "AllAccessDisabled"):
            return f"access denied to bucket '{loc.bucket}' ({code}): {message}"
        return f"{code}: {message}"
    return f"{type(exc).__name__}: {exc}"
