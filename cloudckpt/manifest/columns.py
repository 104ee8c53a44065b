"""Compact msgpack encoding of integer columns (used by manifests and plans).

A column is the msgpack array ``[transform, width, compression, count, payload]``:

- ``transform``: ``"raw"`` (values as they are) or ``"delta"`` (first value, then differences;
  the decoder takes a cumulative sum);
- ``width``: 1, 2, 4 or 8: bytes per stored (signed, little-endian) integer, the narrowest that
  holds every stored number;
- ``compression``: ``"none"`` or ``"zlib"`` (applied to the packed integers);
- ``count``: number of values; ``payload``: bytes.

Decoding never trusts the input: the caller states how many values it expects, a payload that
inflates past ``count * width`` bytes is refused before it is inflated further, and decoding
proceeds block by block (:func:`iter_int_column`), so a highly compressed payload never
inflates into more than one block besides the caller's result.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

_WIDTHS = (1, 2, 4, 8)
_LIMITS = {w: (-(1 << (8 * w - 1)), (1 << (8 * w - 1)) - 1) for w in _WIDTHS}


#: An encoded column: ``[transform, width, compression, count, payload]`` (see module doc).
Column = list[str | int | bytes]
#: How a column's numbers are stored: as they are, or first value then differences.
Transform = Literal["raw", "delta"]
#: What packs a column's integers.
Compression = Literal["none", "zlib"]


class ColumnError(ValueError):
    """A column is malformed (the caller turns this into its own error with a path)."""


def encode_int_column(values: ArrayLike, *, delta: bool = False, compress: bool = True) -> Column:
    """Encode a 1-D sequence of int64-representable integers as a column (see module doc)."""
    arr = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    stored = arr
    if delta and arr.size:
        stored = np.empty_like(arr)
        stored[0] = arr[0]
        np.subtract(arr[1:], arr[:-1], out=stored[1:])
    width = 8
    if stored.size:
        lo, hi = int(stored.min()), int(stored.max())
        for w in _WIDTHS:
            if _LIMITS[w][0] <= lo and hi <= _LIMITS[w][1]:
                width = w
                break
    else:
        width = 1
    payload = stored.astype(f"<i{width}", copy=False).tobytes()
    compression: Compression = "none"
    if compress and len(payload) >= 64:
        packed = zlib.compress(payload, 6)
        if len(packed) < len(payload) - len(payload) // 8:
            payload, compression = packed, "zlib"
    return ["delta" if delta else "raw", width, compression, int(arr.size), payload]


#: Values per block when a column is decoded piecewise (bounds the temporary memory).
BLOCK = 1 << 16
_FEED = 1 << 16  # compressed bytes handed to zlib at once


def _header(
    column: object, expected: int | None, max_count: int | None
) -> tuple[Transform, int, Compression, int, bytes | bytearray]:
    if not isinstance(column, (list, tuple)) or len(column) != 5:
        raise ColumnError("column must be a 5-element array")
    transform, width, compression, count, payload = column
    if transform not in ("raw", "delta"):
        raise ColumnError(f"unknown column transform {transform!r}")
    if type(width) is not int or width not in _WIDTHS:
        raise ColumnError(f"bad column width {width!r}")
    if compression not in ("none", "zlib"):
        raise ColumnError(f"unknown column compression {compression!r}")
    if type(count) is not int or count < 0:
        raise ColumnError(f"bad column count {count!r}")
    if expected is not None and count != expected:
        raise ColumnError(f"column has {count} values, expected {expected}")
    if max_count is not None and count > max_count:
        raise ColumnError(f"column has {count} values, at most {max_count} allowed")
    if not isinstance(payload, (bytes, bytearray)):
        raise ColumnError("column payload must be bytes")
    return transform, width, compression, count, payload


def _raw_pieces(
    payload: bytes | bytearray, compression: Compression, nbytes: int, step: int
) -> Iterator[bytes | memoryview]:
    """The column's packed integers, ``step`` bytes at a time (the last piece may be shorter)."""
    if compression == "none":
        if len(payload) != nbytes:
            raise ColumnError(f"column payload has {len(payload)} bytes, expected {nbytes}")
        view = memoryview(payload)
        for pos in range(0, nbytes, step):
            yield view[pos : pos + step]
        return
    inflater = zlib.decompressobj()
    source = memoryview(payload)
    tail: bytes | memoryview = b""
    pos, produced, pending = 0, 0, bytearray()
    try:
        while produced < nbytes:
            if not tail:  # feed the input in bounded pieces: unconsumed_tail is a copy
                if pos >= len(source):
                    raise ColumnError(
                        f"zlib column payload inflates to {produced} bytes, expected {nbytes}"
                    )
                tail, pos = source[pos : pos + _FEED], pos + _FEED
            piece = inflater.decompress(tail, min(step - len(pending), nbytes - produced))
            tail = inflater.unconsumed_tail
            if piece:
                produced += len(piece)
                pending += piece
                if len(pending) == step or produced == nbytes:
                    yield bytes(pending)
                    pending = bytearray()
            elif inflater.eof:
                raise ColumnError(
                    f"zlib column payload inflates to {produced} bytes, expected {nbytes}"
                )
        extra = inflater.decompress(bytes(tail) + bytes(source[pos:]), 1)
    except zlib.error as exc:
        raise ColumnError(f"corrupt zlib column payload: {exc}") from exc
    if extra or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise ColumnError(f"zlib column payload does not inflate to exactly {nbytes} bytes")


