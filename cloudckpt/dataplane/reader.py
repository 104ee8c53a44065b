"""Fetching stored regions: block-aligned, crc-verified ranged reads.

A *region* is a box inside one stored chunk (see :class:`cloudckpt.planning.Region`). Contract:
- Whole checksum blocks are read and the store verifies every block's crc32c (a mismatch raises
  :class:`~cloudckpt.errors.ChecksumError` naming the object and byte range). Bytes are only
  ever handed out, or written to a destination, after verification, so nothing corrupt reaches
  a destination.
- :func:`fetch_regions` lands regions stored as one run straight in contiguous destinations
  (verified sinks, see :func:`direct_ranges`) and reads any other region through bounded
  windows (see :mod:`cloudckpt.planning.load.windows`) into pooled buffers, with at most
  ``max_bytes`` of buffers alive at once, handing each verified part to a consumer; the store
  bounds and coalesces the requests themselves. :func:`read_windows` / :func:`window_boxes` are
  the same steps for a caller that owns the buffer (broadcast batches).
- Nothing here runs collectives.

A manifest without checksums (``Manifest.checksums`` false: foreign files such as safetensors)
has nothing to verify: its windows are exact element runs whose ranges carry no crc, and no
region lands directly (see :mod:`cloudckpt.planning.load.windows`).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cloudckpt.dataplane.buffers import BufferPool, byte_view, is_byte_viewable
from cloudckpt.planning.batching import Span, aligned, batch_by_object
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import (
    RunWindow,
    Window,
    layout_windows,
    plan_run_windows,
)
from cloudckpt.planning.load.windows_many import plan_run_windows_many, plan_windows_many
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.storage.base import ReadRange

#: ``consume`` calls for buffers holding at least this many bytes run in a worker thread.
_THREAD_COPY_BYTES = 1 << 20
#: batches landing straight in destinations in flight at once (they hold no buffer of ours: at
#: most one checksum block of received chunks per request; the store bounds requests too).
_DIRECT_BATCHES = 8


def window_ranges(windows: Sequence[Window], buf: torch.Tensor) -> dict[str, list[ReadRange]]:
    """Per object key, the block ranges that read ``windows`` into ``buf`` (a flat uint8 CPU
    tensor) at :func:`layout_windows` offsets, each with its crc32c."""
    offsets, total = layout_windows(windows)
    if total > buf.numel():
        raise ValueError(f"windows need {total} bytes, the buffer holds {buf.numel()}")
    mv = buf.numpy().data.cast("B")
    by_key: dict[str, list[ReadRange]] = defaultdict(list)
    for w, off in zip(windows, offsets):
        ranges = by_key[w.object_key]
        for j, crc in enumerate(w.crc32c):
            lo = j * w.block_size
            n = min(w.block_size, w.length - lo)
            ranges.append(
                ReadRange(
                    offset=w.start + lo, length=n, out=mv[off + lo : off + lo + n], crc32c=crc
                )
            )
    return by_key


async def read_windows(store, windows: Sequence[Window], buf: torch.Tensor) -> int:
    """Fetch ``windows`` into ``buf`` (a flat uint8 CPU tensor) at :func:`layout_windows`
    offsets; every block is crc-verified by the store before this returns (a mismatch raises
    :class:`~cloudckpt.errors.ChecksumError`). Returns the bytes fetched."""
    by_key = window_ranges(windows, buf)
    await asyncio.gather(*(store.read_ranges(k, rs) for k, rs in by_key.items()))
    return sum(w.length for w in windows)


def stored_dtype(manifest, name: str) -> torch.dtype:
    """The torch dtype tensor ``name`` is stored in (read from the manifest's columns: no
    record object is made)."""
    cols = manifest.columns
    return torch_dtype(cols.dtypes[cols.name_index[name]])


def run_ranges(window: RunWindow, views: Sequence[memoryview], base: int = 0) -> list[ReadRange]:
    """Block ranges that deliver ``window`` (verified) into each of ``views``, flat byte views
    whose byte 0 is the region's byte ``base``."""
    return [
        ReadRange(
            offset=b.offset,
            length=b.length,
            crc32c=b.crc32c,
            sinks=tuple(
                (b.keep_at, v[b.region_pos - base : b.region_pos - base + b.keep_len])
                for v in views
            ),
        )
        for b in window.blocks
    ]


