"""Packing one rank's write items into data objects and uploading them.

Contract:
- Items are packed in the order given into objects of about ``object_size`` bytes (an item larger
  than that gets an object of its own: :func:`cloudckpt.planning.batching.pack_in_order`);
  objects are named by :func:`cloudckpt.layout.data_key`.
- Every item gets a crc32c per ``checksum_block_size`` block of its bytes (see
  :func:`cloudckpt.checksum.block_crcs`); the returned :class:`ChunkLocation` says where its
  bytes are. Nothing here knows about manifests or collectives.
- CPU contiguous tensors are uploaded straight from their memory (no copy). Other tensors
  (device, strided views, conjugate views: see :mod:`cloudckpt.dataplane.buffers`) are copied
  to host one object at a time, with at most ``max_staging_bytes`` of such copies alive at
  once, so memory stays bounded whatever the checkpoint size.
- Objects upload concurrently; the store bounds requests in flight. On the first failure the
  other uploads are cancelled and the error propagates.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Sequence

import torch

from cloudckpt.dataplane.buffers import byte_view, host_contiguous, is_byte_viewable
from cloudckpt.checksum import block_crcs
from cloudckpt.layout import data_key
from cloudckpt.planning.batching import pack_in_order


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How data objects are cut and how much host memory copies may take."""

    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20


@dataclass(frozen=True)
class ChunkLocation:
    """Where one written item's bytes are: object key, byte offset and length, per-block crcs."""

    chunk_id: int
    object_key: str
    byte_offset: int
    byte_length: int
    crcs: tuple[int, ...]


@dataclass(frozen=True)
class WriteStats:
    bytes_written: int
    objects: int


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


async def write_chunks(store, items: Sequence[tuple[int, torch.Tensor]], *, rank: int,
                       attempt: str, options: WriterOptions = WriterOptions(),
                       first_index: int = 0) -> tuple[list[ChunkLocation], WriteStats]:
    """Upload ``items`` (``(chunk_id, tensor)`` pairs) as data objects of save ``attempt``,
    numbered from ``first_index`` (a writer calling this several times for one attempt passes
    the count of objects its earlier calls wrote).

    Returns one :class:`ChunkLocation` per item, in the order of ``items``.
    """
    sizes = [_nbytes(t) for _, t in items]
    groups = pack_in_order(sizes, options.object_size)
    locations: list[ChunkLocation | None] = [None] * len(items)
    staging_budget = _ByteBudget(options.max_staging_bytes)

    async def upload(obj_index: int, members: list[int]) -> int:
        key = data_key(attempt, rank, first_index + obj_index)
        needs_copy = sum(sizes[i] for i in members
                         if not is_byte_viewable(items[i][1]))
        async with staging_budget.hold(needs_copy):
            tensors = await asyncio.to_thread(
                lambda: [host_contiguous(items[i][1]) for i in members])
            views = [byte_view(t) for t in tensors]
            crcs = await asyncio.to_thread(
                lambda vs=views: [block_crcs(v, options.checksum_block_size) for v in vs])
            offset = 0
            for i, view, crc in zip(members, views, crcs):
                locations[i] = ChunkLocation(items[i][0], key, offset, len(view), crc)
                offset += len(view)
            segments = [v for v in views if len(v)]
            await store.put(key, segments if segments else b"")
            del tensors, views, segments
        return offset

    tasks = [asyncio.ensure_future(upload(k, members)) for k, members in enumerate(groups)]
    try:
        written = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return [loc for loc in locations if loc is not None], WriteStats(sum(written), len(groups))


class _ByteBudget:
    """An async semaphore counted in bytes; a request above the limit waits for an empty budget."""

    def __init__(self, limit: int):
        self.limit = max(1, int(limit))
        self.used = 0
        self._cond = asyncio.Condition()

    def hold(self, n: int):
        budget = self

        class _Hold:
            async def __aenter__(self):
                if n <= 0:
                    return
                async with budget._cond:
                    await budget._cond.wait_for(
                        lambda: budget.used == 0 or budget.used + n <= budget.limit)
                    budget.used += n

            async def __aexit__(self, *exc):
                if n <= 0:
                    return
                async with budget._cond:
                    budget.used -= n
                    budget._cond.notify_all()

        return _Hold()
