"""Indexes over a manifest's stored chunks, built once per manifest, for load planning.

:class:`ManifestIndex` sorts every non-empty chunk by (tensor, offsets) and checks, vectorised
over all tensors, that each tensor's chunks are slabs along one dimension tiling it exactly (the
usual case: FSDP, tensor parallelism, whole tensors). Requests on such tensors are resolved for
all requests at once by binary search. Any other layout (grids, ragged boxes, columns split at
different rows) is checked for exact cover on first use, the requested tensors in one sweep
(:func:`~cloudckpt.planning.cover_sweep.covers_many`); then requests scan the chunks of small
tensors (vectorised over all requests) and search a per-tensor :class:`ChunkIndex` (a
bounding-box tree) on larger ones.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import numpy.typing as npt

from cloudckpt.errors import CoverageError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.manifest.model import Manifest
from cloudckpt.manifest.records import TensorRecord
from cloudckpt.planning.cover_sweep import covers_many, stable_order
from cloudckpt.planning.coverage import Defect, find_cover_defect, slab_segments_ok, sort_boxes
from cloudckpt.planning.pieces import region_str

#: Chunks per leaf of a :class:`ChunkIndex` tree (a leaf's chunks are tested directly).
LEAF_CHUNKS = 16
#: Tensors of at most this many non-empty chunks are scanned, not searched through a tree.
SCAN_CHUNKS = 1024
#: Most (request, chunk) pairs tested at once by a scan.
SCAN_PAIRS = 1 << 20


def coverage_error(name: str, defect: Defect, what: str = "stored chunks") -> CoverageError:
    """The error for a ``find_cover_defect`` result."""
    kind, o, s = defect
    if kind == "irregular":
        return CoverageError(
            f"tensor {name!r}: {what} are laid out too irregularly to check that they "
            "cover it exactly once; save it with a regular sharding"
        )
    verb = "leave a gap" if kind == "gap" else "overlap"
    return CoverageError(
        f"tensor {name!r}: {what} {verb} at {region_str(o, s)}; "
        "destination elements there would not be filled exactly once"
    )


def _ranges(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(owner, position) for every position of every range ``[start[i], end[i])``."""
    counts = np.maximum(end - start, 0)
    owner = np.repeat(np.arange(len(start), dtype=np.int64), counts)
    pos = np.repeat(start, counts) + (
        np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    )
    return owner, pos


def _segment_reduce(
    ufunc: np.ufunc, values: np.ndarray, start: np.ndarray, end: np.ndarray
) -> np.ndarray:
    """``ufunc.reduce(values[start[i]:end[i]])`` per (non-empty) segment, rows of a 2-d array."""
    padded = np.concatenate((values, values[:1]))
    out: np.ndarray = ufunc.reduceat(padded, np.stack((start, end), axis=1).reshape(-1), axis=0)
    return out[::2]


