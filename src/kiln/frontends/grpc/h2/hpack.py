"""HPACK (RFC 7541): a complete decoder and the small encoder a gRPC server needs.

The decoder keeps the dynamic table the client's encoder builds. After the first request
on a connection a gRPC client sends every field as a one-byte index into that table, and
the same block for every call to one method: a block made only of indexed fields (which
leave the table as it is) is decoded once and remembered until the table changes.
Huffman-coded literals (the first request's strings) are decoded once and remembered too.

The encoder sends every field as a literal without indexing, with a static-table name
where there is one: the server never adds to the client's decoder table, so nothing the
client sets about its table size concerns it, and header blocks can be built once.
"""

from __future__ import annotations

from kiln.frontends.grpc.h2 import huffman

Header = tuple[bytes, bytes]

STATIC_TABLE: tuple[Header, ...] = tuple(
    (name.encode(), value.encode())
    for name, value in (
        (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
        (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"),
        (":status", "200"), (":status", "204"), (":status", "206"), (":status", "304"),
        (":status", "400"), (":status", "404"), (":status", "500"), ("accept-charset", ""),
        ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""),
        ("accept", ""), ("access-control-allow-origin", ""), ("age", ""), ("allow", ""),
        ("authorization", ""), ("cache-control", ""), ("content-disposition", ""),
        ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
        ("content-location", ""), ("content-range", ""), ("content-type", ""),
        ("cookie", ""), ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""),
        ("from", ""), ("host", ""), ("if-match", ""), ("if-modified-since", ""),
        ("if-none-match", ""), ("if-range", ""), ("if-unmodified-since", ""),
        ("last-modified", ""), ("link", ""), ("location", ""), ("max-forwards", ""),
        ("proxy-authenticate", ""), ("proxy-authorization", ""), ("range", ""),
        ("referer", ""), ("refresh", ""), ("retry-after", ""), ("server", ""),
        ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
        ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
    )
)  # fmt: skip
STATIC_NAMES: dict[bytes, int] = {}
for _i, (_name, _) in enumerate(STATIC_TABLE, 1):
    STATIC_NAMES.setdefault(_name, _i)

ENTRY_OVERHEAD = 32  # §4.1
# Integers are refused beyond 5 continuation bytes (35 bits): no length or index needs
# more, and a decoder must not loop on however many continuation bytes a peer sends.
_MAX_INT_SHIFT = 28
# The caches keep what a client repeats (paths, content types, a method's block), all
# short: longer strings and blocks are not kept, so what a connection retains is bounded
# (entries x size) whatever a client sends.
_HUFFMAN_CACHE_SIZE = 512
_HUFFMAN_CACHE_MAX_STRING = 128
_BLOCK_CACHE_SIZE = 64
_BLOCK_CACHE_MAX_BLOCK = 256
# Past this multiple of the list limit decoding stops (the connection must then close):
# a block of one-byte references to a large table entry would otherwise decode into a
# list far larger than the block.
_FATAL_LIST_FACTOR = 4


class HpackError(ValueError):
    """A malformed header block: a COMPRESSION_ERROR for the whole connection."""


class HeaderListTooLarge(HpackError):
    """The decoded list exceeds ``max_list_size`` (name + value + 32 a field, RFC 9113
    §6.5.2). ``fatal``: decoding stopped part-way (the table may be out of step, so the
    connection must end); otherwise the whole block was decoded and only the request
    is refused."""

    def __init__(self, size: int, limit: int, fatal: bool) -> None:
        more = " or more" if fatal else ""
        super().__init__(f"header list of {size} bytes{more} exceeds the limit of {limit}")
        self.size = size
        self.fatal = fatal


def _drop(field: Header) -> None:
    """Where fields go once the list is over its limit."""


