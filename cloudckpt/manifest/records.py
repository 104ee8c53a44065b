"""The records a manifest hands out: chunks, tensors and its read-only columns.

:class:`ChunkTable` and :class:`ManifestColumns` are views over the manifest's flat, read-only
numpy arrays (see :mod:`cloudckpt.manifest.model`); :class:`ChunkRecord` objects are made only
when asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np
from numpy.typing import NDArray

from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE

__all__ = [
    "ChunkRecord",
    "ChunkTable",
    "ManifestColumns",
    "TensorMap",
    "TensorRecord",
    "record_of",
    "shape_of",
]


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One stored chunk: a box of a tensor and where its bytes are."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    object_index: int
    byte_offset: int
    byte_length: int
    crc32c: tuple[int, ...]  # one per checksum block of the chunk's bytes


class ChunkTable(Sequence[ChunkRecord]):
    """The chunks of one tensor: a read-only sequence of :class:`ChunkRecord` over arrays.

    Array attributes (read-only): ``offsets`` and ``sizes`` (shape ``(n, ndim)``),
    ``object_index``, ``byte_offset``, ``byte_length`` (shape ``(n,)``); ``crcs(i)`` gives chunk
    ``i``'s crcs.
    """

    __slots__ = (
        "offsets",
        "sizes",
        "object_index",
        "byte_offset",
        "byte_length",
        "_crc_start",
        "_crcs",
    )

    def __init__(
        self,
        offsets: NDArray[np.int64],
        sizes: NDArray[np.int64],
        object_index: NDArray[np.int64],
        byte_offset: NDArray[np.int64],
        byte_length: NDArray[np.int64],
        crc_start: NDArray[np.int64],
        crcs: NDArray[np.uint32],
    ):
        self.offsets = offsets
        self.sizes = sizes
        self.object_index = object_index
        self.byte_offset = byte_offset
        self.byte_length = byte_length
        self._crc_start = crc_start
        self._crcs = crcs

    def __len__(self) -> int:
        return len(self.byte_length)

    def crcs(self, i: int) -> tuple[int, ...]:
        return tuple(self._crcs[self._crc_start[i] : self._crc_start[i + 1]].tolist())

    @overload
    def __getitem__(self, i: int) -> ChunkRecord: ...
    @overload
    def __getitem__(self, i: slice) -> list[ChunkRecord]: ...
    def __getitem__(self, i: int | slice) -> ChunkRecord | list[ChunkRecord]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return ChunkRecord(
            tuple(self.offsets[i].tolist()),
            tuple(self.sizes[i].tolist()),
            int(self.object_index[i]),
            int(self.byte_offset[i]),
            int(self.byte_length[i]),
            self.crcs(i),
        )

    def __iter__(self) -> Iterator[ChunkRecord]:
        return (self[i] for i in range(len(self)))


@dataclass(frozen=True, eq=False)
class TensorRecord:
    """One stored tensor: dtype, global shape and its chunks."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    chunks: ChunkTable

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, slots=True, eq=False)
class ManifestColumns:
    """A manifest's columns, read-only (every array has ``flags.writeable == False``; writing
    raises ``ValueError``). Tensors in tensor order: ``names``, ``dtypes``, ``name_index``
    (name -> tensor number), ``ndims``, ``shape_flat`` (every shape's dims concatenated, tensor
    ``t``'s at ``shape_start[t]:shape_start[t + 1]``), ``chunk_start`` (tensor ``t``'s chunks are
    ``chunk_start[t]:chunk_start[t + 1]``), ``coord_start`` (the same for coordinates). Per chunk,
    grouped by tensor: ``object_index``, ``byte_offset``, ``byte_length``, ``crc_start`` (chunk
    ``c``'s crcs are ``crcs[crc_start[c]:crc_start[c + 1]]``); ``offsets`` / ``sizes`` flat,
    chunk-major (each chunk its tensor's ndim numbers). ``value_blobs``: name -> encoded value.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    name_index: Mapping[str, int]
    ndims: NDArray[np.int64]
    shape_flat: NDArray[np.int64]
    shape_start: NDArray[np.int64]
    chunk_start: NDArray[np.int64]
    coord_start: NDArray[np.int64]
    offsets: NDArray[np.int64]
    sizes: NDArray[np.int64]
    object_index: NDArray[np.int64]
    byte_offset: NDArray[np.int64]
    byte_length: NDArray[np.int64]
    crcs: NDArray[np.uint32]
    crc_start: NDArray[np.int64]
    value_blobs: Mapping[str, bytes]


class TensorMap(Mapping[str, TensorRecord]):
    """A manifest's ``tensors``: name -> TensorRecord, built lazily from its columns. Holds the
    columns, not the manifest: no reference cycle, so a manifest (and its arrays) is freed as
    soon as it is dropped, never left for the garbage collector."""

    def __init__(self, columns: ManifestColumns, shapes: tuple[tuple[int, ...], ...] | None):
        self._cols = columns
        self._shapes = shapes
        self._cache: dict[str, TensorRecord] = {}

    def __getitem__(self, name: str) -> TensorRecord:
        rec = self._cache.get(name)
        if rec is None:
            rec = record_of(self._cols, self._shapes, self._cols.name_index[name])
            self._cache[name] = rec
        return rec

    def __contains__(self, name: object) -> bool:
        return name in self._cols.name_index

    def __iter__(self) -> Iterator[str]:
        return iter(self._cols.names)

    def __len__(self) -> int:
        return len(self._cols.names)


def shape_of(
    cols: ManifestColumns, shapes: tuple[tuple[int, ...], ...] | None, t: int
) -> tuple[int, ...]:
    """Tensor ``t``'s shape: from ``shapes`` when made, else from the flat shape column."""
    if shapes is not None:
        return shapes[t]
    return tuple(cols.shape_flat[cols.shape_start[t] : cols.shape_start[t + 1]].tolist())


def record_of(
    cols: ManifestColumns, shapes: tuple[tuple[int, ...], ...] | None, t: int
) -> TensorRecord:
    """Tensor ``t``'s record; its chunk table views the columns (no copy)."""
    c0, c1 = int(cols.chunk_start[t]), int(cols.chunk_start[t + 1])
    k0, k1 = int(cols.coord_start[t]), int(cols.coord_start[t + 1])
    nd = int(cols.ndims[t])
    table = ChunkTable(
        cols.offsets[k0:k1].reshape(c1 - c0, nd),
        cols.sizes[k0:k1].reshape(c1 - c0, nd),
        cols.object_index[c0:c1],
        cols.byte_offset[c0:c1],
        cols.byte_length[c0:c1],
        cols.crc_start[c0 : c1 + 1] - cols.crc_start[c0],
        cols.crcs[cols.crc_start[c0] : cols.crc_start[c1]],
    )
    return TensorRecord(cols.names[t], cols.dtypes[t], shape_of(cols, shapes, t), table)