def direct_ranges(
    manifest, region, targets: Sequence[torch.Tensor], window_bytes: int
) -> list[tuple[str, list[ReadRange]]] | None:
    """Block ranges that land ``region`` straight in ``targets`` (its destinations), grouped in
    windows of about ``window_bytes`` as ``(object key, ranges)``; None when that is not
    possible.

    Possible when the region's elements are one contiguous run of its chunk and every target is
    a byte-viewable tensor (see :mod:`cloudckpt.dataplane.buffers`) of the stored dtype and the
    region's shape. The ranges deliver to sinks: a target is written only with verified bytes
    (see :class:`ReadRange`).
    """
    if not _can_land(manifest, region, targets):
        return None
    windows = plan_run_windows(manifest, region, window_bytes)
    if windows is None:
        return None
    views = [byte_view(t) for t in targets]
    return [(w.object_key, run_ranges(w, views)) for w in windows]


def _can_land(manifest, region, targets) -> bool:
    """Whether ``targets`` can take ``region``'s stored bytes as they are (see
    :func:`direct_ranges`)."""
    if not targets:
        return False
    dtype = stored_dtype(manifest, region.name)
    lengths = tuple(int(n) for n in region.lengths)
    return all(
        is_byte_viewable(t) and t.dtype == dtype and tuple(t.shape) == lengths for t in targets
    )


def window_boxes(window: Window, buf: torch.Tensor, offset: int, dtype: torch.dtype):
    """``(SubBox, tensor)`` for each part of the region held by ``window``, whose bytes are at
    ``offset`` in ``buf``: views of the stored dtype into ``buf`` (no copy)."""
    n = window.length // window.itemsize
    flat = buf[offset : offset + n * window.itemsize].view(dtype)
    base = flat.storage_offset()
    for sub in window.boxes:
        yield sub, flat.as_strided(sub.lengths, window.strides, base + sub.first)


@dataclass(frozen=True)
class DirectPiece:
    """Whole checksum blocks of a region stored as one run, landing straight in its
    destinations through verified sinks (see :func:`direct_ranges`): no buffer of ours."""

    object_key: str
    ranges: tuple[ReadRange, ...]

    @property
    def span(self) -> Span:
        return Span(self.object_key, self.ranges[0].offset, sum(r.length for r in self.ranges))


@dataclass(frozen=True)
class WindowPiece:
    """A window of ``region`` read into a pooled buffer, then handed out as views of ``dtype``
    (the stored one) to the consumer."""

    window: Window
    region: Region
    dtype: torch.dtype

    @property
    def span(self) -> Span:
        return Span(self.window.object_key, self.window.start, self.window.length)


Piece = DirectPiece | WindowPiece


def plan_pieces(
    manifest,
    regions: Sequence,
    targets,
    window_bytes: int,
    *,
    landing: Callable[[object], Sequence[memoryview] | None] | None = None,
) -> list[Piece]:
    """How every region is read: direct pieces when ``targets(region)`` can take it in place
    (see :func:`direct_ranges`), windows of at most ``window_bytes`` otherwise. The regions are
    located together (:func:`~cloudckpt.planning.load.windows_many.plan_run_windows_many`).

    ``landing(region)``, when given, says it for ``targets`` at less cost: the flat byte views
    of the region's destinations when each is a byte-viewable tensor of the stored dtype and
    the region's shape (the views :func:`direct_ranges` would make of ``targets(region)``), or
    ``None`` when one is not (see :class:`~cloudckpt.dataplane.destinations.DestinationBytes`)."""
    if landing is not None:
        views_of: list[Sequence[memoryview] | None] = [landing(r) for r in regions]
    elif targets is not None:
        dests = [targets(r) for r in regions]
        views_of = [
            [byte_view(t) for t in d] if _can_land(manifest, r, d) else None
            for r, d in zip(regions, dests)
        ]
    else:
        views_of = [None] * len(regions)
    lands = [i for i, v in enumerate(views_of) if v is not None]
    runs = dict(
        zip(lands, plan_run_windows_many(manifest, [regions[i] for i in lands], window_bytes))
    )
    rest = [i for i in range(len(regions)) if runs.get(i) is None]
    windows = dict(zip(rest, plan_windows_many(manifest, [regions[i] for i in rest], window_bytes)))
    pieces: list[Piece] = []
    for i, region in enumerate(regions):
        run, views = runs.get(i), views_of[i]
        if run is not None and views is not None:  # a run is planned only for a destination
            pieces.extend(DirectPiece(w.object_key, tuple(run_ranges(w, views))) for w in run)
            continue
        dtype = stored_dtype(manifest, region.name)
        pieces.extend(WindowPiece(w, region, dtype) for w in windows[i])
    return pieces


