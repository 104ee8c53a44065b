"""Exact-cover checks: do boxes tile a tensor with no gap and no overlap?

Boxes are given as ``(n, ndim)`` int arrays of offsets and sizes, already known to lie inside the
shape. :func:`find_cover_defect` handles any layout: slabs along one dimension (FSDP, tensor
parallel) and regular grids (TP x FSDP) directly, everything else (irregular grids, ragged
boxes, staircases, columns split at different rows) by the signed sweep of
:mod:`cloudckpt.planning.cover_sweep`, in ``O(n log n)`` per axis along which boxes differ for
the layouts it was measured on, with a hard bound on its work.
:func:`slab_segments_ok` checks the common slab case for many tensors at once, vectorised.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal, SupportsInt

import numpy as np
import numpy.typing as npt

from cloudckpt.planning import cover_sweep
from cloudckpt.planning.cover_sweep import stable_order

#: (kind: "gap" | "overlap" | "irregular", offsets, sizes) of a region that is not covered
#: exactly once.
Defect = tuple[str, tuple[int, ...], tuple[int, ...]]


def _slab_defect(
    shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray
) -> Defect | None | Literal[False]:
    """Defect for boxes that are all slabs along one common dim; None if ok; False if not slabs."""
    n, d = offsets.shape
    full = (offsets == 0) & (sizes == np.asarray(shape, dtype=np.int64))
    nonfull = ~full
    counts = nonfull.sum(axis=1)
    if (counts > 1).any():
        return False
    if not counts.any():
        return None if n == 1 else ("overlap", (0,) * d, tuple(shape))
    if not counts.all():  # one box spans everything, others exist
        i = int(np.flatnonzero(counts)[0])
        return ("overlap", tuple(offsets[i].tolist()), tuple(sizes[i].tolist()))
    ks = np.argmax(nonfull, axis=1)
    k = int(ks[0])
    if (ks != k).any():
        return False
    order = np.argsort(offsets[:, k], kind="stable")
    start = offsets[order, k]
    end = start + sizes[order, k]

    def region(lo: int, hi: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        o = [0] * d
        s = list(shape)
        o[k], s[k] = lo, hi - lo
        return tuple(o), tuple(s)

    if start[0] > 0:
        return ("gap", *region(0, int(start[0])))
    nxt = start[1:]
    prev_end = np.maximum.accumulate(end)[:-1]
    bad = np.flatnonzero(nxt != prev_end)
    if len(bad):
        i = int(bad[0])
        lo, pe = int(nxt[i]), int(prev_end[i])
        if lo < pe:
            return ("overlap", *region(lo, min(pe, int(end[i + 1]))))
        return ("gap", *region(pe, lo))
    if int(end[-1]) < shape[k]:
        return ("gap", *region(int(end[-1]), shape[k]))
    return None


def _is_exact_grid(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray) -> bool:
    """True when the boxes are the cells of a regular grid that tiles ``shape`` exactly once:
    along every dim, boxes starting at one offset have one size and those intervals tile the
    dim, and every combination of intervals is one box (a TP x FSDP 2-D layout). False says
    nothing (not such a grid, or a defect): the caller checks another way."""
    n = len(offsets)
    cells = 1
    code = np.zeros(n, dtype=np.int64)
    for j in range(len(shape)):
        starts, inv = np.unique(offsets[:, j], return_inverse=True)
        widths = np.zeros(len(starts), dtype=np.int64)
        widths[inv] = sizes[:, j]
        if (widths[inv] != sizes[:, j]).any():
            return False
        ends = starts + widths
        if starts[0] != 0 or ends[-1] != shape[j] or (starts[1:] != ends[:-1]).any():
            return False
        cells *= len(starts)
        if cells > n:
            return False
        code = code * len(starts) + inv
    return cells == n and len(np.unique(code)) == n


def find_cover_defect(
    shape: Iterable[SupportsInt], offsets: npt.ArrayLike, sizes: npt.ArrayLike
) -> Defect | None:
    """Return None if the boxes cover ``shape`` exactly once, else ``(kind, offsets, sizes)``.

    ``kind`` is ``"gap"`` (elements no box covers) or ``"overlap"`` (elements covered twice);
    the region is a box inside the defect. Empty boxes are ignored. ``"irregular"`` (region: the
    whole tensor) means the layout needs more work than :mod:`cover_sweep` allows for its size
    (no layout cloudckpt saves comes near it): callers refuse it like a defect.
    """
    shape_ = tuple(int(s) for s in shape)
    d = len(shape_)
    off = np.asarray(offsets, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    if off.ndim != 2:  # flat input: only meaningful for ndim >= 1
        off, size = off.reshape(-1, max(d, 1))[:, :d], size.reshape(-1, max(d, 1))[:, :d]
    keep = (size > 0).all(axis=1) if d else np.ones(len(size), dtype=bool)
    off, size = off[keep], size[keep]
    n = len(off)
    if math.prod(shape_) == 0:
        return None
    if n == 0:
        return ("gap", (0,) * d, shape_)
    if d == 0:
        return None if n == 1 else ("overlap", (), ())
    slab = _slab_defect(shape_, off, size)
    if slab is not False:
        return slab
    if _is_exact_grid(shape_, off, size):
        return None
    try:
        return cover_sweep.find_defect(shape_, off, size)
    except cover_sweep.TooIrregular:
        return ("irregular", (0,) * d, shape_)


def slab_segments_ok(
    seg_start: np.ndarray, row_shape: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
) -> np.ndarray:
    """Vectorised fast path over many tensors at once.

    Rows (non-empty boxes, padded to a common width with offset 0 / size 1 / shape 1) are sorted
    by tensor then offsets; segment ``i`` is rows ``seg_start[i]:seg_start[i+1]`` (non-empty).
    ``row_shape`` gives each row's tensor shape. Returns, per segment, True when its boxes are
    slabs along one dim that tile the tensor exactly; False means "check it with
    :func:`find_cover_defect`" (a defect, or a layout this fast path does not cover).
    """
    n = len(offsets)
    nseg = len(seg_start) - 1
    if nseg == 0:
        return np.zeros(0, dtype=bool)
    nonfull = (offsets != 0) | (sizes != row_shape)
    count = nonfull.sum(axis=1)
    k = np.argmax(nonfull, axis=1)
    rows = np.arange(n)
    start = offsets[rows, k]
    end = start + sizes[rows, k]
    limit = row_shape[rows, k]
    first = np.zeros(n, dtype=bool)
    first[seg_start[:-1]] = True
    last = np.zeros(n, dtype=bool)
    last[seg_start[1:] - 1] = True
    seg_len = np.diff(seg_start)
    row_len = np.repeat(seg_len, seg_len)
    bad = count > 1
    bad |= (count == 0) & (row_len != 1)
    bad |= first & (start != 0)
    bad |= last & (end != limit)
    prev_ok = np.ones(n, dtype=bool)
    prev_ok[1:] = (k[1:] == k[:-1]) & (start[1:] == end[:-1]) & (count[1:] == 1) & (count[:-1] == 1)
    bad |= ~first & ~prev_ok
    return ~np.logical_or.reduceat(bad, seg_start[:-1])


def sort_boxes(tensor: np.ndarray, offsets: np.ndarray, n_tensors: int) -> np.ndarray:
    """Stable order of rows by (tensor id, offsets lexicographic); ``offsets`` is ``(n, width)``."""
    del n_tensors  # (kept for callers; the bit width comes from the data)
    return stable_order([tensor] + [offsets[:, j] for j in range(offsets.shape[1])])
