"""``kiln trace summary`` reads files a user names, which may come from anywhere: an entry
of the wrong shape is refused naming the file and the entry. Before, only the top level
was checked: an entry whose ``id`` was a list, a stamp without ``name`` or with a ``ns``
that is not an integer, a version that is not a number, bytes that are not UTF-8 or
nesting past the JSON parser's depth ended in a Python traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kiln.cli import main

HEAD = '{"id": 1, "model_name": "m", "model_version": 1}'


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('[{"id": [1]}]', "entry 0: 'id' must be an integer"),
        (f'[{HEAD}, {{"id": 1, "timestamps": [7]}}]', "entry 1: 'timestamps' must be a list"),
        (f'[{HEAD}, {{"id": 1, "timestamps": [{{"ns": 5}}]}}]', "entry 1: 'timestamps'"),
        (
            f'[{HEAD}, {{"id": 1, "timestamps": [{{"name": "QUEUE_START", "ns": "x"}}]}}]',
            "entry 1: 'timestamps'",
        ),
        (
            f'[{HEAD}, {{"id": 1, "timestamps": [{{"name": "QUEUE_START", "ns": 1e999}}]}}]',
            "entry 1: 'timestamps'",
        ),
        ('[{"id": 1, "model_name": "m", "model_version": "one"}]', "entry 0: 'model_version'"),
        ('[{"id": 1, "model_name": ["m"]}]', "entry 0: 'model_name' must be a string"),
        ("[" * 100_000 + "]" * 100_000, "not JSON (nested too deep)"),
        ('[{"id": 1%s}]' % ("0" * 5000), "not JSON (Exceeds the limit"),
        ('[{"id": 1, "model_version": "%s"}]' % ("9" * 5000), "entry 0: 'model_version'"),
    ],
)
def test_entries_of_the_wrong_shape_are_named(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "trace.json"
    path.write_text(text)
    result = CliRunner().invoke(main, ["trace", "summary", str(path)])
    assert result.exit_code == 1, result.output
    assert f"trace.json: {words}" in result.output or words in result.output
    assert "Traceback" not in result.output and result.exception is not None
    assert isinstance(result.exception, SystemExit)


def test_bytes_that_are_not_utf8_are_named(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_bytes(b"[\xff]")
    result = CliRunner().invoke(main, ["trace", "summary", str(path)])
    assert result.exit_code == 1 and "trace.json: not UTF-8" in result.output
    assert isinstance(result.exception, SystemExit)