async def fetch_regions(
    store,
    manifest,
    regions: Sequence,
    *,
    consume: Callable[[object, tuple, torch.Tensor], None],
    targets: Callable[[object], Sequence[torch.Tensor]] | None = None,
    max_bytes: int = 192 << 20,
    window_bytes: int = 32 << 20,
    landing: Callable[[object], Sequence[memoryview] | None] | None = None,
) -> int:
    """Fetch every region into its destinations. Returns the bytes fetched.

    When ``targets(region)`` gives destinations that :func:`direct_ranges` can fill, the
    verified bytes land there directly (one copy from the received data, no buffer of ours).
    Otherwise the region is read through windows of at most ``window_bytes`` (see
    :mod:`cloudckpt.planning.load.windows`) into pooled buffers (at most ``max_bytes`` of them, at
    least one, reused from window to window) and ``consume(region, offsets, tensor)`` is called
    for each verified part: ``tensor`` is a view (stored dtype) of the part of ``region``
    starting at ``offsets`` (relative to the region's origin), valid only during the call.
    ``consume`` runs in a worker thread when a buffer holds 1 MiB or more (so copies never stall
    the event loop), hence it must be safe to call from several threads on disjoint parts.
    ``landing``: as :func:`plan_pieces` takes it (instead of ``targets`` to say which regions
    land straight in their destinations).

    Pieces of one object are read together (one ``read_ranges`` call per batch of about
    ``window_bytes``, in object order: :func:`~cloudckpt.planning.batching.batch_by_object`),
    so the store coalesces neighbouring regions into few large GETs; at most
    ``max_bytes // window_bytes`` batches through buffers (and 8 landing in destinations) are in
    flight.
    """
    pieces = plan_pieces(manifest, regions, targets, window_bytes, landing=landing)
    if not pieces:
        return 0
    slab = aligned(
        max([window_bytes] + [p.window.length for p in pieces if isinstance(p, WindowPiece)])
    )
    batches = [
        [pieces[i] for i in b.members] for b in batch_by_object([p.span for p in pieces], slab)
    ]
    pool = BufferPool(slab)
    slots = asyncio.Semaphore(max(1, max_bytes // slab))  # batches holding a pool buffer
    direct_slots = asyncio.Semaphore(_DIRECT_BATCHES)  # batches landing in destinations
    tasks = [
        asyncio.ensure_future(_read_batch(store, batch, pool, consume, slots, direct_slots))
        for batch in batches
    ]
    try:
        return sum(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _read_batch(
    store, batch: Sequence[Piece], pool: BufferPool, consume, slots, direct_slots
) -> int:
    """One ``read_ranges`` call for ``batch`` (pieces of one object, in byte order), then the
    windows' parts handed to ``consume``. Returns the bytes fetched."""
    windows = [p for p in batch if isinstance(p, WindowPiece)]
    key = batch[0].span.object_key
    async with slots if windows else direct_slots:
        buf = pool.take() if windows else None
        try:
            ranges = [r for p in batch if isinstance(p, DirectPiece) for r in p.ranges]
            if buf is not None:  # there are windows
                ranges += window_ranges([p.window for p in windows], buf)[key]
            ranges.sort(key=lambda r: r.offset)
            await store.read_ranges(key, ranges)
            if buf is not None:
                await _copy_out(windows, buf, consume)
            return sum(r.length for r in ranges)
        finally:
            if buf is not None:
                pool.give(buf)


async def _copy_out(windows: Sequence[WindowPiece], buf: torch.Tensor, consume) -> None:
    """Hand every verified part of ``windows`` (in ``buf`` at their layout offsets) to
    ``consume``; in a worker thread for 1 MiB or more, to keep the loop serving I/O."""
    offsets, _ = layout_windows([p.window for p in windows])

    def copy_out() -> None:
        for piece, off in zip(windows, offsets):
            for sub, tensor in window_boxes(piece.window, buf, off, piece.dtype):
                consume(piece.region, sub.offsets, tensor)

    if sum(p.window.length for p in windows) < _THREAD_COPY_BYTES:
        copy_out()
        return
    # a cancelled batch still waits for its copy before the buffer goes back to the pool
    copying = asyncio.ensure_future(asyncio.to_thread(copy_out))
    try:
        await asyncio.shield(copying)
    except asyncio.CancelledError:
        await asyncio.gather(copying, return_exceptions=True)
        raise
