"""JSON parsed and encoded a piece at a time, for large bodies on a worker thread.

orjson holds the GIL for a whole ``loads`` or ``dumps`` call, so moving one big call to a
worker thread does not let the event loop run meanwhile: 60 MB of nested ``[0]`` arrays
held it for 4.6 s from a thread, 40 MB of FP32 output 0.2 s. Both directions here split
the work into calls on at most ``WINDOW`` bytes (or ``ENCODE_SLICE`` elements), between
which the interpreter hands the GIL back to the loop (every ``sys.getswitchinterval()``).

:func:`loads` finds where each piece ends with ``re`` (C, one call per piece): a run of
whole array elements or object members, each no deeper than two levels, is parsed by one
``orjson.loads``; a container larger than a window is descended into and built here. The
result, and every error a malformed body gets, is orjson's: each piece is parsed by it.
"""

from __future__ import annotations

import codecs
import re
from typing import Any

import numpy as np
import orjson

from kiln.core.offloop import ENCODE_SLICE as ENCODE_SLICE

#: bytes of JSON text parsed per orjson call (a few milliseconds at worst: nested arrays)
WINDOW = 1 << 16
#: JSON bodies over this are parsed on a worker thread, by :func:`loads`. orjson's worst
#: case (nested one-element arrays) is ~45 ns a byte: 3 ms here, 45 ms at 1 MiB; a thread
#: hop (~50 us) is nothing next to a body this size, and small bodies stay inline.
OFF_LOOP_PARSE_BYTES = WINDOW
# ``ENCODE_SLICE`` (in kiln.core): elements of an output tensor encoded per orjson call
# (~3 ms of FP32 at most)
#: the nesting orjson refuses beyond (its recursion limit)
MAX_DEPTH = 1024

_WS = rb"[ \t\n\r]*+"
_STR = rb'"(?:[^"\\]++|\\.)*+"'
_SCALAR = rb'[^ \t\n\r"\[\]{},:]++'


def _nest(inner: bytes) -> bytes:
    """A value: a string, a scalar, or an array or object of ``inner`` values."""
    array = rb"\[" + _WS + rb"(?:" + inner + _WS + rb"(?:," + _WS + inner + _WS + rb")*+)?+\]"
    member = _STR + _WS + b":" + _WS + inner + _WS
    obj = rb"\{" + _WS + rb"(?:" + member + rb"(?:," + _WS + member + rb")*+)?+\}"
    return rb"(?:" + _STR + b"|" + _SCALAR + b"|" + array + b"|" + obj + b")"


_VALUE = _nest(_nest(rb"(?:" + _STR + b"|" + _SCALAR + b")"))
_ITEMS = re.compile(rb"(?:" + _WS + _VALUE + _WS + b",)*+", re.S)
_LAST_ITEM = re.compile(_WS + _VALUE + _WS + rb"\]", re.S)
_MEMBER = _WS + _STR + _WS + b":" + _WS + _VALUE + _WS
_MEMBERS = re.compile(rb"(?:" + _MEMBER + b",)*+", re.S)
_LAST_MEMBER = re.compile(_MEMBER + rb"\}", re.S)
_SCALAR_RUN = re.compile(_SCALAR)
_CONTROL = re.compile(rb"[\x00-\x1f]")
_SPACE = re.compile(_WS)
# numbers, literals and separators only: a flat numeric array's text (one C loop)
_FLAT = re.compile(rb'[^"\[\]{}]*+')


class _Frame:
    """A container being built: its value, the key it goes under in its parent object,
    and whether a comma has just been read (the next thing must be a value)."""

    __slots__ = ("after_comma", "key", "value")

    def __init__(self, value: list[Any] | dict[str, Any], key: str | None) -> None:
        self.value = value
        self.key = key
        self.after_comma = False


def _bad(pos: int, what: str) -> ValueError:
    return ValueError(f"{what} at byte {pos}")


def _piece(text: bytes, pos: int) -> Any:
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise _bad(pos, f"{exc} (in the piece starting)") from None