def decode_int(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """(value, next position) of the integer whose prefix is in ``data[pos]`` (§5.1)."""
    mask = (1 << prefix_bits) - 1
    value = data[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    end = len(data)
    while True:
        if pos >= end:
            raise HpackError("truncated integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        if shift >= _MAX_INT_SHIFT:
            raise HpackError("integer too long")
        shift += 7


def encode_int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """``first``: the representation's bits above the prefix."""
    mask = (1 << prefix_bits) - 1
    if value < mask:
        return bytes((first | value,))
    out = bytearray((first | mask,))
    value -= mask
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Decoder:
    """One connection's decoder. ``max_table_size``: our SETTINGS_HEADER_TABLE_SIZE, the
    most the client's size updates may ask for; ``max_list_size``: our
    SETTINGS_MAX_HEADER_LIST_SIZE (None: no limit)."""

    __slots__ = (
        "_blocks", "_entries", "_huffman", "_limit", "_max_list", "_max_size", "_size",
    )  # fmt: skip

    def __init__(self, max_table_size: int = 4096, max_list_size: int | None = None) -> None:
        self._max_list = max_list_size if max_list_size is not None else 2**62
        self._entries: list[Header] = []  # newest last: dynamic index i is entries[-i]
        self._size = 0
        self._max_size = max_table_size
        self._limit = max_table_size
        self._huffman: dict[bytes, bytes] = {}
        # indexed-only blocks -> their fields, valid while the dynamic table is unchanged
        self._blocks: dict[bytes, tuple[Header, ...]] = {}

    @property
    def table(self) -> list[Header]:
        """The dynamic table, newest first (as the RFC's examples print it)."""
        return self._entries[::-1]

    @property
    def table_size(self) -> int:
        return self._size

    def _field(self, index: int) -> Header:
        if index <= 0:
            raise HpackError("index 0")
        if index <= 61:
            return STATIC_TABLE[index - 1]
        dynamic = index - 61
        if dynamic > len(self._entries):
            raise HpackError(f"index {index} beyond the table")
        return self._entries[-dynamic]

    def _add(self, name: bytes, value: bytes) -> None:
        self._blocks.clear()
        size = len(name) + len(value) + ENTRY_OVERHEAD
        entries = self._entries
        while entries and self._size + size > self._max_size:
            old_name, old_value = entries.pop(0)
            self._size -= len(old_name) + len(old_value) + ENTRY_OVERHEAD
        if size <= self._max_size:  # a larger entry empties the table and is not added
            entries.append((name, value))
            self._size += size

    def _resize(self, size: int) -> None:
        if size > self._limit:
            raise HpackError(f"table size update to {size} above the limit {self._limit}")
        self._blocks.clear()
        self._max_size = size
        entries = self._entries
        while entries and self._size > size:
            old_name, old_value = entries.pop(0)
            self._size -= len(old_name) + len(old_value) + ENTRY_OVERHEAD

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackError("truncated string")
        coded = data[pos] & 0x80
        length, pos = decode_int(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("string runs past the header block")
        raw = data[pos:end]
        if not coded:
            return raw, end
        text = self._huffman.get(raw)
        if text is None:
            try:
                text = huffman.decode(raw)
            except huffman.HuffmanError as exc:
                raise HpackError(str(exc)) from None
            if length <= _HUFFMAN_CACHE_MAX_STRING:
                if len(self._huffman) >= _HUFFMAN_CACHE_SIZE:
                    self._huffman.clear()
                self._huffman[raw] = text
        return text, end

    def decode(self, data: bytes) -> tuple[Header, ...]:
        cached = self._blocks.get(data)
        if cached is not None:
            return cached
        headers: list[Header] = []
        append = headers.append
        pos = 0
        end = len(data)
        fields_seen = False
        indexed_only = True
        size = 0  # the decoded list's size as RFC 9113 §6.5.2 counts it
        limit = self._max_list
        while pos < end:
            if size > limit:
                if append is not _drop:  # keep decoding (the table), but not the fields
                    append = _drop
                if size > limit * _FATAL_LIST_FACTOR:
                    raise HeaderListTooLarge(size, limit, fatal=True)
            byte = data[pos]
            if byte & 0x80:  # indexed field (§6.1)
                if byte != 0xFF:
                    index = byte & 0x7F
                    pos += 1
                else:
                    index, pos = decode_int(data, pos, 7)
                field = self._field(index)
                size += len(field[0]) + len(field[1]) + ENTRY_OVERHEAD
                append(field)
            elif byte & 0x40:  # literal with incremental indexing (§6.2.1)
                indexed_only = False
                index, pos = decode_int(data, pos, 6)
                if index:
                    name = self._field(index)[0]
                else:
                    name, pos = self._string(data, pos)
                value, pos = self._string(data, pos)
                self._add(name, value)
                size += len(name) + len(value) + ENTRY_OVERHEAD
                append((name, value))
            elif byte & 0x20:  # dynamic table size update (§6.3)
                if fields_seen:
                    raise HpackError("table size update after the first field")
                table_size, pos = decode_int(data, pos, 5)  # no field: not in ``size``
                self._resize(table_size)
                indexed_only = False
                continue
            else:  # literal without indexing / never indexed (§6.2.2, §6.2.3)
                indexed_only = False
                index, pos = decode_int(data, pos, 4)
                if index:
                    name = self._field(index)[0]
                else:
                    name, pos = self._string(data, pos)
                value, pos = self._string(data, pos)
                size += len(name) + len(value) + ENTRY_OVERHEAD
                append((name, value))
            fields_seen = True
        if size > limit:
            raise HeaderListTooLarge(size, limit, fatal=False)
        result = tuple(headers)
        if indexed_only and 0 < len(data) <= _BLOCK_CACHE_MAX_BLOCK:
            if len(self._blocks) >= _BLOCK_CACHE_SIZE:
                self._blocks.clear()
            self._blocks[data] = result
        return result


def literal(name: bytes, value: bytes) -> bytes:
    """A field as a literal without indexing (§6.2.2), raw strings; the name by its
    static index when the static table has it."""
    index = STATIC_NAMES.get(name, 0)
    head = encode_int(index, 4) if index else b"\x00" + encode_int(len(name), 7) + name
    return head + encode_int(len(value), 7) + value


def encode(headers: list[Header]) -> bytes:
    out = []
    for name, value in headers:
        try:
            index = STATIC_TABLE.index((name, value)) + 1
        except ValueError:
            out.append(literal(name, value))
        else:
            out.append(encode_int(index, 7, 0x80))
    return b"".join(out)
