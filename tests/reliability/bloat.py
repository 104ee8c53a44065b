"""Hostile manifests built to cost the most memory per byte of their own size.

Each generator returns the stored bytes (format version 2, with a correct checksum: the attacker
controls the whole file) of a manifest of about ``size`` bytes. The decoder's bound (see
``cloudckpt.manifest.codec``) is measured on these; ``FAMILIES`` names them for the tests and
the figures in docs/reliability.md.

- ``empty_chunks_64d``: the reported case, many zero-element chunks of a 64-dimension tensor
  (4 bytes of crc each, 128 coordinate integers each, the coordinate columns compressing to
  nothing). Refused by the integer budget before a column is inflated.
- ``empty_chunks_8d``: the same at 8 dimensions, which the budget (2 coordinates per byte)
  just admits: the most chunk coordinates a manifest of its size may declare. Decodes.
- ``empty_tensors``: many chunkless 10-dimension tensors with short names: the most shape
  dimensions (and tensor records) per byte the budget admits. Decodes.
- ``one_byte_chunks``: many one-byte chunks in reverse byte order (per-chunk arrays, the
  overlap check's sort). Decodes.
- ``empty_dicts``: one value that is a list of empty dicts, one byte each: the densest Python
  objects msgpack makes (64 bytes and a reference per byte). Decodes.
- ``unknown_field``: the same list in an unknown top-level field (skipped, never built).
- ``many_values``: many one-byte values with short names.
"""

from __future__ import annotations

import msgpack
import numpy as np

from cloudckpt.manifest.columns import encode_int_column
from cloudckpt.manifest.framing import frame
from cloudckpt.manifest.values import encode_value

OBJECT = "data/0123456789abcdef/r00000-0000.bin"


def _doc(**overrides) -> dict:
    doc = {
        "format": "cloudckpt",
        "version": 2,
        "cloudckpt_version": "0",
        "created_at": 1.0,
        "world_size": 1,
        "checksum_block_size": 64,
        "metadata": encode_value({}, key="metadata", allow_pickle=False),
        "structure": encode_value(None, key="structure", allow_pickle=False),
        "objects": [OBJECT],
        "tensors": {
            "names": [],
            "dtypes": [],
            "ndims": encode_int_column([]),
            "shapes": encode_int_column([]),
            "chunk_counts": encode_int_column([]),
        },
        "chunks": {
            **{
                k: encode_int_column([])
                for k in ("offsets", "sizes", "object_index", "byte_offset", "byte_length")
            },
            "crc32c": b"",
        },
        "values": {},
    }
    doc.update(overrides)
    return doc


def _stored(doc: dict) -> bytes:
    return frame(msgpack.packb(doc, use_bin_type=True))


def empty_chunks(size: int, ndim: int) -> bytes:
    """One float32 tensor of shape (0, 1, ..., 1) held by ``size // 4`` zero-element chunks."""
    n = max(1, size // 4)
    sizes = np.ones((ndim, n), dtype=np.int64)
    sizes[0] = 0
    zeros = np.zeros(n, dtype=np.int64)
    return _stored(
        _doc(
            tensors={
                "names": ["t"],
                "dtypes": ["float32"],
                "ndims": encode_int_column([ndim]),
                "shapes": encode_int_column([0] + [1] * (ndim - 1)),
                "chunk_counts": encode_int_column([n]),
            },
            chunks={
                "offsets": encode_int_column(np.zeros(n * ndim, dtype=np.int64), delta=True),
                "sizes": encode_int_column(sizes.reshape(-1), delta=True),
                "object_index": encode_int_column(zeros, delta=True),
                "byte_offset": encode_int_column(zeros, delta=True),
                "byte_length": encode_int_column(zeros, delta=True),
                "crc32c": b"\0" * (4 * n),
            },
        )
    )


def empty_tensors(size: int, ndim: int = 10) -> bytes:
    """Chunkless bool tensors of shape (0, 2**20, 2**20, 1, ...) named by 3-4 hex digits."""
    n = max(1, size // 10)
    shape = [0, 1 << 20, 1 << 20] + [1] * (ndim - 3)
    return _stored(
        _doc(
            tensors={
                "names": [f"{i:x}" for i in range(n)],
                "dtypes": ["bool"] * n,
                "ndims": encode_int_column([ndim] * n),
                "shapes": encode_int_column(shape * n),
                "chunk_counts": encode_int_column([0] * n),
            }
        )
    )


def one_byte_chunks(size: int) -> bytes:
    """One uint8 tensor held by ``size // 4`` one-byte chunks stored in reverse order (the
    overlap check sorts them all)."""
    n = max(1, size // 4)
    return _stored(
        _doc(
            tensors={
                "names": ["t"],
                "dtypes": ["uint8"],
                "ndims": encode_int_column([1]),
                "shapes": encode_int_column([n]),
                "chunk_counts": encode_int_column([n]),
            },
            chunks={
                "offsets": encode_int_column(np.arange(n), delta=True),
                "sizes": encode_int_column(np.ones(n, dtype=np.int64), delta=True),
                "object_index": encode_int_column(np.zeros(n, dtype=np.int64), delta=True),
                "byte_offset": encode_int_column(np.arange(n)[::-1].copy(), delta=True),
                "byte_length": encode_int_column(np.ones(n, dtype=np.int64), delta=True),
                "crc32c": b"\0" * (4 * n),
            },
        )
    )


def empty_dicts(size: int) -> bytes:
    return _stored(_doc(values={"v": msgpack.packb([{}] * size)}))


def unknown_field(size: int) -> bytes:
    return _stored(_doc(future=[{}] * size))


def many_values(size: int) -> bytes:
    n = max(1, size // 6)
    return _stored(_doc(values={f"{i:x}": b"\xc0" for i in range(n)}))


#: name -> (generator, decodes?)
FAMILIES = {
    "empty_chunks_64d": (lambda size: empty_chunks(size, 64), False),
    "empty_chunks_8d": (lambda size: empty_chunks(size, 8), True),
    "empty_tensors": (empty_tensors, True),
    "one_byte_chunks": (one_byte_chunks, True),
    "empty_dicts": (empty_dicts, True),
    "unknown_field": (unknown_field, True),
    "many_values": (many_values, True),
}