def _add(box: list[Any] | dict[str, Any], part: Any) -> None:
    if isinstance(box, list):
        box.extend(part)
    else:
        box.update(part)


def loads(buf: bytes | memoryview, window: int = WINDOW) -> Any:
    """``orjson.loads(buf)``, in calls on at most ``window`` bytes where the text allows
    (one string or number larger than a window is one call: that is a copy, not a build
    of many objects). Raises ``ValueError`` naming the byte where parsing failed."""
    if not isinstance(buf, bytes):
        buf = bytes(buf)  # find() and slices that are bytes
    end = len(buf)
    pos = _SPACE.match(buf, 0).end()  # type: ignore[union-attr]
    if pos >= end or buf[pos] not in b"[{":
        return _piece(buf, 0)  # a lone scalar, or nothing
    stack = [_Frame([] if buf[pos] == 0x5B else {}, None)]
    pos += 1
    while True:
        frame = stack[-1]
        box = frame.value
        limit = min(end, pos + window)
        if isinstance(box, list):
            run, last, brackets = _ITEMS, _LAST_ITEM, b"[]"
        else:
            run, last, brackets = _MEMBERS, _LAST_MEMBER, b"{}"
        if brackets == b"[]":
            flat = _FLAT.match(buf, pos, limit).end()  # type: ignore[union-attr]
            cut = buf.rfind(b",", pos, flat)
            if cut > _SPACE.match(buf, pos).end():  # type: ignore[union-attr]
                # values up to a comma, no string or bracket among them
                _add(box, _piece(b"[" + buf[pos:cut] + b"]", pos))
                pos, frame.after_comma = cut + 1, True
                continue
        m = run.match(buf, pos, limit)
        assert m is not None  # ``*+``: matches, maybe nothing
        if m.end() > pos:  # whole elements, each followed by a comma
            text = brackets[:1] + buf[pos : m.end() - 1] + brackets[1:]
            _add(box, _piece(text, pos))
            pos, frame.after_comma = m.end(), True
            continue
        m = last.match(buf, pos, limit)
        if m is not None:  # the last elements and the container's end
            _add(box, _piece(brackets[:1] + buf[pos : m.end()], pos))
            pos = m.end()
        else:
            pos = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]
            if pos >= end:
                raise _bad(pos, "unexpected end of the JSON text")
            if buf[pos] == brackets[1]:
                if frame.after_comma:
                    raise _bad(pos, "expected a value after ','")
                pos += 1
            elif frame.after_comma or not box:
                # one element larger than a window, or deeper than a run holds
                pos = _element(buf, pos, stack)
                continue
            else:
                raise _bad(pos, "expected ',' or a closing bracket")
        # ``frame`` is complete: it goes into its parent, whose separator comes next
        while True:
            stack.pop()
            if not stack:
                if _SPACE.match(buf, pos).end() != end:  # type: ignore[union-attr]
                    raise _bad(pos, "trailing characters after the JSON value")
                return box
            parent = stack[-1]
            if isinstance(parent.value, list):
                parent.value.append(box)
            else:
                assert frame.key is not None
                parent.value[frame.key] = box
            pos = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]
            closer = 0x5D if isinstance(parent.value, list) else 0x7D
            if pos < end and buf[pos] == 0x2C:
                pos, parent.after_comma = pos + 1, True
                break
            if pos < end and buf[pos] == closer:
                pos += 1
                frame, box = parent, parent.value
                continue
            raise _bad(pos, "expected ',' or a closing bracket")


