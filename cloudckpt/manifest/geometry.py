"""The tensors of a manifest and the geometry of their chunks, checked.

:func:`tensor_columns` checks the per-tensor arguments of a ``Manifest`` (names, dtypes, shapes,
chunk counts) into :class:`TensorColumns`; :func:`check_boxes` and :func:`check_no_shared_bytes`
check that every chunk's box lies inside its tensor and that no stored byte belongs to two
chunks. Pure (numpy); every problem is a :class:`~cloudckpt.errors.ManifestError` naming its path.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import ArrayLike, NDArray

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_NDIM
from cloudckpt.manifest.validation import check_shape, flat_dims, tensor_path

_S = TypeVar("_S", bound=np.generic)


def read_only(a: ArrayLike, dtype: type[_S]) -> NDArray[_S]:
    """A read-only 1-D copy of ``a``; an array that already is one (the decoder's, which owns
    its data) is taken as it is."""
    if (
        isinstance(a, np.ndarray)
        and a.dtype == dtype
        and a.ndim == 1
        and a.base is None
        and not a.flags.writeable
    ):
        return a
    arr = np.array(a, dtype=dtype, copy=True).reshape(-1)
    arr.flags.writeable = False
    return arr


#: Coordinates checked at once (bounds the temporary memory of validation).
_BLOCK = 1 << 16


@dataclass(frozen=True, eq=False)
class TensorColumns:
    """The tensors of a manifest, in tensor order, read-only: ``names``, ``dtypes``,
    ``name_index`` (name -> tensor number), ``ndims``, ``numel``, ``shape_flat`` (every shape's
    dims concatenated, tensor ``t``'s at ``shape_start[t]:shape_start[t + 1]``), ``chunk_start``
    and ``coord_start`` (where tensor ``t``'s chunks and their coordinates start); ``shapes``:
    the shapes as tuples when they were given so, else None."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    name_index: dict[str, int]
    ndims: NDArray[np.int64]
    numel: NDArray[np.int64]
    shape_flat: NDArray[np.int64]
    shape_start: NDArray[np.int64]
    chunk_start: NDArray[np.int64]
    coord_start: NDArray[np.int64]
    shapes: tuple[tuple[int, ...], ...] | None

    def shape(self, t: int) -> tuple[int, ...]:
        """Tensor ``t``'s shape."""
        if self.shapes is not None:
            return self.shapes[t]
        return tuple(self.shape_flat[self.shape_start[t] : self.shape_start[t + 1]].tolist())

    def chunk_path(self, chunk: int, field: str = "") -> str:
        """The manifest path of chunk ``chunk`` (numbered over all tensors), like
        ``tensors["w"].chunks[3]``, followed by ``field``."""
        t = int(np.searchsorted(self.chunk_start, chunk, side="right")) - 1
        return f"{tensor_path(self.names[t])}.chunks[{chunk - int(self.chunk_start[t])}]{field}"


def tensor_columns(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]] | NDArray[np.int64],
    ndims: ArrayLike | None,
    counts: ArrayLike,
) -> TensorColumns:
    """The per-tensor arguments of ``Manifest``, checked, as columns: ``shapes`` a sequence of
    shapes (``ndims`` None) or every dim in one array (``ndims`` per tensor, the decoder's
    form); ``counts`` chunks per tensor."""
    given: tuple[tuple[int, ...], ...] | None = None
    names, dtypes = tuple(names), tuple(dtypes)
    n = len(names)
    if ndims is None:  # a sequence of shapes
        given = tuple(s if type(s) is tuple else tuple(s) for s in shapes)
        if len(given) != n:
            raise ManifestError("tensor names, dtypes and shapes differ in length", path="tensors")
        shapes = given
        ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
        flat = flat_dims(shapes, int(ndims.sum())) if n and ndims.max() <= MAX_NDIM else None
    else:  # columnar: every dim in one array
        ndims, flat = read_only(ndims, np.int64), read_only(shapes, np.int64)
        if (
            len(ndims) != n
            or (n and (ndims.min() < 0 or ndims.max() > MAX_NDIM))
            or int(ndims.sum()) != len(flat)
        ):
            raise ManifestError("tensor shapes do not match the tensors", path="tensors")
    if len(dtypes) != n:
        raise ManifestError("tensor names, dtypes and shapes differ in length", path="tensors")
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        if type(name) is not str:
            raise ManifestError(
                f"tensor name must be a string, got {type(name).__name__}", path=f"tensors[{i}]"
            )
        if name in index:
            raise ManifestError("duplicate tensor name", path=tensor_path(name))
        index[name] = i
    for name, dtype in zip(names, dtypes):
        if type(dtype) is not str or dtype not in DTYPE_ITEMSIZE:
            raise ManifestError(
                f"dtype {dtype!r:.80} is not allowed", path=f"{tensor_path(name)}.dtype"
            )
    starts = np.concatenate(([0], np.cumsum(ndims))).astype(np.int64)
    has = ndims > 0
    if flat is None:  # odd dims (not ints, beyond int64, too many): check one by one
        for t in range(n):
            check_shape(names[t], dtypes[t], shapes[t])
        flat = np.fromiter(
            itertools.chain.from_iterable(shapes), dtype=np.int64, count=int(starts[-1])
        )
    elif flat.size:  # vectorised; suspects get the exact check
        negative = np.zeros(n, dtype=bool)
        negative[has] = np.minimum.reduceat(flat, starts[:-1][has]) < 0
        logs = flat.astype(np.float64)
        np.log2(np.maximum(logs, 1.0, out=logs), out=logs)
        log_bytes = np.log2([DTYPE_ITEMSIZE[d] for d in dtypes])
        log_bytes[has] += np.add.reduceat(logs, starts[:-1][has])
        del logs
        for t in np.flatnonzero(negative | (log_bytes > 59.5)).tolist():
            check_shape(names[t], dtypes[t], tuple(flat[starts[t] : starts[t + 1]].tolist()))
    numel = np.ones(n, dtype=np.int64)  # no overflow: every product is at most 2**60
    if has.any():
        numel[has] = np.multiply.reduceat(flat, starts[:-1][has])
    counts = np.asarray(counts, dtype=np.int64).reshape(-1)
    if len(counts) != n:
        raise ManifestError("chunk counts do not match the tensors", path="tensors")
    if n and counts.min() < 0:
        raise ManifestError("negative chunk count", path=tensor_path(names[int(np.argmin(counts))]))
    chunk_start = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    coord_start = np.concatenate(([0], np.cumsum(counts * ndims))).astype(np.int64)
    for arr in (flat, starts, ndims, numel, chunk_start, coord_start):
        arr.flags.writeable = False
    return TensorColumns(
        names=names,
        dtypes=dtypes,
        name_index=index,
        ndims=ndims,
        numel=numel,
        shape_flat=flat,
        shape_start=starts,
        chunk_start=chunk_start,
        coord_start=coord_start,
        shapes=given,
    )


