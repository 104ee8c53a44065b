"""Indexes over a manifest's stored chunks, built once per manifest, for load planning.

:class:`ManifestIndex` sorts every non-empty chunk by (tensor, offsets) and checks, vectorised
over all tensors, that each tensor's chunks are slabs along one dimension tiling it exactly (the
usual case: FSDP, tensor parallelism, whole tensors). Requests on such tensors are resolved for
all requests at once by binary search. Any other layout (grids, ragged boxes) gets a per-tensor
:class:`ChunkIndex` (sorted along the dimension where chunk starts differ most), built on first
use, after a full exact-cover check.
"""

from __future__ import annotations

import numpy as np

from cloudckpt.errors import CoverageError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.manifest.model import Manifest, TensorRecord
from cloudckpt.planning.coverage import find_cover_defect, slab_segments_ok, sort_boxes
from cloudckpt.planning.pieces import region_str


class ChunkIndex:
    """Chunks of one stored tensor, verified to tile it exactly, sorted along one axis."""

    def __init__(self, rec: TensorRecord):
        offsets = np.asarray(rec.chunks.offsets, dtype=np.int64)
        sizes = np.asarray(rec.chunks.sizes, dtype=np.int64)
        defect = find_cover_defect(rec.shape, offsets, sizes)
        if defect is not None:
            kind, o, s = defect
            what = "leave a gap" if kind == "gap" else "overlap"
            raise CoverageError(f"tensor {rec.name!r}: stored chunks {what} at {region_str(o, s)}; "
                                "destination elements there would not be filled exactly once")
        nonempty = np.flatnonzero(sizes.prod(axis=1) > 0)
        self.offsets, self.sizes = offsets, sizes
        self.ends = offsets + sizes
        d = len(rec.shape)
        self.axis = int(np.argmax([len(np.unique(offsets[nonempty, j])) for j in range(d)])) if d else -1
        if d:
            self.order = nonempty[np.argsort(offsets[nonempty, self.axis], kind="stable")]
            self.starts = offsets[self.order, self.axis]
            self.max_size = int(sizes[self.order, self.axis].max(initial=0))
        else:
            self.order = nonempty

    def overlapping(self, req_off: np.ndarray, req_end: np.ndarray) -> np.ndarray:
        """Indices of the chunks whose box overlaps the request box (non-empty overlap)."""
        if self.axis < 0:
            return self.order
        k = self.axis
        lo = np.searchsorted(self.starts, req_off[k] - self.max_size, side="right")
        hi = np.searchsorted(self.starts, req_end[k], side="left")
        cand = self.order[lo:hi]
        inter = np.minimum(self.ends[cand], req_end) > np.maximum(self.offsets[cand], req_off)
        return cand[inter.all(axis=1)]


class ManifestIndex:
    """Manifest-wide chunk index (see module doc). Build with :func:`manifest_index`."""

    def __init__(self, m: Manifest):
        names = m._names
        n_t = len(names)
        self.manifest = m
        self.tensor_of = m._name_index
        self.ndims = m._ndims
        self.itemsizes = np.array([DTYPE_ITEMSIZE[d] for d in m._dtypes], dtype=np.int64)
        self.chunk_start = m._chunk_start
        width = int(self.ndims.max(initial=0)) or 1
        self.width = width
        shape = np.ones((n_t, width), dtype=np.int64)
        for t, s in enumerate(m._shapes):
            shape[t, :len(s)] = s
        self.shape = shape
        counts = np.diff(m._chunk_start)
        chunk_tensor = np.repeat(np.arange(n_t, dtype=np.int64), counts)
        n = len(chunk_tensor)
        off = np.zeros((n, width), dtype=np.int64)
        size = np.ones((n, width), dtype=np.int64)
        mask = np.arange(width) < self.ndims[chunk_tensor][:, None]
        off[mask] = m._offsets
        size[mask] = m._sizes
        rows = np.flatnonzero(size.prod(axis=1) > 0)
        order = rows[sort_boxes(chunk_tensor[rows], off[rows], n_t)]
        self.order = order  # sorted position -> manifest-wide chunk number
        self.s_tensor = chunk_tensor[order]
        self.s_off = off[order]
        self.s_end = self.s_off + size[order]
        self.seg = np.searchsorted(self.s_tensor, np.arange(n_t + 1)).astype(np.int64)
        has_rows = np.flatnonzero(np.diff(self.seg) > 0)
        self.slab_ok = np.zeros(n_t, dtype=bool)
        numel = shape.prod(axis=1)
        self.slab_ok[(np.diff(self.seg) == 0) & (numel == 0)] = True
        if len(has_rows):
            bounds = np.concatenate((self.seg[has_rows], [self.seg[has_rows[-1] + 1]]))
            self.slab_ok[has_rows] = slab_segments_ok(bounds, shape[self.s_tensor], self.s_off, self.s_end - self.s_off)
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

    def position_of(self, chunks: np.ndarray) -> np.ndarray:
        """Sorted positions of manifest-wide (non-empty) chunk numbers."""
        if self._position is None:
            position = np.full(int(self.chunk_start[-1]), -1, dtype=np.int64)
            position[self.order] = np.arange(len(self.order), dtype=np.int64)
            self._position = position
        return self._position[chunks]

    def general(self, t: int) -> ChunkIndex:
        idx = self._general.get(t)
        if idx is None:
            idx = self._general[t] = ChunkIndex(self.manifest.tensors[self.manifest._names[t]])
        return idx

    def slab_hits(self, t: np.ndarray, req_off: np.ndarray, req_end: np.ndarray):
        """For requests on slab tensors (padded boxes): (request row, sorted chunk position) pairs."""
        k = self.axis[t]
        rows = np.arange(len(t))
        a, b = req_off[rows, k], req_end[rows, k]
        lo = np.searchsorted(self.key, t * self.stride + a, side="right") - 1
        lo = np.maximum(lo, self.seg[t])
        hi = np.searchsorted(self.key, t * self.stride + b, side="left")
        counts = np.maximum(hi - lo, 0)
        req = np.repeat(rows, counts)
        pos = np.repeat(lo, counts) + (np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts))
        return req, pos


def manifest_index(m: Manifest) -> ManifestIndex:
    """The (cached) index of ``m``."""
    idx = m.__dict__.get("_cloudckpt_index")
    if idx is None:
        idx = m.__dict__["_cloudckpt_index"] = ManifestIndex(m)
    return idx
