"""Model repositories in Azure Blob Storage (``pip install 'kiln[azure]'``).

Triton's URL form: ``as://account/container/path/to/repository``, with the account's key in
``AZURE_STORAGE_KEY`` (Triton's variable; ``AZURE_STORAGE_ACCOUNT`` may name the account
too). ``AZURE_STORAGE_CONNECTION_STRING``, as Azure's own tools read it, takes precedence
and may name another blob endpoint (a sovereign cloud, or the Azurite emulator); without a
key the client tries ``DefaultAzureCredential`` when ``azure-identity`` is installed, else
anonymous access (a public container). Caching: ``object_store.py``.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, BinaryIO

from kiln.repository.object_store import ObjectStoreSource
from kiln.repository.source import RepositoryError


def parse_url(url: str) -> tuple[str, str, str]:
    """(account, container, prefix) of ``as://account/container/path``."""
    if not url.startswith("as://"):
        raise RepositoryError(f"model repository '{url}': not an as:// URL")
    account, _, rest = url[len("as://") :].partition("/")
    container, _, path = rest.partition("/")
    if not account or not container:
        raise RepositoryError(
            f"model repository '{url}': expected as://account_name/container_name/path"
        )
    path = path.strip("/")
    return account, container, f"{path}/" if path else ""


class AzureSource(ObjectStoreSource):
    scheme = "as"

    def __init__(self, url: str, cache_dir: Path | None = None) -> None:
        account, container, prefix = parse_url(url)
        self.account = account
        # the SDK logs every HTTP request at INFO: kiln's log keeps what matters
        logging.getLogger("azure").setLevel(logging.WARNING)
        try:
            from azure.storage.blob import BlobServiceClient
        except ImportError:
            raise RepositoryError(
                f"model repository '{url}': as:// repositories need azure-storage-blob: "
                "pip install 'kiln[azure]'"
            ) from None
        try:
            connection = os.environ.get("AZURE_STORAGE_CONNECTION_STRING")
            if connection:
                service = BlobServiceClient.from_connection_string(connection)
            else:
                service = BlobServiceClient(
                    f"https://{account}.blob.core.windows.net", credential=_credential(account)
                )
        except Exception as exc:  # a malformed connection string or key
            raise RepositoryError(f"model repository '{url}': {_cause(exc, container)}") from None
        if connection and service.account_name and service.account_name != account:
            raise RepositoryError(
                f"model repository '{url}': AZURE_STORAGE_CONNECTION_STRING is for account "
                f"'{service.account_name}', not '{account}'"
            )
        self._container: Any = service.get_container_client(container)
        super().__init__(url, container, prefix, cache_dir)

    def list_objects(self, prefix: str) -> list[tuple[str, int, str]]:
        blobs = self._container.list_blobs(name_starts_with=prefix, timeout=60)
        return [(b.name, int(b.size or 0), str(b.etag or "")) for b in blobs]

    def fetch(self, key: str, out: BinaryIO) -> None:
        self._container.download_blob(key, timeout=60).readinto(out)

    def cause(self, exc: Exception) -> str:
        return _cause(exc, self.bucket)


def _credential(account: str) -> Any:
    key = os.environ.get("AZURE_STORAGE_KEY")
    named = os.environ.get("AZURE_STORAGE_ACCOUNT")
    if key:
        if named and named != account:
            raise ValueError(f"AZURE_STORAGE_ACCOUNT is '{named}', the URL names '{account}'")
        return {"account_name": account, "account_key": key}
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError:
        return None  # anonymous: a public container
    return DefaultAzureCredential()


def _cause(exc: Exception, container: str) -> str:
    from azure.core import exceptions as zx

    if isinstance(exc, zx.ResourceNotFoundError):
        return f"container '{container}' (or a blob in it) does not exist: {exc.reason}"
    if isinstance(exc, zx.ClientAuthenticationError):
        return f"the credentials were refused (AZURE_STORAGE_KEY): {exc.reason}"
    if isinstance(exc, zx.ServiceRequestError):
        return f"cannot reach Azure Blob Storage: {exc}"
    if isinstance(exc, zx.HttpResponseError):
        raw = getattr(exc, "error_code", None)
        code = str(getattr(raw, "value", raw) or "")  # an enum member or a string
        # a wrong key: AuthenticationFailed from Azure, AuthorizationFailure from Azurite
        if code in ("AuthenticationFailed", "AuthorizationFailure") or exc.status_code == 401:
            return f"the credentials were refused (AZURE_STORAGE_KEY): {exc.reason}"
        if code == "ContainerNotFound" or exc.status_code == 404:
            return f"container '{container}' (or a blob in it) does not exist"
        return f"{exc.status_code} {code or exc.reason}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}"