class ChunkIndex:
    """Chunks of one stored tensor in a bounding-box tree (build it over chunks known to tile the
    tensor exactly: :meth:`ManifestIndex.general` checks first).

    The tree halves the chunks at each level, sorted by centre along the axis where the centres
    spread most relative to the chunks' mean extent (a bounding volume hierarchy, built level by
    level with numpy); a query descends only into
    nodes whose bounding box meets the requested box, so a one-element request tests a few
    leaves of :data:`LEAF_CHUNKS` chunks, not every chunk, whatever the layout. ``tested``
    counts the chunks tested against requests so far (for tests and benchmarks).
    """

    def __init__(self, rec: TensorRecord):
        offsets = np.asarray(rec.chunks.offsets, dtype=np.int64)
        sizes = np.asarray(rec.chunks.sizes, dtype=np.int64)
        self.offsets, self.sizes = offsets, sizes
        self.ends = offsets + sizes
        self.ndim = len(rec.shape)
        self.tested = 0
        self.leaf = (
            np.flatnonzero((sizes > 0).all(axis=1)) if self.ndim else np.arange(len(offsets))
        )
        self._levels: list[tuple[np.ndarray, ...]] = []
        if self.ndim and len(self.leaf):
            self._build()

    def _build(self) -> None:
        """``self.leaf``: the chunks in tree order; per level, its nodes' ranges of ``self.leaf``,
        bounding boxes and first child (the next level's node index, -1 for a leaf)."""
        lo, hi = self.offsets[self.leaf], self.ends[self.leaf]
        centre = lo + hi  # twice the centre, in integers
        perm = np.arange(len(self.leaf), dtype=np.int64)
        start, end = np.zeros(1, np.int64), np.full(1, len(perm), np.int64)
        while len(start):
            split = (end - start) > LEAF_CHUNKS
            inner = np.flatnonzero(split)
            if len(inner):
                c = centre[perm]
                spread = _segment_reduce(np.maximum, c, start[inner], end[inner]) - _segment_reduce(
                    np.minimum, c, start[inner], end[inner]
                )
                extent = _segment_reduce(np.add, (hi - lo)[perm], start[inner], end[inner])
                # thin along an axis relative to the spread there: halves that barely overlap
                axis = np.argmax(
                    spread / np.maximum(extent, 1) * (end - start)[inner, None], axis=1
                )
                owner, pos = _ranges(start[inner], end[inner])
                order = stable_order([owner, c[pos, axis[owner]]])
                perm[pos] = perm[pos[order]]
            bb_lo = _segment_reduce(np.minimum, lo[perm], start, end)
            bb_hi = _segment_reduce(np.maximum, hi[perm], start, end)
            child = np.full(len(start), -1, dtype=np.int64)
            child[inner] = 2 * np.arange(len(inner), dtype=np.int64)
            self._levels.append((start, end, bb_lo, bb_hi, child))
            mid = start[inner] + (end[inner] - start[inner]) // 2
            start = np.stack((start[inner], mid), axis=1).reshape(-1)
            end = np.stack((mid, end[inner]), axis=1).reshape(-1)
        self.leaf = self.leaf[perm]

    def overlapping_many(
        self, req_off: np.ndarray, req_end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For requests ``(m, ndim)``: (request row, chunk index) of every chunk whose box
        overlaps a request box (non-empty overlap)."""
        req_off = np.asarray(req_off, dtype=np.int64).reshape(-1, self.ndim)
        req_end = np.asarray(req_end, dtype=np.int64).reshape(-1, self.ndim)
        m = len(req_off)
        if not self.ndim or not self._levels:
            owner, pos = _ranges(np.zeros(m, np.int64), np.full(m, len(self.leaf), np.int64))
            return owner, self.leaf[pos]
        req = np.arange(m, dtype=np.int64)
        node = np.zeros(m, dtype=np.int64)
        found_r, found_pos = [], []
        for start, end, bb_lo, bb_hi, child in self._levels:
            if not len(req):
                break
            meets = ((bb_lo[node] < req_end[req]) & (bb_hi[node] > req_off[req])).all(axis=1)
            req, node = req[meets], node[meets]
            leaf = child[node] < 0
            owner, pos = _ranges(start[node[leaf]], end[node[leaf]])
            found_r.append(req[leaf][owner])
            found_pos.append(pos)
            req, node = req[~leaf], child[node[~leaf]]
            req, node = np.repeat(req, 2), (node[:, None] + np.arange(2)).reshape(-1)
        r = np.concatenate(found_r) if found_r else np.zeros(0, np.int64)
        pos = np.concatenate(found_pos) if found_pos else np.zeros(0, np.int64)
        chunk = self.leaf[pos]
        self.tested += len(chunk)
        hit = (
            np.minimum(self.ends[chunk], req_end[r]) > np.maximum(self.offsets[chunk], req_off[r])
        ).all(axis=1)
        return r[hit], chunk[hit]

    def overlapping(self, req_off: np.ndarray, req_end: np.ndarray) -> np.ndarray:
        """Indices of the chunks whose box overlaps the request box (non-empty overlap)."""
        return self.overlapping_many(np.asarray(req_off)[None], np.asarray(req_end)[None])[1]


class ManifestIndex:
    """Manifest-wide chunk index (see module doc). Build with :func:`manifest_index`."""

    def __init__(self, m: Manifest):
        cols = m.columns
        n_t = len(cols.names)
        self.tensors = m.tensors  # not the manifest: it keeps this index (no cycle)
        self.names = cols.names
        self.tensor_of = cols.name_index
        self.ndims = cols.ndims
        self.itemsizes = np.array([DTYPE_ITEMSIZE[d] for d in cols.dtypes], dtype=np.int64)
        self.chunk_start = cols.chunk_start
        width = int(self.ndims.max(initial=0)) or 1
        self.width = width
        shape = np.ones((n_t, width), dtype=np.int64)
        shape[np.arange(width) < self.ndims[:, None]] = cols.shape_flat  # tensor-major dims
        self.shape = shape
        counts = np.diff(cols.chunk_start)
        chunk_tensor = np.repeat(np.arange(n_t, dtype=np.int64), counts)
        # only non-empty chunks are indexed: empty ones cost nothing past this point
        chunk_nd = self.ndims[chunk_tensor]
        first_coord = (
            cols.coord_start[chunk_tensor]
            + (np.arange(len(chunk_tensor)) - cols.chunk_start[chunk_tensor]) * chunk_nd
        )
        empty = np.zeros(len(chunk_tensor), dtype=bool)
        with_dims = np.flatnonzero(chunk_nd > 0)
        if len(with_dims):
            empty[with_dims] = np.minimum.reduceat(cols.sizes, first_coord[with_dims]) == 0
        rows = np.flatnonzero(~empty)
        del chunk_nd, empty, with_dims
        owner, coord = _ranges(
            first_coord[rows], first_coord[rows] + self.ndims[chunk_tensor[rows]]
        )
        mask = np.arange(width) < self.ndims[chunk_tensor[rows]][:, None]
        off = np.zeros((len(rows), width), dtype=np.int64)
        size = np.ones((len(rows), width), dtype=np.int64)
        off[mask] = cols.offsets[coord]
        size[mask] = cols.sizes[coord]
        del owner, coord, mask, first_coord
        local = sort_boxes(chunk_tensor[rows], off, n_t)
        order = rows[local]
        self.order = order  # sorted position -> manifest-wide chunk number
        self.s_tensor = chunk_tensor[order]
        self.s_off = off[local]
        self.s_end = self.s_off + size[local]
        self.seg = np.searchsorted(self.s_tensor, np.arange(n_t + 1)).astype(np.int64)
        has_rows = np.flatnonzero(np.diff(self.seg) > 0)
        self.slab_ok = np.zeros(n_t, dtype=bool)
        numel = shape.prod(axis=1)
        self.slab_ok[(np.diff(self.seg) == 0) & (numel == 0)] = True
        if len(has_rows):
            bounds = np.concatenate((self.seg[has_rows], [self.seg[has_rows[-1] + 1]]))
            self.slab_ok[has_rows] = slab_segments_ok(
                bounds, shape[self.s_tensor], self.s_off, self.s_end - self.s_off
            )
        first = self.seg[:-1].clip(max=max(len(order) - 1, 0))
        if len(order):
            nonfull = (self.s_off[first] != 0) | (self.s_end[first] != shape)
        else:
            nonfull = np.zeros((n_t, width), dtype=bool)
        self.axis = np.argmax(nonfull, axis=1).astype(np.int64)
        stride = int(shape[numel > 0].max(initial=1)) + 1  # empty tensors are never searched
        self.vectorised = n_t * stride < (1 << 62)
        if self.vectorised and len(order):
            starts = self.s_off[np.arange(len(order)), self.axis[self.s_tensor]]
            self.stride = stride
            self.key = self.s_tensor * stride + starts
        self._general: dict[int, ChunkIndex] = {}
        self._position: np.ndarray | None = None
        self._dim0: tuple[np.ndarray, np.ndarray] | None = None
        #: per tensor: 1 covered exactly once, -1 gap or overlap, -2 too irregular to check, 0 not
        #: checked yet (slab layouts are checked above, the others by :meth:`check`)
        self.verdict = np.where(self.slab_ok, 1, 0).astype(np.int64)

    def check(self, tensors: npt.ArrayLike) -> None:
        """Run the exact-cover check of those ``tensors`` not checked yet, all in one sweep
        (each gets the verdict it would get alone)."""
        todo = np.unique(np.asarray(tensors, dtype=np.int64))
        todo = todo[self.verdict[todo] == 0]
        if not len(todo):
            return
        n_rows = self.seg[todo + 1] - self.seg[todo]
        self.verdict[todo[n_rows == 0]] = -1  # no chunk holds any of a non-empty tensor
        some = todo[n_rows > 0]
        if len(some):
            owner, pos = _ranges(self.seg[some], self.seg[some + 1])
            verdict = covers_many(self.s_off[pos], self.s_end[pos], owner, self.shape[some])
            self.verdict[some] = np.where(verdict == 1, 1, np.where(verdict == 0, -1, -2))

    def coverage_error(self, t: int) -> CoverageError:
        """The error naming tensor ``t``'s defect (checked, and not covered exactly once)."""
        name = self.names[t]
        if self.verdict[t] == -2:
            return coverage_error(name, ("irregular", (), ()))
        rec = self.tensors[name]
        defect = find_cover_defect(
            rec.shape, np.asarray(rec.chunks.offsets), np.asarray(rec.chunks.sizes)
        )
        return coverage_error(name, defect or ("irregular", (), ()))

    def scan_hits(
        self, t: np.ndarray, req_off: np.ndarray, req_end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For requests on (checked) tensors of few chunks: (request row, sorted chunk position)
        pairs, the chunks tested being those whose dim-0 start lies within the tensor's longest
        dim-0 extent before the request (chunks are sorted by dim-0 offset within a tensor);
        vectorised over all requests, at most :data:`SCAN_PAIRS` pairs at a time."""
        first, last = self.seg[t], self.seg[t + 1]
        if self.vectorised and len(t):
            if self._dim0 is None:
                ext = self.s_end[:, 0] - self.s_off[:, 0]
                longest = np.zeros(len(self.seg) - 1, dtype=np.int64)
                np.maximum.at(longest, self.s_tensor, ext)
                self._dim0 = (self.s_tensor * self.stride + self.s_off[:, 0], longest)
            key0, longest = self._dim0
            base = t * self.stride
            first = np.maximum(
                first, np.searchsorted(key0, base + req_off[:, 0] - longest[t], side="right")
            )
            last = np.minimum(last, np.searchsorted(key0, base + req_end[:, 0], side="left"))
        n = np.maximum(last - first, 0)
        found_r, found_pos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        cut = np.searchsorted(
            np.cumsum(n), np.arange(SCAN_PAIRS, int(n.sum()), SCAN_PAIRS), side="right"
        )
        for lo, hi in zip(
            np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [len(t)])).tolist()
        ):
            owner, pos = _ranges(first[lo:hi], last[lo:hi])
            owner += lo
            hit = (
                np.minimum(self.s_end[pos], req_end[owner])
                > np.maximum(self.s_off[pos], req_off[owner])
            ).all(axis=1)
            found_r.append(owner[hit])
            found_pos.append(pos[hit])
        return np.concatenate(found_r), np.concatenate(found_pos)

    def position_of(self, chunks: np.ndarray) -> np.ndarray:
        """Sorted positions of manifest-wide (non-empty) chunk numbers."""
        if self._position is None:
            position = np.full(int(self.chunk_start[-1]), -1, dtype=np.int64)
            position[self.order] = np.arange(len(self.order), dtype=np.int64)
            self._position = position
        found: np.ndarray = self._position[chunks]
        return found

    def general(self, t: int) -> ChunkIndex:
        """Tensor ``t``'s lookup tree; raises its :class:`CoverageError` when its chunks do not
        cover it exactly once."""
        idx = self._general.get(t)
        if idx is None:
            self.check([t])
            if self.verdict[t] != 1:
                raise self.coverage_error(t)
            idx = self._general[t] = ChunkIndex(self.tensors[self.names[t]])
        return idx

    def slab_hits(
        self, t: np.ndarray, req_off: np.ndarray, req_end: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """For requests on slab tensors (padded boxes): (request row, sorted chunk position)
        pairs."""
        k = self.axis[t]
        rows = np.arange(len(t))
        a, b = req_off[rows, k], req_end[rows, k]
        lo = np.searchsorted(self.key, t * self.stride + a, side="right") - 1
        lo = np.maximum(lo, self.seg[t])
        hi = np.searchsorted(self.key, t * self.stride + b, side="left")
        counts = np.maximum(hi - lo, 0)
        req = np.repeat(rows, counts)
        pos = np.repeat(lo, counts) + (
            np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
        )
        return req, pos


def manifest_index(m: Manifest) -> ManifestIndex:
    """The index of ``m``, built once per manifest (kept in :meth:`Manifest.derived`)."""
    index: ManifestIndex = m.derived("planning.chunk_index", ManifestIndex)
    return index


def coverage_errors(m: Manifest) -> list[CoverageError]:
    """The :class:`CoverageError` load planning raises for each tensor of ``m`` whose non-empty
    chunks do not cover it exactly once (the same check and verdicts), in tensor order."""
    idx = manifest_index(m)
    idx.check(np.flatnonzero(idx.verdict == 0))
    return [idx.coverage_error(t) for t in np.flatnonzero(idx.verdict < 0).tolist()]


def padded_rows(
    rows: Iterable[Iterable[int]], ndims: np.ndarray, width: int, fill: int
) -> np.ndarray:
    """An ``(len(ndims), width)`` int64 array whose row ``i`` holds the ``ndims[i]`` integers of
    ``rows[i]`` (an iterable of sequences), then ``fill``: ragged shapes, offsets or lengths
    as one array, for planning many regions at once."""
    out = np.full((len(ndims), width), fill, dtype=np.int64)
    out[np.arange(width) < ndims[:, None]] = np.fromiter(
        itertools.chain.from_iterable(rows), np.int64, int(ndims.sum())
    )
    return out