def check_boxes(
    tensors: TensorColumns,
    offsets: NDArray[np.int64],
    sizes: NDArray[np.int64],
    chunk_tensor: NDArray[np.int64],
    chunk_ndim: NDArray[np.int64],
    chunk_coord_start: NDArray[np.int64],
) -> None:
    """Every chunk's box lies inside its tensor's shape (checked block by block)."""
    shape_flat, shape_start = tensors.shape_flat, tensors.shape_start
    for a in range(0, len(offsets), _BLOCK):
        pos = np.arange(a, min(a + _BLOCK, len(offsets)), dtype=np.int64)
        # chunk of each coordinate: the last one starting at or before it (0-dim chunks
        # start where the next one does)
        chunk = np.searchsorted(chunk_coord_start, pos, side="right") - 1
        limit = shape_flat[shape_start[chunk_tensor[chunk]] + pos - chunk_coord_start[chunk]]
        off, size = offsets[pos[0] : pos[-1] + 1], sizes[pos[0] : pos[-1] + 1]
        bad = (size < 0) | (off < 0) | (off > limit) | (size > limit - off)
        if bad.any():
            c = int(chunk[int(np.flatnonzero(bad)[0])])
            s, nd = int(chunk_coord_start[c]), int(chunk_ndim[c])
            box = tuple(offsets[s : s + nd].tolist()), tuple(sizes[s : s + nd].tolist())
            raise ManifestError(
                f"box offsets={box[0]} sizes={box[1]} "
                f"is not inside shape {tensors.shape(int(chunk_tensor[c]))}",
                path=tensors.chunk_path(c),
            )


def check_no_shared_bytes(
    tensors: TensorColumns,
    objects: Sequence[str],
    object_index: NDArray[np.int64],
    byte_offset: NDArray[np.int64],
    byte_length: NDArray[np.int64],
) -> None:
    """No two chunks' byte ranges in one object overlap (O(n log n)): one stored byte
    belongs to one chunk, so the bytes referenced never exceed the bytes stored."""
    held = np.flatnonzero(byte_length > 0)
    order = held[np.lexsort((byte_offset[held], object_index[held]))]
    del held
    if len(order) < 2:
        return
    obj, start = object_index[order], byte_offset[order]
    end = start + byte_length[order]
    bad = (obj[1:] == obj[:-1]) & (start[1:] < end[:-1])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        first, second = int(order[i]), int(order[i + 1])
        raise ManifestError(
            f"bytes [{int(start[i + 1])}, {int(end[i + 1])}) of object "
            f"{objects[int(obj[i])]!r} are also those of {tensors.chunk_path(first)} "
            f"([{int(start[i])}, {int(end[i])}))",
            path=tensors.chunk_path(second),
        )
