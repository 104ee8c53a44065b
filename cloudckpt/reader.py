"""Fetching stored regions: block-aligned, crc-verified ranged reads.

A *region* is a box inside one stored chunk (see :class:`cloudckpt.planning.Region`). Contract:
- Whole checksum blocks are read and the store verifies every block's crc32c (a mismatch raises
  :class:`~cloudckpt.errors.ChecksumError` naming the object and byte range). Bytes are only
  ever handed out, or written to a destination, after verification, so nothing corrupt reaches
  a destination.
- :func:`fetch_regions` lands regions stored as one run straight in contiguous destinations
  (verified sinks, see :func:`direct_ranges`) and reads any other region through bounded
  windows (see :mod:`cloudckpt.planning.windows`) into pooled buffers, with at most
  ``max_bytes`` of buffers alive at once, handing each verified part to a consumer; the store
  bounds and coalesces the requests themselves. :func:`read_windows` / :func:`window_boxes` are the same steps for a
  caller that owns the buffer (broadcast batches).
- Nothing here runs collectives.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Callable, Sequence

import torch

from cloudckpt.buffers import BufferPool, byte_view, is_byte_viewable
from cloudckpt.planning.windows import RunWindow, Window, plan_run_windows, plan_windows
from cloudckpt.storage import ReadRange
from cloudckpt.statedict import torch_dtype


#: ``consume`` calls for buffers holding at least this many bytes run in a worker thread.
_THREAD_COPY_BYTES = 1 << 20
#: batches landing straight in destinations in flight at once (they hold no buffer of ours: at
#: most one checksum block of received chunks per request; the store bounds requests too).
_DIRECT_BATCHES = 8
#: every window starts at a multiple of this in a shared buffer (dtype views need alignment).
WINDOW_ALIGN = 64


def layout_windows(windows: Sequence[Window]) -> tuple[list[int], int]:
    """Byte offset of each window in a shared buffer (each one aligned), and the bytes used."""
    offsets, pos = [], 0
    for w in windows:
        offsets.append(pos)
        pos += -(-w.length // WINDOW_ALIGN) * WINDOW_ALIGN
    return offsets, pos


def window_ranges(windows: Sequence[Window], buf: torch.Tensor) -> dict[str, list[ReadRange]]:
    """Per object key, the block ranges that read ``windows`` into ``buf`` (a flat uint8 CPU
    tensor) at :func:`layout_windows` offsets, each with its crc32c."""
    offsets, total = layout_windows(windows)
    if total > buf.numel():
        raise ValueError(f"windows need {total} bytes, the buffer holds {buf.numel()}")
    mv = memoryview(buf.numpy()).cast("B")
    by_key: dict[str, list[ReadRange]] = defaultdict(list)
    for w, off in zip(windows, offsets):
        ranges = by_key[w.object_key]
        for j, crc in enumerate(w.crc32c):
            lo = j * w.block_size
            n = min(w.block_size, w.length - lo)
            ranges.append(ReadRange(offset=w.start + lo, length=n, out=mv[off + lo:off + lo + n],
                                    crc32c=crc))
    return by_key


async def read_windows(store, windows: Sequence[Window], buf: torch.Tensor) -> int:
    """Fetch ``windows`` into ``buf`` (a flat uint8 CPU tensor) at :func:`layout_windows`
    offsets; every block is crc-verified by the store before this returns (a mismatch raises
    :class:`~cloudckpt.errors.ChecksumError`). Returns the bytes fetched."""
    by_key = window_ranges(windows, buf)
    await asyncio.gather(*(store.read_ranges(k, rs) for k, rs in by_key.items()))
    return sum(w.length for w in windows)


def run_ranges(window: RunWindow, views: Sequence[memoryview], base: int = 0) -> list[ReadRange]:
    """Block ranges that deliver ``window`` (verified) into each of ``views``, flat byte views
    whose byte 0 is the region's byte ``base``."""
    return [ReadRange(offset=b.offset, length=b.length, crc32c=b.crc32c,
                      sinks=tuple((b.keep_at, v[b.region_pos - base:b.region_pos - base + b.keep_len])
                                  for v in views))
            for b in window.blocks]


def direct_ranges(manifest, region, targets: Sequence[torch.Tensor],
                  window_bytes: int) -> list[tuple[str, list[ReadRange]]] | None:
    """Block ranges that land ``region`` straight in ``targets`` (its destinations), grouped in
    windows of about ``window_bytes`` as ``(object key, ranges)``; None when that is not
    possible.

    Possible when the region's elements are one contiguous run of its chunk and every target is
    a byte-viewable tensor (see :mod:`cloudckpt.buffers`) of the stored dtype and the region's
    shape. The ranges deliver to
    sinks: a target is written only with verified bytes (see :class:`ReadRange`).
    """
    dtype = torch_dtype(manifest.tensors[region.name].dtype)
    lengths = tuple(int(n) for n in region.lengths)
    if not targets or any(not is_byte_viewable(t) or t.dtype != dtype
                          or tuple(t.shape) != lengths for t in targets):
        return None
    windows = plan_run_windows(manifest, region, window_bytes)
    if windows is None:
        return None
    views = [byte_view(t) for t in targets]
    return [(w.object_key, run_ranges(w, views)) for w in windows]


