"""Fetching stored regions: block-aligned, crc-verified ranged reads.

A *region* is a box inside one stored chunk (see :class:`cloudckpt.planning.Region`). Contract:
- :func:`fetch_region` reads the smallest run of whole checksum blocks of the chunk that holds the
  region, lets the store verify every block's crc32c as it lands (a mismatch raises
  :class:`~cloudckpt.errors.ChecksumError` naming the object and byte range), and returns the
  region as a tensor of the stored dtype (a strided view into a buffer cloudckpt owns). Bytes
  are only ever handed out after verification, so nothing corrupt reaches a destination.
- :func:`fetch_regions` runs many fetches concurrently with at most ``max_bytes`` of buffers
  alive at once; the store bounds and coalesces the requests themselves.
- Nothing here runs collectives.
"""

from __future__ import annotations

import asyncio
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Awaitable, Callable, Sequence

import torch

from cloudckpt.errors import ManifestError
from cloudckpt.storage import ReadRange
from cloudckpt.statedict import torch_dtype


#: ``consume`` calls for regions at least this large run in a worker thread.
_THREAD_COPY_BYTES = 1 << 20


@dataclass(frozen=True)
class RegionSpan:
    """Where a region's bytes are: the block-aligned byte span to fetch and how to view it."""

    object_key: str
    start: int          # byte offset of the span inside the object
    length: int         # bytes in the span
    first_block: int    # index of the chunk's first checksum block in the span
    view_offset: int    # element offset of the region's first element inside the span
    strides: tuple[int, ...]  # element strides of the stored chunk (row-major)


def _row_major_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    strides = [1] * len(sizes)
    for i in range(len(sizes) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(int(sizes[i + 1]), 1)
    return tuple(strides)


def locate_region(manifest, region) -> RegionSpan:
    """Compute the block-aligned byte span of ``region`` inside its stored chunk."""
    record = manifest.tensors[region.name]
    chunk = record.chunks[region.chunk_index]
    itemsize = torch.empty((), dtype=torch_dtype(record.dtype)).element_size()
    strides = _row_major_strides(chunk.sizes)
    block = manifest.checksum_block_size
    if math.prod(region.lengths) == 0:
        return RegionSpan(manifest.objects[chunk.object_index], chunk.byte_offset, 0, 0, 0, strides)
    first = sum(o * s for o, s in zip(region.src_offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(region.src_offsets, region.lengths, strides))
    lo, hi = first * itemsize, (last + 1) * itemsize
    if hi > chunk.byte_length:
        raise ManifestError("region reaches past the chunk's bytes",
                            path=f'tensors["{region.name}"].chunks[{region.chunk_index}]')
    first_block = lo // block
    span_lo = first_block * block
    span_hi = min(-(-hi // block) * block, chunk.byte_length)
    return RegionSpan(
        object_key=manifest.objects[chunk.object_index],
        start=chunk.byte_offset + span_lo,
        length=span_hi - span_lo,
        first_block=first_block,
        view_offset=first - span_lo // itemsize,
        strides=strides,
    )


def _prepare(manifest, region, span: RegionSpan | None = None):
    """Buffer, verified block ranges and a finisher that views the region in the buffer."""
    record = manifest.tensors[region.name]
    chunk = record.chunks[region.chunk_index]
    dtype = torch_dtype(record.dtype)
    span = span or locate_region(manifest, region)
    if span.length == 0:
        empty = torch.empty(tuple(region.lengths), dtype=dtype)
        return span, [], lambda: empty
    buf = torch.empty(span.length, dtype=torch.uint8)
    mv = memoryview(buf.numpy()).cast("B")
    block = manifest.checksum_block_size
    crcs = chunk.crc32c
    ranges = []
    pos, blk = 0, span.first_block
    while pos < span.length:
        n = min(block, span.length - pos)
        ranges.append(ReadRange(offset=span.start + pos, length=n, out=mv[pos:pos + n],
                                crc32c=crcs[blk]))
        pos += n
        blk += 1
    return span, ranges, lambda: buf.view(dtype).as_strided(tuple(region.lengths), span.strides,
                                                            span.view_offset)


async def fetch_region(store, manifest, region) -> torch.Tensor:
    """Fetch and verify ``region``; return it as a tensor of the stored dtype and region shape."""
    span, ranges, finish = _prepare(manifest, region)
    if ranges:
        await store.read_ranges(span.object_key, ranges)
    return finish()


async def fetch_regions(store, manifest, regions: Sequence, *,
                        consume: Callable[[object, torch.Tensor], Awaitable[None] | None],
                        max_bytes: int = 256 << 20) -> int:
    """Fetch every region, calling ``consume(region, tensor)`` as each one is verified.

    Regions of one object are read together (one ``read_ranges`` call per batch of up to
    ``max_bytes / 4`` bytes, in object order), so the store coalesces neighbouring regions into
    few large GETs and runs them concurrently. At most ``max_bytes`` of fetched buffers are alive
    at once (a region larger than that is fetched alone). ``consume`` may be a coroutine
    function; a plain one runs in a worker thread for large regions (so copies never stall the
    event loop), hence it must be safe to call from several threads on disjoint regions. Returns
    the bytes fetched.
    """
    batch_limit = max(max_bytes // 4, 1)
    by_object: dict[str, list] = defaultdict(list)
    for region in regions:
        span = locate_region(manifest, region)
        by_object[span.object_key].append((span, region))
    batches: list[tuple[str, list, int]] = []
    for key, entries in by_object.items():
        entries.sort(key=lambda e: e[0].start)
        current, size = [], 0
        for span, region in entries:
            length = max(span.length, 1)
            if current and size + length > batch_limit:
                batches.append((key, current, size))
                current, size = [], 0
            current.append((span, region))
            size += length
        if current:
            batches.append((key, current, size))

    lock = asyncio.Condition()
    in_flight = 0
    total = 0

    async def one(key: str, members: list, need: int) -> None:
        nonlocal in_flight, total
        async with lock:
            await lock.wait_for(lambda: in_flight == 0 or in_flight + need <= max_bytes)
            in_flight += need
        try:
            prepared = [_prepare(manifest, r, span) for span, r in members]
            ranges = [rng for _, rs, _ in prepared for rng in rs]
            if ranges:
                await store.read_ranges(key, ranges)
            total += sum(r.length for r in ranges)
            for (_, region), (_, _, finish) in zip(members, prepared):
                tensor = finish()
                if asyncio.iscoroutinefunction(consume):
                    await consume(region, tensor)
                elif tensor.numel() * tensor.element_size() >= _THREAD_COPY_BYTES:
                    await asyncio.to_thread(consume, region, tensor)  # keep the loop serving I/O
                else:
                    consume(region, tensor)
            del prepared, ranges
        finally:
            async with lock:
                in_flight -= need
                lock.notify_all()

    tasks = [asyncio.ensure_future(one(*b)) for b in batches]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return total
