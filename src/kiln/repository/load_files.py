"""A load's ``file:<version>/<name>`` parameters: checked, decoded and written.

Every name, the count, the depth and the file/folder layout are checked on the event
loop before anything is decoded or written (that costs microseconds); the base64 decode
and the writes run on a worker thread (``materialise``). The decode goes a slice at a
time: ``binascii`` holds the GIL for a whole call, and 64 MiB of base64 in one call held
the event loop for 0.4 s even from a thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import shutil
import tempfile
from pathlib import Path

from kiln.core.errors import KilnError, Status, invalid_arg

#: Linux's NAME_MAX and PATH_MAX, in bytes: a longer name cannot be written.
NAME_MAX = 255
PATH_MAX = 4096
#: ``file:`` parameters a load may carry (each is a file written to disk).
MAX_LOAD_FILES = 1024
#: Path components of one ``file:`` name (``1/model.onnx`` is 2).
MAX_FILE_DEPTH = 32
#: --max-load-file-bytes' floor: decoded ``file:`` bytes held at once across all loads
DEFAULT_LOAD_FILE_BYTES = 256 << 20
# base64 characters decoded per call (a multiple of 4): ~2 ms each, between which the
# event loop gets the GIL back.
_B64_SLICE = 1 << 18


def check_files(name: str, parameters: dict[str, object]) -> dict[str, str | bytes]:
    """The ``file:`` parameters of a load, by relative path, their names checked; their
    contents (base64 text over HTTP, raw bytes over gRPC) are decoded by ``materialise``."""
    files: dict[str, str | bytes] = {}
    for key, value in parameters.items():
        if not key.startswith("file:"):
            continue
        rel = key[5:]
        _check_file_name(name, key, rel)
        if not isinstance(value, (str, bytes)):
            raise invalid_arg(
                f"failed to load '{name}': load parameter '{key}' must be a base64 string"
            )
        files[rel] = value
    if len(files) > MAX_LOAD_FILES:
        raise invalid_arg(
            f"failed to load '{name}': {len(files)} 'file:' parameters, more than the limit "
            f"of {MAX_LOAD_FILES}"
        )
    _check_layout(name, files)
    return files


def _check_file_name(name: str, key: str, rel: str) -> None:
    if not rel or rel.endswith("/"):
        raise invalid_arg(f"failed to load '{name}': load parameter '{key}' names no file")
    if "\x00" in rel:
        raise invalid_arg(f"failed to load '{name}': load parameter {key!r} holds a NUL character")
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts:
        raise invalid_arg(f"load of '{name}': file path '{rel}' escapes the model folder")
    encoded = [p.encode("utf-8", "surrogateescape") for p in parts]
    if any(len(p) > NAME_MAX for p in encoded) or len(rel.encode("utf-8", "replace")) > PATH_MAX:
        raise invalid_arg(
            f"failed to load '{name}', failed to poll from model repository: the name of "
            f"load parameter '{key[:64]}...' is too long"
        )
    if "" in parts or "." in parts:
        # '1//m' and '1/./m' are '1/m' under another name: two parameters could write one file
        raise invalid_arg(
            f"failed to load '{name}': load parameter '{key[:64]}' has an empty or '.' "
            "path component"
        )
    if len(parts) > MAX_FILE_DEPTH:
        raise invalid_arg(
            f"failed to load '{name}': load parameter '{key[:64]}...' is {len(parts)} folders "
            f"deep, more than the limit of {MAX_FILE_DEPTH}"
        )


def _check_layout(name: str, files: dict[str, str | bytes]) -> None:
    """No name is also a folder of another (``1/a`` and ``1/a/b``): one of them could not
    be written, and the other would already be on disk."""
    folders = {"/".join(rel.split("/")[:i]) for rel in files for i in range(1, rel.count("/") + 1)}
    for rel in files:
        if rel in folders:
            raise invalid_arg(
                f"failed to load '{name}': load parameter 'file:{rel[:64]}' names a file "
                "that other 'file:' parameters use as a folder"
            )


def _b64decode(name: str, rel: str, text: str) -> list[bytes]:
    """``base64.b64decode(text, validate=True)``, a slice at a time, kept as the slices
    (joining 48 MiB would be one more stretch that holds the GIL)."""
    pieces = []
    try:
        if len(text) % 4:
            raise ValueError("length is not a multiple of 4")
        for start in range(0, len(text), _B64_SLICE):
            piece = text[start : start + _B64_SLICE]
            if "=" in piece and start + _B64_SLICE < len(text):
                raise ValueError("padding before the end")
            pieces.append(base64.b64decode(piece, validate=True))
    except (binascii.Error, ValueError):
        raise invalid_arg(
            f"failed to load '{name}': load parameter 'file:{rel}' is not valid base64"
        ) from None
    return pieces


def _decode_and_write(name: str, files: dict[str, str | bytes]) -> Path:
    """Every content decoded first (a bad one is a 400 before anything is written), then
    written to a private temp folder, which is removed if anything fails."""
    raw = {
        rel: [v] if isinstance(v, bytes) else _b64decode(name, rel, v) for rel, v in files.items()
    }
    root = Path(tempfile.mkdtemp(prefix=f"kiln-{name}-"))
    try:
        for rel, content in raw.items():
            target = (root / rel).resolve()
            if not target.is_relative_to(root) or rel.startswith("/"):
                raise invalid_arg(f"load of '{name}': file path '{rel}' escapes the model folder")
            target.parent.mkdir(parents=True, exist_ok=True)
            with target.open("wb") as out:
                out.writelines(content)
    except OSError as exc:
        shutil.rmtree(root, ignore_errors=True)
        # Triton's words for a model folder it cannot build; no private path in them.
        raise invalid_arg(
            f"failed to load '{name}', failed to poll from model repository: "
            f"cannot write the 'file:' parameters ({exc.strerror})"
        ) from None
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    return root


def decoded_size(files: dict[str, str | bytes]) -> int:
    """The bytes ``files`` hold once decoded (base64: at most 3 for each 4 characters)."""
    return sum(len(v) if isinstance(v, bytes) else len(v) // 4 * 3 for v in files.values())


class FileBudget:
    """The decoded bytes of ``file:`` parameters being decoded and written at once, across
    every load (--max-load-file-bytes; 0: no limit). Each load's contents are bounded by
    the request size limits, but concurrent loads are not: each holds its decoded bytes
    until they are on disk. A load that would pass the limit is refused at once, before
    anything is decoded: waiting would keep its body in memory too."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    def reserve(self, name: str, size: int) -> None:
        if not self.limit:
            self.held += size
            return
        if size > self.limit:
            raise KilnError(
                f"failed to load '{name}': its 'file:' parameters hold {size} bytes once "
                f"decoded, more than the limit of {self.limit} bytes (--max-load-file-bytes)",
                Status.PAYLOAD_TOO_LARGE,
            )
        if self.held + size > self.limit:
            raise KilnError(
                f"failed to load '{name}': its 'file:' parameters hold {size} bytes once "
                f"decoded and other loads are writing {self.held} bytes; together more than "
                f"the limit of {self.limit} bytes (--max-load-file-bytes). Try again later",
                Status.UNAVAILABLE,
            )
        self.held += size

    def release(self, size: int) -> None:
        self.held -= size


async def materialise(
    name: str, files: dict[str, str | bytes], budget: FileBudget | None = None
) -> Path:
    """The private folder holding ``files`` (from ``check_files``), built on a worker
    thread, its decoded bytes counted in ``budget`` until the thread is done. A load
    cancelled meanwhile removes the folder once the thread is done."""
    loop = asyncio.get_running_loop()
    size = decoded_size(files)
    if budget is not None:
        budget.reserve(name, size)  # refused here: nothing decoded yet
    work = loop.run_in_executor(None, _decode_and_write, name, files)
    if budget is not None:
        work.add_done_callback(lambda _: budget.release(size))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:

        def remove(done: asyncio.Future[Path]) -> None:
            if not done.cancelled() and done.exception() is None:
                loop.run_in_executor(None, shutil.rmtree, done.result(), True)

        work.add_done_callback(remove)
        raise
