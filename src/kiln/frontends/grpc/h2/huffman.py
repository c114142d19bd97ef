"""HPACK's Huffman code (RFC 7541 §5.2, Appendix B).

The code is canonical (Appendix B: codes of one length are consecutive, in symbol order,
and each length starts where the shorter ones left off), so the table below keeps only
each symbol's code length, as listed in the RFC; the codes follow from them.

Decoding walks a 4-bit state machine built once at import: each state is a node of the
code tree, and each (state, nibble) entry says where the nibble leads and which symbol,
if any, it completes (codes are at least 5 bits long, so a nibble completes at most one).
"""

from __future__ import annotations

EOS = 256

# Code length of each symbol 0..255 and EOS (RFC 7541 Appendix B, "len in bits").
LENGTHS: tuple[int, ...] = (
    # 0..31 (control characters)
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    # 32..63: ' ' ! " # $ % & ' ( ) * + , - . / 0-9 : ; < = > ?
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    # 64..95: @ A-Z [ \ ] ^ _
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    # 96..127: ` a-z { | } ~ DEL
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    # 128..255
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    # EOS
    30,
)  # fmt: skip


class HuffmanError(ValueError):
    pass


def _canonical_codes(lengths: tuple[int, ...]) -> list[int]:
    codes = [0] * len(lengths)
    code = 0
    previous = lengths[min(range(len(lengths)), key=lambda s: (lengths[s], s))]
    for sym in sorted(range(len(lengths)), key=lambda s: (lengths[s], s)):
        code <<= lengths[sym] - previous
        previous = lengths[sym]
        codes[sym] = code
        code += 1
    return codes


CODES: tuple[int, ...] = tuple(_canonical_codes(LENGTHS))


def _build_decoder() -> tuple[list[int], frozenset[int]]:
    # The code tree: internal nodes numbered from 0 (the root); a child is a node number
    # or ~symbol for a leaf.
    children: list[list[int]] = [[0, 0]]
    filled: list[list[bool]] = [[False, False]]
    depth = [0]
    ones = [True]  # the path from the root is all 1 bits (a prefix of EOS)
    for sym, (code, length) in enumerate(zip(CODES, LENGTHS, strict=True)):
        node = 0
        for i in range(length - 1, -1, -1):
            bit = (code >> i) & 1
            if i == 0:
                children[node][bit] = ~sym
                filled[node][bit] = True
            else:
                if not filled[node][bit]:
                    children.append([0, 0])
                    filled.append([False, False])
                    depth.append(depth[node] + 1)
                    ones.append(ones[node] and bit == 1)
                    children[node][bit] = len(children) - 1
                    filled[node][bit] = True
                node = children[node][bit]
    # table[state * 16 + nibble] = next state | (symbol + 1) << 8, or -1 (EOS decoded)
    table = [0] * (len(children) * 16)
    for state in range(len(children)):
        for nibble in range(16):
            node, emitted, bad = state, 0, False
            for shift in (3, 2, 1, 0):
                child = children[node][(nibble >> shift) & 1]
                if child < 0:
                    if ~child == EOS:
                        bad = True
                        break
                    emitted = ~child + 1
                    node = 0
                else:
                    node = child
            table[state * 16 + nibble] = -1 if bad else node | emitted << 8
    # where a string may end: on a symbol boundary, or inside at most 7 bits of EOS padding
    accept = frozenset(s for s in range(len(children)) if s == 0 or (ones[s] and depth[s] <= 7))
    return table, accept


_TABLE, _ACCEPT = _build_decoder()


def decode(data: bytes) -> bytes:
    table = _TABLE
    out = bytearray()
    state = 0
    for byte in data:
        entry = table[state << 4 | byte >> 4]
        if entry < 0:
            raise HuffmanError("EOS inside a Huffman-coded string")
        if entry > 0xFF:
            out.append((entry >> 8) - 1)
        entry = table[(entry & 0xFF) << 4 | byte & 0xF]
        if entry < 0:
            raise HuffmanError("EOS inside a Huffman-coded string")
        if entry > 0xFF:
            out.append((entry >> 8) - 1)
        state = entry & 0xFF
    if state not in _ACCEPT:
        raise HuffmanError("invalid padding at the end of a Huffman-coded string")
    return bytes(out)


def encode(data: bytes) -> bytes:
    """kiln's encoder sends raw literals; this serves the tests (and clients written in
    Python) that need Huffman-coded input."""
    bits = 0
    count = 0
    for byte in data:
        bits = bits << LENGTHS[byte] | CODES[byte]
        count += LENGTHS[byte]
    pad = -count % 8
    bits = bits << pad | (1 << pad) - 1
    return bits.to_bytes((count + pad) // 8, "big")