def _element(buf: bytes, pos: int, stack: list[_Frame]) -> int:
    """One element (an object's: its key, then its value) at ``pos`` that no run held: a
    container is opened on ``stack``; a scalar or string is parsed whole and the separator
    after it read. Returns where parsing goes on."""
    frame = stack[-1]
    key = None
    if isinstance(frame.value, dict):
        if buf[pos] != 0x22:
            raise _bad(pos, "expected a string key")
        stop = _string_end(buf, pos)
        key = _string(buf, pos, stop)
        pos = _SPACE.match(buf, stop).end()  # type: ignore[union-attr]
        if pos >= len(buf) or buf[pos] != 0x3A:
            raise _bad(pos, "expected ':' after an object key")
        pos = _SPACE.match(buf, pos + 1).end()  # type: ignore[union-attr]
    if pos < len(buf) and buf[pos] in b"[{":
        if len(stack) >= MAX_DEPTH:
            raise _bad(pos, f"the JSON text nests deeper than {MAX_DEPTH} levels")
        stack.append(_Frame([] if buf[pos] == 0x5B else {}, key))
        return pos + 1
    if pos >= len(buf):
        raise _bad(pos, "unexpected end of the JSON text")
    if buf[pos] == 0x22:
        stop = _string_end(buf, pos)
        value = _string(buf, pos, stop)
    else:
        m = _SCALAR_RUN.match(buf, pos)
        if m is None:
            raise _bad(pos, "expected a value")
        stop = m.end()
        value = _piece(buf[pos:stop], pos)
    if key is None:
        frame.value.append(value)  # type: ignore[union-attr]
    else:
        frame.value[key] = value
    frame.after_comma = False
    pos = _SPACE.match(buf, stop).end()  # type: ignore[union-attr]
    if pos < len(buf) and buf[pos] == 0x2C:
        frame.after_comma = True
        return pos + 1
    closer = 0x5D if isinstance(frame.value, list) else 0x7D
    if pos < len(buf) and buf[pos] == closer:
        return pos  # the run of the container's last element finds its end
    raise _bad(pos, "expected ',' or a closing bracket")


def _string_end(buf: bytes, pos: int) -> int:
    """Where the string opening at ``pos`` ends (past its closing quote): ``find`` is C's
    memchr; a quote after an odd run of backslashes is escaped."""
    at = pos + 1
    while True:
        at = buf.find(b'"', at)
        if at < 0:
            raise _bad(pos, "unterminated string")
        slashes = at
        while buf[slashes - 1] == 0x5C:
            slashes -= 1
        if (at - slashes) % 2 == 0:
            return at + 1
        at += 1


def _string(buf: bytes, pos: int, stop: int) -> Any:
    """The string ``buf[pos:stop]`` (quotes included): one without escapes or control
    characters is decoded a window at a time; others are one orjson call."""
    if stop - pos <= WINDOW or buf.find(b"\\", pos, stop) >= 0:
        return _piece(buf[pos:stop], pos)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    parts = []
    try:
        for start in range(pos + 1, stop - 1, WINDOW):
            chunk = buf[start : min(start + WINDOW, stop - 1)]
            if _CONTROL.search(chunk) is not None:
                return _piece(buf[pos:stop], pos)  # orjson's error names the character
            parts.append(decoder.decode(chunk))
        parts.append(decoder.decode(b"", final=True))
    except UnicodeDecodeError:
        return _piece(buf[pos:stop], pos)  # orjson's error
    return "".join(parts)


def dumps_array(data: np.ndarray | list[Any], option: int = 0, tolist: bool = False) -> bytes:
    """``orjson.dumps(data, option=option)`` of a flat array (a contiguous 1-D NumPy array,
    or a list), ``ENCODE_SLICE`` elements a call: the same bytes. ``tolist``: a NumPy
    array's elements as Python's (``data.tolist()``: float32 printed as a double), also a
    slice at a time."""
    if len(data) <= ENCODE_SLICE:
        return orjson.dumps(data.tolist() if tolist else data, option=option)  # type: ignore[union-attr]
    parts = [b"["]
    for start in range(0, len(data), ENCODE_SLICE):
        if start:
            parts.append(b",")
        piece = data[start : start + ENCODE_SLICE]
        if tolist:
            piece = piece.tolist()  # type: ignore[union-attr]
        parts.append(orjson.dumps(piece, option=option)[1:-1])
    parts.append(b"]")
    return b"".join(parts)
