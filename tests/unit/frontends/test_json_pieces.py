"""``json_pieces``: the same values and the same refusals as one orjson call, however the
text is cut into pieces (tiny windows cut it everywhere)."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import orjson
import pytest

from kiln.frontends import json_pieces

WINDOWS = (1, 5, 64, json_pieces.WINDOW)
_LEAVES: list[Any] = [0, -1.5e10, 3, True, False, None, "a,b", 'q"]}{,:', "\\u00e9", "", 1e300]


def _value(rng: random.Random, depth: int) -> Any:
    r = rng.random()
    if depth > 5 or r < 0.4:
        return rng.choice([*_LEAVES, "ü"])
    if r < 0.7:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    keys = ["k", "a b", 'x"y', "ü", "", ",]"]
    return {rng.choice(keys) + str(i): _value(rng, depth + 1) for i in range(rng.randint(0, 5))}


def _documents(count: int) -> list[bytes]:
    rng = random.Random(7)
    docs = []
    for _ in range(count):
        value = {"root": _value(rng, 0)} if rng.random() < 0.5 else [_value(rng, 0)]
        indent = rng.choice([None, 1, "\t"])
        docs.append(json.dumps(value, indent=indent, ensure_ascii=rng.random() < 0.5).encode())
    return docs


def _corrupt(rng: random.Random, text: bytes) -> bytes:
    b = bytearray(text)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(b) + 1)
        if rng.random() < 0.4 and b:
            del b[min(at, len(b) - 1)]
        else:
            b.insert(at, rng.choice(b',[]{}:"x 0\\'))
    return bytes(b)


@pytest.mark.parametrize("window", WINDOWS)
def test_pieces_parse_as_orjson_does(window: int) -> None:
    for text in _documents(600):
        assert json_pieces.loads(text, window) == orjson.loads(text)


@pytest.mark.parametrize("window", WINDOWS)
def test_malformed_text_is_refused_as_orjson_refuses_it(window: int) -> None:
    rng = random.Random(11)
    refused = 0
    for text in _documents(600):
        bad = _corrupt(rng, text)
        try:
            want: Any = orjson.loads(bad)
        except orjson.JSONDecodeError:
            with pytest.raises(ValueError):
                json_pieces.loads(bad, window)
            refused += 1
        else:
            assert json_pieces.loads(bad, window) == want
    assert refused > 300  # most corruptions break the text


def test_large_values_and_edges() -> None:
    big = "é" * 200_000
    cases = [
        orjson.dumps({"s": big, "n": list(range(100_000)), "e": [], "o": {}}),
        b'  [1, [2, [3, [4, [5]]]], "x"]  ',
        b"17",
        b'"lone"',
        b"[[[[[[[[]]]]]]]]",
    ]
    for text in cases:
        assert json_pieces.loads(text, 64) == orjson.loads(text)
    for bad in (b"", b"[1,]", b"[,1]", b'{"a":1,}', b"[1] 2", b'"\x01' + b"a" * 70_000 + b'"'):
        with pytest.raises(ValueError):
            json_pieces.loads(bad, 64)
    with pytest.raises(ValueError, match="deeper than"):
        json_pieces.loads(b"[" * 2000 + b"]" * 2000, 4)


@pytest.mark.parametrize(
    "data",
    [
        np.arange(100_003, dtype=np.float32) / 7,
        np.arange(70_000, dtype=np.int64) - 35_000,
        np.arange(70_000) % 3 == 0,
        [f"s{i}" for i in range(70_000)],
        np.zeros(0, dtype=np.float32),
    ],
)
def test_dumps_array_writes_orjson_s_bytes(data: Any) -> None:
    option = orjson.OPT_SERIALIZE_NUMPY
    assert json_pieces.dumps_array(data, option) == orjson.dumps(data, option=option)
