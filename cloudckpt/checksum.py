"""crc32c (Castagnoli) over bytes-like objects, with the hardware (SSE4.2/ARMv8) implementation of
the ``crc32c`` package (about 15 GB/s here; it releases the GIL on large buffers), and the content
hash incremental saves compare chunks by (:func:`content_hash`: the first 8 bytes of the XXH3-128
digest of the ``xxhash`` package, about 10 GB/s on one core here, 2x blake3's 4.6 GB/s; it
releases the GIL too). :func:`hash_and_block_crcs` computes both in one pass over the bytes (what
a hashing save's writer does: the bytes are read from memory once). :func:`crc32c_combine` joins
the crcs of two pieces into the crc of both (what checking a file read in ranges, in any order,
needs).

Why 8 bytes of XXH3-128 (docs/decisions.md, "Content hashes"): they are what a manifest records
per chunk (16 bytes a chunk would take the manifest of a 16,384-rank job past a tenth of DCP's
``.metadata``), and an older manifest's full 16-byte XXH3-128 hashes shorten to exactly these, so
it still serves as a base. A save reuses a chunk only when this hash *and* every block crc32c of
the chunk equal the base's.

Pure and dependency-light: used by the writer, the reader and the storage layer. Buffers are read
in place (no copy) whatever their format, as long as they are C-contiguous.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import crc32c as _crc32c_lib
import xxhash


class Buffer(Protocol):
    """Any object exposing the buffer protocol (``collections.abc.Buffer`` from Python 3.12)."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


#: crc32c(data, value) continuing from ``value`` (the ``crc32c`` package has no type hints).
_extend: Callable[[Buffer, int], int] = _crc32c_lib.crc32c


def _byte_view(data: Buffer) -> memoryview:
    """``data`` (any C-contiguous buffer) as a flat memoryview of bytes (no copy)."""
    mv = data if isinstance(data, memoryview) else memoryview(data)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def crc32c(data: Buffer, value: int = 0) -> int:
    """Return the crc32c of ``data`` (any C-contiguous buffer), continuing from ``value``."""
    mv = _byte_view(data)
    return _extend(mv, value)


def block_crcs(data: Buffer, block_size: int) -> tuple[int, ...]:
    """crc32c of each ``block_size`` block of ``data`` (the last block may be shorter).

    An empty buffer has one block, whose crc is 0.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    mv = _byte_view(data)
    n = len(mv)
    if n == 0:
        return (0,)
    return tuple(_extend(mv[i : i + block_size], 0) for i in range(0, n, block_size))


#: Bytes of :func:`content_hash` (the leading bytes of an XXH3-128 digest).
CONTENT_HASH_BYTES = 8


def content_hash(data: Buffer) -> bytes:
    """The 8-byte content hash of ``data`` (any C-contiguous buffer): the first
    :data:`CONTENT_HASH_BYTES` bytes (the high 64 bits) of its big-endian XXH3-128 digest. What a
    manifest records per chunk (``chunks.hash64``)."""
    mv = _byte_view(data)
    return xxhash.xxh3_128_digest(mv)[:CONTENT_HASH_BYTES]


def identity_digest(data: Buffer) -> bytes:
    """The whole 16-byte XXH3-128 digest of ``data``: what equal payloads are recognised by when
    one travels in place of another (a rank's nesting sent once for ranks of the same layout)."""
    return xxhash.xxh3_128_digest(_byte_view(data))


#: Bytes read per step of :func:`hash_and_block_crcs`: small enough that the second read (the
#: hash after the crc) finds them in the core's cache, large enough that the per-call overhead
#: (and the GIL round trip of each call) stays negligible.
FUSED_PIECE = 1 << 20


def hash_and_block_crcs(data: Buffer, block_size: int) -> tuple[bytes, tuple[int, ...]]:
    """``(content_hash(data), block_crcs(data, block_size))`` in one pass over ``data``: each
    piece of at most :data:`FUSED_PIECE` bytes is crc'd and hashed while it is in cache (the
    values are exactly those of the two functions)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    mv = _byte_view(data)
    n = len(mv)
    if n == 0:
        return xxhash.xxh3_128_digest(mv)[:CONTENT_HASH_BYTES], (0,)
    hasher = xxhash.xxh3_128()
    crcs: list[int] = []
    step = min(block_size, FUSED_PIECE)
    for start in range(0, n, block_size):
        end = min(start + block_size, n)
        crc = 0
        for i in range(start, end, step):
            piece = mv[i : min(i + step, end)]
            crc = _extend(piece, crc)
            hasher.update(piece)
        crcs.append(crc)
    return hasher.digest()[:CONTENT_HASH_BYTES], tuple(crcs)


#: Castagnoli polynomial, reflected.
_POLY = 0x82F63B78


def _times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _zero_byte_operators() -> list[list[int]]:
    """``ops[k]``: the GF(2) operator that appends ``2**k`` zero bytes to a crc32c register."""
    one_bit = [_POLY] + [1 << n for n in range(31)]
    op = _square(_square(_square(one_bit)))  # 8 zero bits
    ops = [op]
    for _ in range(63):
        op = _square(op)
        ops.append(op)
    return ops


_OPS = _zero_byte_operators()


def crc32c_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32c of ``A + B`` from ``crc1 = crc32c(A)``, ``crc2 = crc32c(B)`` and ``len(B)``
    (zlib's ``crc32_combine``, for the Castagnoli polynomial)."""
    k = 0
    while len2:
        if len2 & 1:
            crc1 = _times(_OPS[k], crc1)
        len2 >>= 1
        k += 1
    return crc1 ^ crc2
