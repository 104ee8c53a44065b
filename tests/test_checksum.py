"""cloudckpt.checksum computes CRC-32C (Castagnoli): the RFC 3720 vectors, a pure-Python reference
on generated buffers and split points, every buffer format the library passes (no copy needed),
and per-block crcs. Stored checkpoints hold these values: they must never change (the golden
manifest test, tests/manifest/test_golden.py, pins them in a stored manifest too).
"""

from __future__ import annotations

import array

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.checksum import FUSED_PIECE, block_crcs, content_hash, crc32c, hash_and_block_crcs


def _reference_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # reflected Castagnoli polynomial
        table.append(c)
    return table


_TABLE = _reference_table()


def reference_crc32c(data: bytes, value: int = 0) -> int:
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


RFC3720_VECTORS = [  # RFC 3720, B.4
    (bytes(32), 0x8A9136AA),
    (b"\xff" * 32, 0x62A8AB43),
    (bytes(range(32)), 0x46DD794E),
    (bytes(range(31, -1, -1)), 0x113FDB5C),
    (b"123456789", 0xE3069283),
    (b"", 0),
]


@pytest.mark.parametrize("data, expected", RFC3720_VECTORS)
def test_rfc3720_vectors(data, expected):
    assert crc32c(data) == expected
    assert reference_crc32c(data) == expected


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=4096), st.data())
def test_matches_the_reference_and_chains(data, draw):
    assert crc32c(data) == reference_crc32c(data)
    cut = draw.draw(st.integers(0, len(data)))
    assert crc32c(data[cut:], crc32c(data[:cut])) == crc32c(data)


@pytest.mark.parametrize(
    "make",
    [
        bytes,
        bytearray,
        memoryview,
        lambda b: memoryview(bytearray(b)).toreadonly(),
        lambda b: np.frombuffer(b, np.uint8).copy(),
        lambda b: np.frombuffer(b, np.float32).copy(),  # a multi-byte format: cast to bytes
        lambda b: np.frombuffer(b, np.int64).reshape(4, -1).copy(),  # 2-D, C-contiguous
        lambda b: array.array("i", b),
    ],
    ids=["bytes", "bytearray", "memoryview", "readonly", "u8", "f32", "i64-2d", "array"],
)
def test_every_buffer_format_gives_the_crc_of_its_bytes(make):
    raw = bytes(range(256)) * 4
    assert crc32c(make(raw)) == reference_crc32c(raw)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000), st.integers(1, 700))
def test_block_crcs_are_the_crcs_of_each_block(data, block):
    expected = tuple(reference_crc32c(data[i : i + block]) for i in range(0, len(data), block))
    assert block_crcs(data, block) == (expected or (0,))


def test_block_crcs_rejects_a_non_positive_block_size():
    with pytest.raises(ValueError):
        block_crcs(b"abc", 0)


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=3000), st.integers(1, 700))
def test_hash_and_block_crcs_is_both_functions_in_one_pass(data, block):
    assert hash_and_block_crcs(data, block) == (content_hash(data), block_crcs(data, block))


@pytest.mark.parametrize(
    "size, block",
    [
        (3 * FUSED_PIECE + 17, 4 << 20),  # one block, several pieces, a short last piece
        (5 * FUSED_PIECE, 2 * FUSED_PIECE + 3),  # blocks and pieces not aligned
        (2 * FUSED_PIECE, FUSED_PIECE // 3),  # blocks smaller than a piece
    ],
)
def test_hash_and_block_crcs_across_piece_boundaries(size, block):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    assert hash_and_block_crcs(data, block) == (content_hash(data), block_crcs(data, block))
    with pytest.raises(ValueError):
        hash_and_block_crcs(data, 0)


def test_the_content_hash_is_the_first_8_bytes_of_the_xxh3_128_digest():
    """What lets an older manifest's 16-byte hashes serve as a base: they shorten to it."""
    import xxhash

    for n in (0, 1, 240, 241, 4096, (1 << 20) + 3):
        data = bytes((7 * i) % 251 for i in range(n))
        assert content_hash(data) == xxhash.xxh3_128_digest(data)[:8]
        assert len(content_hash(data)) == 8
