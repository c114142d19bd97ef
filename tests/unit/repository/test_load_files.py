"""``file:`` contents decode a slice at a time exactly as one strict ``b64decode`` would."""

from __future__ import annotations

import base64
import binascii
import random

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
        return load_files._b64decode("m", "1/model.onnx", text)
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
