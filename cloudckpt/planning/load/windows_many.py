"""Windows of many regions at once (:func:`plan_windows_many`, :func:`plan_run_windows_many`).

A load plans windows for every region it reads or shares (hundreds of small tensors are
usual), so the regions are located together, with array arithmetic; only the windows
themselves are made one by one. A region that fits in one window (the usual case) gets the
same window the one-region functions give, with its whole box as one sub-box; any other one
(several windows, odd block sizes, an unknown name or chunk, a region past its chunk, a
manifest without checksums) goes through the one-region functions, which raise what they
raise.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.load.chunk_index import padded_rows
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import (
    BlockRead,
    RunWindow,
    SubBox,
    Window,
    chunk_columns,
    plan_run_windows,
    plan_windows,
)


class _Located:
    """The places of many regions in their chunks, as columns (one region: ``_locate`` of
    :mod:`cloudckpt.planning.load.windows`)."""

    def __init__(self, manifest: Manifest, regions: Sequence[Region]):
        g = chunk_columns(manifest)
        n = len(regions)
        t = np.fromiter((g.name_index.get(r.name, -1) for r in regions), np.int64, n)
        ci = np.fromiter((r.chunk_index for r in regions), np.int64, n)
        nds = np.fromiter((len(r.lengths) for r in regions), np.int64, n)
        width = int(nds.max(initial=0))
        mask = np.arange(width) < nds[:, None]
        off = padded_rows((r.src_offsets for r in regions), nds, width, 0)
        lengths = padded_rows((r.lengths for r in regions), nds, width, 1)
        ok = t >= 0
        tt = np.where(ok, t, 0)
        c0 = g.chunk_start[tt]
        ok &= (ci >= 0) & (ci < g.chunk_start[tt + 1] - c0) & (g.ndims[tt] == nds)
        ci = np.where(ok, ci, 0)
        c = c0 + ci
        sizes = np.ones((n, width), dtype=np.int64)
        take = mask & ok[:, None]
        sizes[take] = g.sizes[((g.coord_start[tt] + ci * nds)[:, None] + np.arange(width))[take]]
        strides = np.ones((n, width), dtype=np.int64)
        if width > 1:  # row-major, a zero size counting as one (padding dims are 1 at the end)
            strides[:, :-1] = np.cumprod(np.maximum(sizes[:, :0:-1], 1), axis=1)[:, ::-1]
        first = (off * strides).sum(axis=1)
        last = ((off + lengths - 1) * strides).sum(axis=1)
        numel = lengths.prod(axis=1)
        itemsize = (
            np.asarray(g.itemsizes, dtype=np.int64)[tt]
            if g.itemsizes
            else np.zeros(n, dtype=np.int64)
        )
        byte_length = g.byte_length[c]
        ok &= (numel > 0) & ((last + 1) * itemsize <= byte_length)
        self.ok, self.nds, self.strides, self.lengths = ok, nds, strides, lengths
        self.first, self.last, self.numel, self.itemsize = first, last, numel, itemsize
        self.byte_offset, self.byte_length = g.byte_offset[c], byte_length
        self.object_index, self.crc_lo, self.crcs = g.object_index[c], g.crc_start[c], g.crcs

    def blocks(self, block: int, max_bytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per region: its first block, one past its last, and whether they make one window of
        at most ``max_bytes`` (a region a fast path can take)."""
        b = self.first * self.itemsize // block
        b_end = -(-(self.last + 1) * self.itemsize // block)
        one = (
            self.ok
            & (block % np.maximum(self.itemsize, 1) == 0)
            & (b_end - b <= max(1, max_bytes // block))
        )
        return b, b_end, one

    def block_crcs(
        self, lo: np.ndarray, hi: np.ndarray, rows: np.ndarray
    ) -> list[tuple[int, ...] | None]:
        """Per region, the crcs of its chunk's blocks ``lo .. hi - 1`` where ``rows`` (valid
        regions only) says so, None elsewhere."""
        out: list[tuple[int, ...] | None] = [None] * len(rows)
        pick = np.flatnonzero(rows)
        start, end = (self.crc_lo + lo)[pick], (self.crc_lo + hi)[pick]
        single = self.crcs[start].tolist()
        for i, s, e, c in zip(pick.tolist(), start.tolist(), end.tolist(), single):
            out[i] = (c,) if e - s == 1 else tuple(self.crcs[s:e].tolist())
        return out


def plan_windows_many(
    manifest: Manifest, regions: Sequence[Region], max_bytes: int
) -> list[list[Window]]:
    """:func:`plan_windows` of each of ``regions`` (same windows, same errors), located
    together."""
    if not manifest.checksums or not regions:
        return [plan_windows(manifest, r, max_bytes) for r in regions]
    at = _Located(manifest, regions)
    block = manifest.checksum_block_size
    b, b_end, one = at.blocks(block, max_bytes)
    lo_byte = b * block
    hi_byte = np.minimum(b_end * block, at.byte_length)
    crcs = at.block_crcs(b, b_end, one)
    keys = manifest.objects
    out: list[list[Window]] = []
    # equal boxes share their tuples (fewer live objects: see shared_tuples)
    same: dict[tuple[int, ...], tuple[int, ...]] = {}
    same_boxes: dict[tuple[tuple[int, ...], int], tuple[SubBox, ...]] = {}
    rows = zip(
        regions,
        one.tolist(),
        at.nds.tolist(),
        at.lengths.tolist(),
        at.strides.tolist(),
        (at.byte_offset + lo_byte).tolist(),
        (hi_byte - lo_byte).tolist(),
        b.tolist(),
        crcs,
        at.itemsize.tolist(),
        at.object_index.tolist(),
        (at.first - lo_byte // np.maximum(at.itemsize, 1)).tolist(),
    )
    for (
        region,
        fast,
        nd,
        lengths,
        strides,
        start,
        length,
        first_block,
        crc,
        itemsize,
        obj,
        sub_first,
    ) in rows:
        if not fast:
            out.append(plan_windows(manifest, region, max_bytes))
            continue
        lengths = tuple(lengths[:nd])
        lengths = same.setdefault(lengths, lengths)
        strides = tuple(strides[:nd])
        strides = same.setdefault(strides, strides)
        boxes = same_boxes.get((lengths, sub_first))
        if boxes is None:
            boxes = same_boxes[(lengths, sub_first)] = (SubBox((0,) * nd, lengths, sub_first),)
        out.append(
            [Window(keys[obj], start, length, first_block, crc, block, itemsize, strides, boxes)]
        )
    return out


def plan_run_windows_many(
    manifest: Manifest, regions: Sequence[Region], max_bytes: int
) -> list[list[RunWindow] | None]:
    """:func:`plan_run_windows` of each of ``regions`` (same windows, same errors), located
    together."""
    if not manifest.checksums or not regions:
        return [plan_run_windows(manifest, r, max_bytes) for r in regions]
    at = _Located(manifest, regions)
    block = manifest.checksum_block_size
    lo, hi = at.first * at.itemsize, (at.last + 1) * at.itemsize
    b, b_end, one = at.blocks(block, max_bytes)
    run = at.last - at.first + 1 == at.numel
    crcs = at.block_crcs(b, b_end, one & run)
    keys = manifest.objects
    out: list[list[RunWindow] | None] = []
    rows = zip(
        regions,
        at.ok.tolist(),
        one.tolist(),
        run.tolist(),
        lo.tolist(),
        hi.tolist(),
        b.tolist(),
        b_end.tolist(),
        crcs,
        at.byte_offset.tolist(),
        at.byte_length.tolist(),
        at.object_index.tolist(),
    )
    for region, ok, fast, is_run, lo_, hi_, b_, e_, crc, byte_offset, byte_length, obj in rows:
        if ok and not is_run:
            out.append(None)
            continue
        if not fast:
            out.append(plan_run_windows(manifest, region, max_bytes))
            continue
        reads = []
        for k, c in zip(range(b_, e_), crc):
            blo, bhi = k * block, min((k + 1) * block, byte_length)
            a, z = max(blo, lo_), min(bhi, hi_)
            reads.append(BlockRead(byte_offset + blo, bhi - blo, c, a - blo, z - a, a - lo_))
        out.append([RunWindow(keys[obj], 0, hi_ - lo_, tuple(reads))])
    return out
