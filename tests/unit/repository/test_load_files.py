"""``file:`` contents decode a slice at a time exactly as one strict ``b64decode`` would."""

from __future__ import annotations

import asyncio
import base64
import binascii
import random
import threading
from pathlib import Path

import pytest

from kiln.core.errors import KilnError
from kiln.repository import load_files


def _strict(text: str) -> bytes | None:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def _sliced(text: str) -> bytes | None:
    try:
        return b"".join(load_files._b64decode("m", "1/model.onnx", text))
    except KilnError as exc:
        assert (
            exc.message
            == "failed to load 'm': load parameter 'file:1/model.onnx' is not valid base64"
        )
        return None


@pytest.mark.parametrize("slice_chars", [4, 8, 12, 1 << 18])
def test_slices_decode_as_one_call(monkeypatch: pytest.MonkeyPatch, slice_chars: int) -> None:
    monkeypatch.setattr(load_files, "_B64_SLICE", slice_chars)
    rng = random.Random(slice_chars)
    texts = ["", "QQ==", "QUI=", "QUJD", "QUJDRA", "QQ==QUJD", "QUJD\nRA==", "QU=D", "Q===", "é123"]
    texts += ["QUJDRA==QUJD", "QUJDQUJDQQ==", "QUJDQUJDQUI="]
    for n in range(40):
        texts.append(base64.b64encode(rng.randbytes(n)).decode())
    for text in texts:
        assert _sliced(text) == _strict(text), text


async def test_a_load_cancelled_while_its_files_are_written_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The writing thread cannot be stopped: once it is done, the folder it made for a load
    that went away meanwhile is removed (it may hold a client's large files)."""
    made: list[Path] = []
    entered, release = threading.Event(), threading.Event()
    real = load_files._decode_and_write

    def held(name: str, files: dict[str, str | bytes]) -> Path:
        entered.set()
        assert release.wait(60)
        made.append(real(name, files))
        return made[0]

    monkeypatch.setattr(load_files, "_decode_and_write", held)
    task = asyncio.ensure_future(load_files.materialise("m", {"1/model.onnx": b"x" * 1000}))
    assert await asyncio.to_thread(entered.wait, 60)
    task.cancel()
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3000):  # the removal runs on a worker once the write is done
        if made and not made[0].exists():
            break
        await asyncio.sleep(0.01)
    assert made and not made[0].exists()
