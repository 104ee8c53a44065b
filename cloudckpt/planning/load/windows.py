"""Read windows: how a region's stored bytes are fetched in bounded, checksum-aligned pieces.

A *window* is a run of whole checksum blocks of one stored chunk, at most ``max_bytes`` long
(never less than one block). A region (a box inside a chunk, :class:`Region`) is read as the
windows covering the blocks that hold its elements; each window carries the sub-boxes of the
region whose elements lie in it, so a reader can verify a window's blocks and copy those
sub-boxes out before the next window arrives, with buffers that never exceed one window.

Contract (pure: ints and tuples, no I/O, no torch):
- every element of the region belongs to exactly one sub-box of exactly one window;
- windows of one region never share a block, so no byte is fetched twice for one region;
- windows whose blocks hold no element of the region are left out (a strided region skips the
  blocks between its rows when they are whole windows);
- every window starts on an element boundary, and a window that does not end the region ends on
  one too, so its bytes (the first ``length // itemsize`` elements) view as the stored dtype.

A manifest without checksums (``Manifest.checksums`` false: foreign files, see
:mod:`cloudckpt.hf`) has no blocks: its windows are element-aligned runs covering exactly the
region's first to last element (at most ``max_bytes``, at least one element), each one "block"
with ``crc32c == (None,)`` (nothing to verify), and it has no run windows (direct landing
needs verified blocks: :func:`plan_run_windows` gives None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.batching import aligned
from cloudckpt.planning.load.plan import Region


@dataclass(frozen=True, slots=True)
class SubBox:
    """Part of a region inside one window: ``offsets``/``lengths`` relative to the region's own
    origin, and ``first`` the element index (inside the window's bytes) of its first element."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    first: int


@dataclass(frozen=True, slots=True)
class Window:
    """Blocks ``first_block`` .. ``first_block + len(crc32c) - 1`` of a chunk: bytes
    ``[start, start + length)`` of ``object_key``; ``strides`` are the chunk's element strides.
    Without checksums: one block of ``length`` bytes, ``crc32c == (None,)``."""

    object_key: str
    start: int
    length: int
    first_block: int
    crc32c: tuple[int | None, ...]
    block_size: int
    itemsize: int
    strides: tuple[int, ...]
    boxes: tuple[SubBox, ...]


def row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a dense row-major array of ``sizes`` (a zero size counts as one)."""
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(sizes[i + 1]), 1)
    return tuple(strides)


def layout_windows(windows: Sequence[Window]) -> tuple[list[int], int]:
    """Byte offset of each window in a shared buffer (each one aligned), and the bytes used."""
    offsets, pos = [], 0
    for w in windows:
        offsets.append(pos)
        pos += aligned(w.length)
    return offsets, pos


def boxes_in_flat_range(
    offsets: Sequence[int], lengths: Sequence[int], sizes: Sequence[int], lo: int, hi: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the part of a box lying in flat element range ``[lo, hi)`` into boxes.

    The box is ``offsets``/``lengths`` inside a row-major array of ``sizes``; returned boxes are
    ``(offsets, lengths)`` relative to the box's own origin, disjoint, at most ``2 * ndim + 1``,
    and together hold exactly the box's elements whose flat index is in ``[lo, hi)``.
    """
    if not sizes:
        return [((), ())] if lo <= 0 < hi else []
    if any(n == 0 for n in lengths) or lo >= hi:
        return []
    stride = math.prod(sizes[1:])
    a0, a1 = offsets[0], offsets[0] + lengths[0]
    rest = len(sizes) - 1
    out: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    first_row, last_row = lo // stride, hi // stride
    partial_first = lo % stride != 0
    if partial_first and a0 <= first_row < a1:
        row_lo = first_row * stride
        for o, n in boxes_in_flat_range(
            offsets[1:], lengths[1:], sizes[1:], lo - row_lo, min(hi, row_lo + stride) - row_lo
        ):
            out.append(((first_row - a0,) + o, (1,) + n))
    full_lo = max(a0, -(-lo // stride))
    full_hi = min(a1, hi // stride)
    if full_lo < full_hi:
        out.append(((full_lo - a0,) + (0,) * rest, (full_hi - full_lo,) + tuple(lengths[1:])))
    if hi % stride != 0 and a0 <= last_row < a1 and not (partial_first and last_row == first_row):
        row_lo = last_row * stride
        for o, n in boxes_in_flat_range(offsets[1:], lengths[1:], sizes[1:], 0, hi - row_lo):
            out.append(((last_row - a0,) + o, (1,) + n))
    return out


def dense_run(window: Window) -> tuple[int, int] | None:
    """``(byte offset in the window, bytes)`` of a window's one sub-box when its elements are
    one dense run there (its box is whole in every dimension after the first it spans more
    than one element of); None otherwise."""
    (sub,) = window.boxes
    lengths, strides = sub.lengths, window.strides
    expect = 1
    for n, s in zip(reversed(lengths), reversed(strides)):
        if n > 1 and s != expect:
            return None
        expect *= n
    return sub.first * window.itemsize, expect * window.itemsize


class ChunkColumns:
    """A manifest's chunk columns as :func:`_locate` reads them (made once per manifest, kept
    with it: ``Manifest.derived``), so locating a region builds no record objects."""

    def __init__(self, manifest: Manifest):
        cols = manifest.columns
        self.name_index = cols.name_index
        self.ndims, self.chunk_start, self.coord_start = (
            cols.ndims,
            cols.chunk_start,
            cols.coord_start,
        )
        self.sizes, self.crcs, self.crc_start = cols.sizes, cols.crcs, cols.crc_start
        self.byte_offset, self.byte_length = cols.byte_offset, cols.byte_length
        self.object_index = cols.object_index
        self.itemsizes = [DTYPE_ITEMSIZE[d] for d in cols.dtypes]


def chunk_columns(manifest: Manifest) -> ChunkColumns:
    chunks: ChunkColumns = manifest.derived("planning.windows.chunks", ChunkColumns)
    return chunks


@dataclass(frozen=True, slots=True)
class _Place:
    """Where a non-empty region sits in its chunk: flat element indices of its first and last
    elements (row-major in the chunk), what computing them needed, and the chunk's bytes:
    ``byte_offset`` / ``byte_length`` in object ``object_index``, its crcs from ``crc_lo`` in
    the manifest's flat crc column."""

    itemsize: int
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    first: int
    last: int
    byte_offset: int
    byte_length: int
    object_index: int
    crc_lo: int
    crcs: np.ndarray  # the manifest's flat crc column

    def block_crcs(self, b: int, e: int) -> tuple[int, ...]:
        """crc32c of the chunk's blocks ``b .. e - 1``."""
        return tuple(self.crcs[self.crc_lo + b : self.crc_lo + e].tolist())


def _locate(manifest: Manifest, region: Region) -> _Place | None:
    """The region's place in its chunk; None for an empty region. Raises
    :class:`ManifestError` when the region reaches past the chunk's bytes (``KeyError`` /
    ``IndexError`` for a tensor or chunk the manifest does not have)."""
    g = chunk_columns(manifest)
    t = g.name_index[region.name]
    c0 = int(g.chunk_start[t])
    count = int(g.chunk_start[t + 1]) - c0
    ci = int(region.chunk_index)
    if ci < 0:
        ci += count
    if not 0 <= ci < count:
        raise IndexError(region.chunk_index)
    nd = int(g.ndims[t])
    k = int(g.coord_start[t]) + ci * nd
    sizes = tuple(g.sizes[k : k + nd].tolist())
    lengths = tuple(int(n) for n in region.lengths)
    offsets = tuple(int(o) for o in region.src_offsets)
    if math.prod(lengths) == 0:
        return None
    strides = row_major_strides(sizes)
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides))
    itemsize = g.itemsizes[t]
    c = c0 + ci
    byte_length = int(g.byte_length[c])
    if (last + 1) * itemsize > byte_length:
        raise ManifestError(
            "region reaches past the chunk's bytes",
            path=f'tensors["{region.name}"].chunks[{region.chunk_index}]',
        )
    return _Place(
        itemsize,
        sizes,
        strides,
        offsets,
        lengths,
        first,
        last,
        int(g.byte_offset[c]),
        byte_length,
        int(g.object_index[c]),
        int(g.crc_start[c]),
        g.crcs,
    )


def plan_windows(manifest: Manifest, region: Region, max_bytes: int) -> list[Window]:
    """The windows (see module doc) through which ``region`` of ``manifest`` is read.

    An empty region has no windows. Raises :class:`ManifestError` when the region reaches past
    its chunk's bytes.
    """
    place = _locate(manifest, region)
    if place is None:
        return []
    if not manifest.checksums:
        return _unverified_windows(manifest, place, max_bytes)
    itemsize, sizes, strides = place.itemsize, place.sizes, place.strides
    offsets, lengths, first, last = place.offsets, place.lengths, place.first, place.last
    block = manifest.checksum_block_size
    key = manifest.objects[place.object_index]
    per_window = max(1, max_bytes // block)
    b, b_end = first * itemsize // block, -(-(last + 1) * itemsize // block)
    while (b * block) % itemsize:  # start on an element boundary (odd block sizes only)
        b -= 1
    if b_end - b <= per_window:  # the whole region in one window: one sub-box, the region
        lo_byte, hi_byte = b * block, min(b_end * block, place.byte_length)
        return [
            Window(
                object_key=key,
                start=place.byte_offset + lo_byte,
                length=hi_byte - lo_byte,
                first_block=b,
                crc32c=place.block_crcs(b, b_end),
                block_size=block,
                itemsize=itemsize,
                strides=strides,
                boxes=(SubBox((0,) * len(lengths), lengths, first - lo_byte // itemsize),),
            )
        ]
    windows: list[Window] = []
    while b < b_end:
        e = min(b + per_window, b_end)
        while e < b_end and (e * block) % itemsize:  # end on an element boundary
            e += 1
        lo_byte = b * block
        hi_byte = min(e * block, place.byte_length)
        lo_el, hi_el = lo_byte // itemsize, hi_byte // itemsize
        boxes = boxes_in_flat_range(offsets, lengths, sizes, lo_el, hi_el)
        if boxes:
            windows.append(
                Window(
                    object_key=key,
                    start=place.byte_offset + lo_byte,
                    length=hi_byte - lo_byte,
                    first_block=b,
                    crc32c=place.block_crcs(b, e),
                    block_size=block,
                    itemsize=itemsize,
                    strides=strides,
                    boxes=tuple(
                        SubBox(
                            o,
                            n,
                            sum((off + bo) * s for off, bo, s in zip(offsets, o, strides)) - lo_el,
                        )
                        for o, n in boxes
                    ),
                )
            )
        b = e
    return windows


def _unverified_windows(manifest: Manifest, place: _Place, max_bytes: int) -> list[Window]:
    """Windows of a region of a manifest without checksums: runs of at most ``max_bytes`` (at
    least one element) from the region's first element to its last, no block alignment."""
    itemsize, strides = place.itemsize, place.strides
    key = manifest.objects[place.object_index]
    per_window = max(1, max_bytes // itemsize)
    windows: list[Window] = []
    lo_el = place.first
    while lo_el <= place.last:
        hi_el = min(lo_el + per_window, place.last + 1)
        boxes = boxes_in_flat_range(place.offsets, place.lengths, place.sizes, lo_el, hi_el)
        if boxes:
            length = (hi_el - lo_el) * itemsize
            windows.append(
                Window(
                    object_key=key,
                    start=place.byte_offset + lo_el * itemsize,
                    length=length,
                    first_block=0,
                    crc32c=(None,),
                    block_size=length,
                    itemsize=itemsize,
                    strides=strides,
                    boxes=tuple(
                        SubBox(
                            o,
                            n,
                            sum((off + bo) * s for off, bo, s in zip(place.offsets, o, strides))
                            - lo_el,
                        )
                        for o, n in boxes
                    ),
                )
            )
        lo_el = hi_el
    return windows


@dataclass(frozen=True, slots=True)
class BlockRead:
    """One checksum block to read (``offset``/``length`` in its object, with its ``crc32c``)
    whose bytes ``[keep_at, keep_at + keep_len)`` are the region's bytes starting at
    ``region_pos`` (the rest of the block is outside the region: verified, then dropped)."""

    offset: int
    length: int
    crc32c: int
    keep_at: int
    keep_len: int
    region_pos: int


@dataclass(frozen=True, slots=True)
class RunWindow:
    """Bytes ``[lo, hi)`` of a region stored as one contiguous run, read as whole blocks."""

    object_key: str
    lo: int
    hi: int
    blocks: tuple[BlockRead, ...]


def plan_run_windows(manifest: Manifest, region: Region, max_bytes: int) -> list[RunWindow] | None:
    """The windows of a region whose elements are one contiguous run of its chunk (so its bytes
    can go straight to a contiguous destination); None for any other region, or an empty one.

    Windows are runs of whole checksum blocks of about ``max_bytes`` (at least one block); they
    cover the region's bytes in order, without overlap, and every window boundary falls on an
    element boundary. Raises :class:`ManifestError` when the region reaches past its chunk.
    """
    place = _locate(manifest, region)
    if (
        place is None
        or place.last - place.first + 1 != math.prod(place.lengths)
        or not manifest.checksums
    ):
        return None
    itemsize, byte_offset, byte_length = place.itemsize, place.byte_offset, place.byte_length
    lo, hi = place.first * itemsize, (place.last + 1) * itemsize
    block = manifest.checksum_block_size
    key = manifest.objects[place.object_index]
    per_window = max(1, max_bytes // block)
    b, b_end = lo // block, -(-hi // block)
    b0, crcs = b, place.block_crcs(b, b_end)
    windows: list[RunWindow] = []
    while b < b_end:
        e = min(b + per_window, b_end)
        while e < b_end and (e * block - lo) % itemsize:  # cut between elements
            e += 1
        reads = []
        for k in range(b, e):
            blo, bhi = k * block, min((k + 1) * block, byte_length)
            a, z = max(blo, lo), min(bhi, hi)
            reads.append(
                BlockRead(
                    offset=byte_offset + blo,
                    length=bhi - blo,
                    crc32c=crcs[k - b0],
                    keep_at=a - blo,
                    keep_len=z - a,
                    region_pos=a - lo,
                )
            )
        windows.append(
            RunWindow(
                object_key=key,
                lo=max(b * block, lo) - lo,
                hi=min(e * block, hi) - lo,
                blocks=tuple(reads),
            )
        )
        b = e
    return windows