def window_boxes(window: Window, buf: torch.Tensor, offset: int, dtype: torch.dtype):
    """``(SubBox, tensor)`` for each part of the region held by ``window``, whose bytes are at
    ``offset`` in ``buf``: views of the stored dtype into ``buf`` (no copy)."""
    n = window.length // window.itemsize
    flat = buf[offset:offset + n * window.itemsize].view(dtype)
    base = flat.storage_offset()
    for sub in window.boxes:
        yield sub, flat.as_strided(sub.lengths, window.strides, base + sub.first)


async def fetch_regions(store, manifest, regions: Sequence, *,
                        consume: Callable[[object, tuple, torch.Tensor], None],
                        targets: Callable[[object], Sequence[torch.Tensor]] | None = None,
                        max_bytes: int = 192 << 20, window_bytes: int = 32 << 20) -> int:
    """Fetch every region into its destinations. Returns the bytes fetched.

    When ``targets(region)`` gives destinations that :func:`direct_ranges` can fill, the
    verified bytes land there directly (one copy from the received data, no buffer of ours).
    Otherwise the region is read through windows of at most ``window_bytes`` (see
    :mod:`cloudckpt.planning.windows`) into pooled buffers (at most ``max_bytes`` of them, at
    least one, reused from window to window) and ``consume(region, offsets, tensor)`` is called
    for each verified part: ``tensor`` is a view (stored dtype) of the part of ``region``
    starting at ``offsets`` (relative to the region's origin), valid only during the call.
    ``consume`` runs in a worker thread when a buffer holds 1 MiB or more (so copies never stall
    the event loop), hence it must be safe to call from several threads on disjoint parts.

    Pieces of one object are read together (one ``read_ranges`` call per batch of about
    ``window_bytes``, in object order), so the store coalesces neighbouring regions into few
    large GETs; at most ``max_bytes // window_bytes`` batches through buffers (and 16 landing
    in destinations) are in flight.
    """
    # per object: (start, nbytes, ranges of a direct piece or None, window, region, dtype)
    entries: dict[str, list] = defaultdict(list)
    slab = window_bytes
    for region in regions:
        direct = direct_ranges(manifest, region, targets(region), window_bytes) \
            if targets is not None else None
        if direct is not None:
            for key, ranges in direct:
                entries[key].append((ranges[0].offset, sum(r.length for r in ranges), ranges,
                                     None, region, None))
            continue
        dtype = torch_dtype(manifest.tensors[region.name].dtype)
        for w in plan_windows(manifest, region, window_bytes):
            entries[w.object_key].append((w.start, w.length, None, w, region, dtype))
            slab = max(slab, w.length)
    if not entries:
        return 0
    slab = -(-slab // WINDOW_ALIGN) * WINDOW_ALIGN
    batches: list[tuple[str, list]] = []
    for key, members in entries.items():
        members.sort(key=lambda e: e[0])
        current, size = [], 0
        for entry in members:
            length = -(-entry[1] // WINDOW_ALIGN) * WINDOW_ALIGN
            if current and size + length > slab:
                batches.append((key, current))
                current, size = [], 0
            current.append(entry)
            size += length
        batches.append((key, current))

    pool = BufferPool(slab)
    slots = asyncio.Semaphore(max(1, max_bytes // slab))    # batches holding a pool buffer
    direct_slots = asyncio.Semaphore(_DIRECT_BATCHES)       # batches landing in destinations
    total = 0

    async def one(key: str, members: list) -> None:
        nonlocal total
        windows = [e[3] for e in members if e[3] is not None]
        async with (slots if windows else direct_slots):
            buf = pool.take() if windows else None
            try:
                ranges = [r for e in members if e[2] is not None for r in e[2]]
                if windows:
                    ranges += window_ranges(windows, buf)[key]
                ranges.sort(key=lambda r: r.offset)
                await store.read_ranges(key, ranges)
                fetched = sum(r.length for r in ranges)
                if windows:
                    offsets, _ = layout_windows(windows)
                    parts = [(w, e[4], e[5]) for w, e in
                             zip(windows, (e for e in members if e[3] is not None))]

                    def copy_out() -> None:
                        for (w, region, dtype), off in zip(parts, offsets):
                            for sub, tensor in window_boxes(w, buf, off, dtype):
                                consume(region, sub.offsets, tensor)

                    if sum(w.length for w in windows) >= _THREAD_COPY_BYTES:
                        # in a worker thread, to keep the loop serving I/O; a cancelled batch
                        # still waits for its copy before the buffer goes back to the pool
                        copying = asyncio.ensure_future(asyncio.to_thread(copy_out))
                        try:
                            await asyncio.shield(copying)
                        except asyncio.CancelledError:
                            await asyncio.gather(copying, return_exceptions=True)
                            raise
                    else:
                        copy_out()
                total += fetched
            finally:
                if buf is not None:
                    pool.give(buf)

    tasks = [asyncio.ensure_future(one(*b)) for b in batches]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return total
