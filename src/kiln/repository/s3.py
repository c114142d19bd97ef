"""Model repositories in S3 and S3-compatible object storage (``pip install 'kiln[s3]'``).

Triton's URL forms: ``s3://bucket/path`` (AWS's endpoint and the region of the
environment), ``s3://host:port/bucket/path`` (an S3-compatible server over HTTP) and
``s3://https://host:port/bucket/path`` (over HTTPS; ``s3://http://...`` also works).
Credentials come from the environment as boto3 reads them: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_PROFILE``, and the region from
``AWS_REGION`` / ``AWS_DEFAULT_REGION``. Caching: ``object_store.py``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kiln.repository.object_store import ObjectStoreSource
from kiln.repository.source import RepositoryError


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


class S3Source(ObjectStoreSource):
    scheme = "s3"

    def __init__(self, url: str, cache_dir: Path | None = None) -> None:
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
        super().__init__(url, loc.bucket, loc.prefix, cache_dir)

    def list_objects(self, prefix: str) -> list[tuple[str, int, str]]:
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=prefix
        )
        return [
            (obj["Key"], int(obj["Size"]), str(obj.get("ETag", "")))
            for page in pages
            for obj in page.get("Contents", [])
        ]

    def fetch(self, key: str, out: BinaryIO) -> None:
        response = self._client.get_object(Bucket=self.bucket, Key=key)
        shutil.copyfileobj(response["Body"], out, 1 << 20)

    def cause(self, exc: Exception) -> str:
        return _cause(exc, self.location)


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
