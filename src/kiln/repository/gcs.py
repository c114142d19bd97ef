"""Model repositories in Google Cloud Storage (``pip install 'kiln[gcs]'``).

Triton's URL form: ``gs://bucket/path/to/repository``. Credentials as Google's client
library finds them: ``GOOGLE_APPLICATION_CREDENTIALS`` (a service-account key file), the
metadata server on GCP, or ``gcloud``'s application-default login. ``STORAGE_EMULATOR_HOST``
(``http://host:port``) points the client at an emulator or a GCS-compatible server, with
anonymous credentials. Caching: ``object_store.py``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, BinaryIO

from kiln.repository.object_store import ObjectStoreSource
from kiln.repository.source import RepositoryError


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix) of ``gs://bucket/path``; the prefix is "" or ends with "/"."""
    if not url.startswith("gs://"):
        raise RepositoryError(f"model repository '{url}': not a gs:// URL")
    bucket, _, path = url[len("gs://") :].partition("/")
    if not bucket or ":" in bucket:
        raise RepositoryError(f"model repository '{url}': expected gs://bucket/path")
    path = path.strip("/")
    return bucket, f"{path}/" if path else ""


class GCSSource(ObjectStoreSource):
    scheme = "gs"

    def __init__(self, url: str, cache_dir: Path | None = None) -> None:
        bucket, prefix = parse_url(url)
        try:
            with warnings.catch_warnings():  # google-auth's notices about grpcio/Python
                warnings.simplefilter("ignore", FutureWarning)
                import google.cloud.storage as storage
        except ImportError:
            raise RepositoryError(
                f"model repository '{url}': gs:// repositories need google-cloud-storage: "
                "pip install 'kiln[gcs]'"
            ) from None
        try:
            if os.environ.get("STORAGE_EMULATOR_HOST"):
                from google.auth.credentials import AnonymousCredentials

                client = storage.Client(project="kiln", credentials=AnonymousCredentials())  # type: ignore[no-untyped-call]
            else:
                client = storage.Client()
        except Exception as exc:  # no credentials found, a malformed key file ...
            raise RepositoryError(f"model repository '{url}': {_cause(exc, bucket)}") from None
        from google.cloud.storage.retry import DEFAULT_RETRY

        self._client: Any = client
        self._bucket: Any = client.bucket(bucket)
        # the library retries for 120 s by default: a store that is down fails sooner
        self._retry = DEFAULT_RETRY.with_timeout(20.0)
        super().__init__(url, bucket, prefix, cache_dir)

    def list_objects(self, prefix: str) -> list[tuple[str, int, str]]:
        blobs = self._client.list_blobs(self._bucket, prefix=prefix, timeout=60, retry=self._retry)
        return [(b.name, int(b.size or 0), str(b.etag or b.generation or "")) for b in blobs]

    def fetch(self, key: str, out: BinaryIO) -> None:
        self._bucket.blob(key).download_to_file(out, timeout=60, retry=self._retry)

    def cause(self, exc: Exception) -> str:
        return _cause(exc, self.bucket)


def _cause(exc: Exception, bucket: str) -> str:
    from google.api_core import exceptions as gx
    from google.auth import exceptions as ax

    if isinstance(exc, gx.RetryError) and exc.cause is not None:
        exc = exc.cause  # the last attempt's error says what is wrong
    if isinstance(exc, ax.DefaultCredentialsError):
        return (
            "no credentials: set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file "
            f"({exc})"
        )
    if isinstance(exc, gx.NotFound):
        return f"bucket '{bucket}' (or an object in it) does not exist: {exc.message}"
    if isinstance(exc, gx.Forbidden | gx.Unauthorized):
        return f"access denied to bucket '{bucket}': {exc.message}"
    if isinstance(exc, gx.GoogleAPICallError):
        return f"{exc.code}: {exc.message}"
    name = type(exc).__name__
    if "Connection" in name or "Timeout" in name:
        where = os.environ.get("STORAGE_EMULATOR_HOST") or "Google Cloud Storage"
        return f"cannot reach {where}: {exc}"
    return f"{name}: {exc}"