def iter_int_column(
    column: object, *, expected: int | None = None, max_count: int | None = None, block: int = BLOCK
) -> Iterator[tuple[int, NDArray[np.int64]]]:
    """Decode a column piecewise: yields ``(start, values)``, ``values`` an int64 array of at most
    ``block`` values (delta already undone) starting at value ``start``, in order.

    Never holds more than one block of the column at once besides its payload, whatever the
    compression ratio. Raises :class:`ColumnError` on any malformation (possibly after some
    blocks were yielded: the caller discards what it got).
    """
    transform, width, compression, count, payload = _header(column, expected, max_count)
    start, carry = 0, 0
    for raw in _raw_pieces(payload, compression, count * width, block * width):
        values = np.frombuffer(raw, dtype=f"<i{width}").astype(np.int64)
        if transform == "delta":
            np.cumsum(values, out=values)
            values += carry
            carry = int(values[-1])
        yield start, values
        start += len(values)


def _one_block(payload: bytes | bytearray, compression: Compression, nbytes: int) -> bytes:
    """The packed integers of a small column (``0 < nbytes``, payload at most ``_FEED`` bytes),
    with the same checks as :func:`_raw_pieces`."""
    if compression == "none":
        if len(payload) != nbytes:
            raise ColumnError(f"column payload has {len(payload)} bytes, expected {nbytes}")
        return bytes(payload)
    inflater = zlib.decompressobj()
    try:
        raw = inflater.decompress(payload, nbytes)
        got = len(raw)
        if got != nbytes:
            raise ColumnError(f"zlib column payload inflates to {got} bytes, expected {nbytes}")
        extra = inflater.decompress(inflater.unconsumed_tail, 1)
    except zlib.error as exc:
        raise ColumnError(f"corrupt zlib column payload: {exc}") from exc
    if extra or not inflater.eof or inflater.unconsumed_tail or inflater.unused_data:
        raise ColumnError(f"zlib column payload does not inflate to exactly {nbytes} bytes")
    return raw


def decode_int_column(
    column: object, *, expected: int | None = None, max_count: int | None = None
) -> NDArray[np.int64]:
    """Decode a column into a read-only int64 array.

    ``expected``: the exact number of values required; ``max_count``: an upper bound when the
    count is not known beforehand. Raises :class:`ColumnError` on any malformation. Memory: the
    result and one block (see :func:`iter_int_column`).
    """
    transform, width, compression, count, payload = _header(column, expected, max_count)
    if 0 < count <= BLOCK and len(payload) <= _FEED:  # one block: inflate it in one call
        values = np.frombuffer(_one_block(payload, compression, count * width), f"<i{width}")
        values = values.astype(np.int64)
        if transform == "delta":
            np.cumsum(values, out=values)
        values.flags.writeable = False
        return values
    out = np.empty(count, dtype=np.int64)
    for start, values in iter_int_column(column, expected=expected, max_count=max_count):
        out[start : start + len(values)] = values
    out.flags.writeable = False
    return out


def encode_u32(values: ArrayLike) -> bytes:
    """Pack unsigned 32-bit integers (crc32c values) little-endian, uncompressed."""
    return np.ascontiguousarray(values, dtype="<u4").tobytes()


def decode_u32(payload: object, *, expected: int | None = None) -> NDArray[np.uint32]:
    """Inverse of :func:`encode_u32`, as a read-only uint32 array."""
    if not isinstance(payload, (bytes, bytearray)) or len(payload) % 4:
        raise ColumnError("u32 payload must be bytes of a multiple of 4 length")
    if expected is not None and len(payload) != 4 * expected:
        raise ColumnError(f"u32 payload holds {len(payload) // 4} values, expected {expected}")
    out = np.frombuffer(payload, dtype="<u4").astype(np.uint32)
    out.flags.writeable = False
    return out
