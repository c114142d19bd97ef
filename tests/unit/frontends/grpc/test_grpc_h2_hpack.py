"""HPACK against RFC 7541's own examples (Appendix C), its integer and Huffman rules, and
every malformed block the decoder refuses."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiln.frontends.grpc.h2 import huffman
from kiln.frontends.grpc.h2.hpack import (
    Decoder,
    HeaderListTooLarge,
    HpackError,
    decode_int,
    encode,
    encode_int,
    literal,
)


def hx(text: str) -> bytes:
    return bytes.fromhex("".join(text.split()))


def fields(*pairs: tuple[str, str]) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((k.encode(), v.encode()) for k, v in pairs)


# ---- integers (§5.1, C.1) -----------------------------------------------------------
def test_rfc_integer_examples() -> None:
    assert encode_int(10, 5) == bytes([0b01010])  # C.1.1
    assert encode_int(1337, 5) == bytes([0b11111, 0b10011010, 0b00001010])  # C.1.2
    assert encode_int(42, 8) == bytes([42])  # C.1.3
    assert decode_int(bytes([0xE0 | 10]), 0, 5) == (10, 1)  # bits above the prefix ignored
    assert decode_int(bytes([0x1F, 0x9A, 0x0A]), 0, 5) == (1337, 3)


@pytest.mark.parametrize("prefix", [1, 4, 5, 6, 7, 8])
def test_integer_boundaries(prefix: int) -> None:
    mask = (1 << prefix) - 1
    # one below the prefix's maximum fits; the maximum itself needs a 0 continuation byte
    assert encode_int(mask - 1, prefix) == bytes([mask - 1])
    assert encode_int(mask, prefix) == bytes([mask, 0])
    assert encode_int(mask + 127, prefix) == bytes([mask, 127])
    assert encode_int(mask + 128, prefix) == bytes([mask, 0x80, 1])
    for value in (0, mask - 1, mask, mask + 1, 2**14, 2**21 + 5, 2**31 - 1, 2**32):
        data = encode_int(value, prefix) + b"tail"
        assert decode_int(data, 0, prefix) == (value, len(data) - 4)


@given(st.integers(0, 2**34), st.integers(1, 8))
def test_integer_round_trip(value: int, prefix: int) -> None:
    data = encode_int(value, prefix)
    assert decode_int(data, 0, prefix) == (value, len(data))


def test_integer_truncated_or_too_long() -> None:
    with pytest.raises(HpackError, match="truncated"):
        decode_int(bytes([0x1F, 0x80]), 0, 5)
    with pytest.raises(HpackError, match="too long"):
        decode_int(bytes([0x1F]) + b"\x80" * 6 + b"\x01", 0, 5)
    # redundant zero continuation bytes are still within the limit
    assert decode_int(bytes([0x1F, 0x80, 0x80, 0x00]), 0, 5) == (31, 4)


# ---- Huffman (§5.2, Appendix B) -------------------------------------------------------
def test_huffman_table_is_the_rfcs() -> None:
    # a complete prefix code (Kraft's sum is exactly 1), and codes the RFC lists
    assert sum(Fraction(1, 2**n) for n in huffman.LENGTHS) == 1
    listed = {
        0: (0x1FF8, 13), 1: (0x7FFFD8, 23), 9: (0xFFFFEA, 24), 10: (0x3FFFFFFC, 30),
        13: (0x3FFFFFFD, 30), 22: (0x3FFFFFFE, 30), 31: (0xFFFFFFB, 28), 32: (0x14, 6),
        34: (0x3F9, 10), 47: (0x18, 6), 48: (0x0, 5), 58: (0x5C, 7), 60: (0x7FFC, 15),
        65: (0x21, 6), 88: (0xFC, 8), 92: (0x7FFF0, 19), 96: (0x7FFD, 15), 97: (0x3, 5),
        122: (0x7B, 7), 126: (0x1FFD, 13), 127: (0xFFFFFFC, 28), 128: (0xFFFE6, 20),
        153: (0x1FFFDC, 21), 176: (0x1FFFE0, 21), 192: (0x3FFFFE0, 26), 199: (0x1FFFFEC, 25),
        203: (0x7FFFFDE, 27), 206: (0xFFFFF1, 24), 220: (0xFFFFFFD, 28), 227: (0x1FFFE6, 21),
        249: (0xFFFFFFE, 28), 254: (0x7FFFFF0, 27), 255: (0x3FFFFEE, 26), 256: (0x3FFFFFFF, 30),
    }  # fmt: skip
    for symbol, code in listed.items():
        assert (huffman.CODES[symbol], huffman.LENGTHS[symbol]) == code, symbol


def test_huffman_rfc_strings() -> None:
    assert huffman.decode(hx("f1e3 c2e5 f23a 6ba0 ab90 f4ff")) == b"www.example.com"
    assert huffman.decode(hx("a8eb 1064 9cbf")) == b"no-cache"
    assert huffman.encode(b"custom-key") == hx("25a8 49e9 5ba9 7d7f")
    assert huffman.encode(b"") == b""


@given(st.binary(max_size=200))
def test_huffman_round_trip(data: bytes) -> None:
    assert huffman.decode(huffman.encode(data)) == data


def test_huffman_refuses_bad_padding_and_eos() -> None:
    with pytest.raises(huffman.HuffmanError, match="padding"):
        huffman.decode(b"\xff\xff")  # 16 bits of EOS prefix: padding longer than 7 bits
    with pytest.raises(huffman.HuffmanError, match="padding"):
        huffman.decode(b"\x00")  # '0' (5 zero bits) then padding of zeros, not ones
    with pytest.raises(huffman.HuffmanError, match="EOS"):
        huffman.decode(b"\xff\xff\xff\xff")  # the whole 30-bit EOS symbol


# ---- single representations (C.2) ------------------------------------------------------
def test_c2_1_literal_with_indexing() -> None:
    d = Decoder()
    block = hx("400a 6375 7374 6f6d 2d6b 6579 0d63 7573 746f 6d2d 6865 6164 6572")
    assert d.decode(block) == fields(("custom-key", "custom-header"))
    assert d.table == list(fields(("custom-key", "custom-header")))
    assert d.table_size == 55


def test_c2_2_literal_without_indexing() -> None:
    d = Decoder()
    assert d.decode(hx("040c 2f73 616d 706c 652f 7061 7468")) == fields((":path", "/sample/path"))
    assert d.table == [] and d.table_size == 0


def test_c2_3_literal_never_indexed() -> None:
    d = Decoder()
    block = hx("1008 7061 7373 776f 7264 0673 6563 7265 74")
    assert d.decode(block) == fields(("password", "secret"))
    assert d.table == []


def test_c2_4_indexed() -> None:
    d = Decoder()
    assert d.decode(hx("82")) == fields((":method", "GET"))
    assert d.table == []


# ---- request sequences (C.3 raw, C.4 Huffman) -----------------------------------------
REQUESTS = [
    fields((":method", "GET"), (":scheme", "http"), (":path", "/"),
           (":authority", "www.example.com")),
    fields((":method", "GET"), (":scheme", "http"), (":path", "/"),
           (":authority", "www.example.com"), ("cache-control", "no-cache")),
    fields((":method", "GET"), (":scheme", "https"), (":path", "/index.html"),
           (":authority", "www.example.com"), ("custom-key", "custom-value")),
]  # fmt: skip
REQUEST_TABLES = [
    (fields((":authority", "www.example.com")), 57),
    (fields(("cache-control", "no-cache"), (":authority", "www.example.com")), 110),
    (fields(("custom-key", "custom-value"), ("cache-control", "no-cache"),
            (":authority", "www.example.com")), 164),
]  # fmt: skip
C3 = [
    "8286 8441 0f77 7777 2e65 7861 6d70 6c65 2e63 6f6d",
    "8286 84be 5808 6e6f 2d63 6163 6865",
    "8287 85bf 400a 6375 7374 6f6d 2d6b 6579 0c63 7573 746f 6d2d 7661 6c75 65",
]
C4 = [
    "8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff",
    "8286 84be 5886 a8eb 1064 9cbf",
    "8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf",
]


@pytest.mark.parametrize("blocks", [C3, C4], ids=["C.3-raw", "C.4-huffman"])
def test_request_sequence(blocks: list[str]) -> None:
    d = Decoder()
    for block, expected, (table, size) in zip(blocks, REQUESTS, REQUEST_TABLES, strict=True):
        assert d.decode(hx(block)) == expected
        assert d.table == list(table)
        assert d.table_size == size


# ---- response sequences with evictions (C.5 raw, C.6 Huffman; table size 256) ---------
DATE1, DATE2 = "Mon, 21 Oct 2013 20:13:21 GMT", "Mon, 21 Oct 2013 20:13:22 GMT"
COOKIE = "foo=ASDJKHQKBZXOQWEOPIUAXQWEOIU; max-age=3600; version=1"
LOCATION = "https://www.example.com"
RESPONSES = [
    fields((":status", "302"), ("cache-control", "private"), ("date", DATE1),
           ("location", LOCATION)),
    fields((":status", "307"), ("cache-control", "private"), ("date", DATE1),
           ("location", LOCATION)),
    fields((":status", "200"), ("cache-control", "private"), ("date", DATE2),
           ("location", LOCATION), ("content-encoding", "gzip"), ("set-cookie", COOKIE)),
]  # fmt: skip
RESPONSE_TABLES = [
    (fields(("location", LOCATION), ("date", DATE1), ("cache-control", "private"),
            (":status", "302")), 222),
    (fields((":status", "307"), ("location", LOCATION), ("date", DATE1),
            ("cache-control", "private")), 222),
    (fields(("set-cookie", COOKIE), ("content-encoding", "gzip"), ("date", DATE2)), 215),
]  # fmt: skip
C5 = [
    """4803 3330 3258 0770 7269 7661 7465 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133
       2032 303a 3133 3a32 3120 474d 546e 1768 7474 7073 3a2f 2f77 7777 2e65 7861 6d70
       6c65 2e63 6f6d""",
    "4803 3330 37c1 c0bf",
    """88c1 611d 4d6f 6e2c 2032 3120 4f63 7420 3230 3133 2032 303a 3133 3a32 3220 474d
       54c0 5a04 677a 6970 7738 666f 6f3d 4153 444a 4b48 514b 425a 584f 5157 454f 5049
       5541 5851 5745 4f49 553b 206d 6178 2d61 6765 3d33 3630 303b 2076 6572 7369 6f6e
       3d31""",
]
C6 = [
    """4882 6402 5885 aec3 771a 4b61 96d0 7abe 9410 54d4 44a8 2005 9504 0b81 66e0 82a6
       2d1b ff6e 919d 29ad 1718 63c7 8f0b 97c8 e9ae 82ae 43d3""",
    "4883 640e ffc1 c0bf",
    """88c1 6196 d07a be94 1054 d444 a820 0595 040b 8166 e084 a62d 1bff c05a 839b d9ab
       77ad 94e7 821d d7f2 e6c7 b335 dfdf cd5b 3960 d5af 2708 7f36 72c1 ab27 0fb5 291f
       9587 3160 65c0 03ed 4ee5 b106 3d50 07""",
]


@pytest.mark.parametrize("blocks", [C5, C6], ids=["C.5-raw", "C.6-huffman"])
def test_response_sequence_with_evictions(blocks: list[str]) -> None:
    d = Decoder(max_table_size=256)
    for block, expected, (table, size) in zip(blocks, RESPONSES, RESPONSE_TABLES, strict=True):
        assert d.decode(hx(block)) == expected
        assert d.table == list(table)
        assert d.table_size == size


# ---- table size updates and what the decoder refuses ----------------------------------
def test_size_update_evicts_and_is_bounded_by_our_setting() -> None:
    d = Decoder(max_table_size=4096)
    d.decode(hx(C3[0]) + hx(C3[1])[4:])  # two entries: 110 bytes
    assert d.table_size == 110
    d.decode(encode_int(60, 5, 0x20) + hx("82"))  # shrink to 60: the older entry goes
    assert d.table == list(fields(("cache-control", "no-cache")))
    d.decode(encode_int(0, 5, 0x20))  # 0 empties it
    assert d.table == []
    with pytest.raises(HpackError, match="above the limit"):
        d.decode(encode_int(4097, 5, 0x20))


def test_size_update_does_not_count_towards_the_list() -> None:
    """A table size update is no field: its value was taken for the list's size, so a
    list within the limit was refused after a size update to 4096."""
    d = Decoder(max_table_size=4096, max_list_size=100)
    field = b"\x00" + encode_int(1, 7) + b"a" + encode_int(60, 7) + b"v" * 60  # 93 bytes
    assert d.decode(encode_int(4096, 5, 0x20) + field) == ((b"a", b"v" * 60),)
    with pytest.raises(HeaderListTooLarge):
        d.decode(encode_int(4096, 5, 0x20) + field + field)  # 186 bytes: over


def test_entry_larger_than_the_table_empties_it() -> None:
    d = Decoder(max_table_size=64)
    d.decode(b"\x40" + encode_int(1, 7) + b"a" + encode_int(1, 7) + b"b")  # 34 bytes
    assert d.table_size == 34
    d.decode(b"\x40" + encode_int(1, 7) + b"c" + encode_int(40, 7) + b"v" * 40)  # 73 bytes
    assert d.table == [] and d.table_size == 0


@pytest.mark.parametrize(
    ("block", "why"),
    [
        (b"\x80", "index 0"),
        (b"\xbe", "beyond the table"),  # dynamic index 62 in an empty table
        (b"\xff\xff\xff\xff\xff\xff\xff\x01", "too long"),
        (b"\x40\x0a" + b"short", "runs past"),
        (b"\x04", "truncated string"),
        (b"\x04\x85\xff\xff", "runs past"),
        (b"\x04\x82\xff\xff", "padding"),  # Huffman value with 16 bits of padding
        (b"\x82\x3f\xe1\x1f", "after the first field"),
    ],
    ids=[
        "index-0", "index-beyond-table", "integer-too-long", "literal-past-end",
        "missing-string", "huffman-past-end", "huffman-bad-padding", "late-size-update",
    ],
)  # fmt: skip
def test_malformed_blocks(block: bytes, why: str) -> None:
    with pytest.raises(HpackError, match=why):
        Decoder().decode(block)


def test_cached_block_follows_table_changes() -> None:
    d = Decoder()
    d.decode(b"\x40\x01a\x01b")  # dynamic 62 = a: b
    assert d.decode(b"\xbe") == fields(("a", "b"))
    assert d.decode(b"\xbe") == fields(("a", "b"))  # remembered
    d.decode(b"\x40\x01c\x01d")  # now 62 = c: d
    assert d.decode(b"\xbe") == fields(("c", "d"))


# ---- encoder ------------------------------------------------------------------------
def test_encoder_output_decodes() -> None:
    headers = list(fields((":status", "200"), ("content-type", "application/grpc"),
                          ("grpc-status", "13"), ("grpc-message", "x" * 300)))  # fmt: skip
    block = encode(headers)
    assert block[0] == 0x88  # :status 200 is a static index
    d = Decoder()
    assert list(d.decode(block)) == headers
    assert d.table == []  # literals without indexing leave the client's table alone
    assert literal(b"content-type", b"a") == b"\x0f\x10\x01a"  # static name index 31
