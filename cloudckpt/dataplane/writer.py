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
- With ``hashing`` (incremental saves; a non-empty ``known`` implies it), every item's bytes
  get a content hash (:func:`cloudckpt.checksum.content_hash`) and their block crcs in one pass
  (:func:`cloudckpt.checksum.hash_and_block_crcs`: the bytes are read once, as without hashing)
  in worker threads, in item order, ahead of the uploads; an item whose chunk id is in ``known``
  with the same hash is not uploaded (it is returned in :attr:`WriteStats.reused`: its bytes are
  already stored by the base checkpoint), the others are packed as above as their hashes
  arrive, and each object starts uploading as soon as it is cut. A device or strided tensor is
  copied to host for hashing under the same ``max_staging_bytes`` bound, and copied again only
  if it is uploaded. Without ``hashing`` nothing is hashed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from cloudckpt.dataplane.buffers import byte_view, host_contiguous, is_byte_viewable
from cloudckpt.checksum import block_crcs, hash_and_block_crcs
from cloudckpt.layout import data_key
from cloudckpt.planning.batching import pack_in_order


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How data objects are cut and how much host memory copies may take."""

    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20


#: Items hashed per worker-thread call (at most, and about this many bytes at most).
_HASH_BATCH_ITEMS = 64
_HASH_BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class ChunkLocation:
    """Where one written item's bytes are: object key, byte offset and length, per-block crcs;
    ``content_hash`` (16 bytes) when the write hashed, else ``b""``."""

    chunk_id: int
    object_key: str
    byte_offset: int
    byte_length: int
    crcs: tuple[int, ...]
    content_hash: bytes = b""


@dataclass(frozen=True)
class WriteStats:
    """Bytes and objects uploaded; ``reused``: ``(chunk_id, content hash)`` of the items not
    uploaded because ``known`` holds their hash (``bytes_reused`` of them)."""

    bytes_written: int
    objects: int
    reused: tuple[tuple[int, bytes], ...] = ()
    bytes_reused: int = 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


async def write_chunks(store, items: Sequence[tuple[int, torch.Tensor]], *, rank: int,
                       attempt: str, options: WriterOptions = WriterOptions(),
                       hashing: bool = False, known: Mapping[int, bytes] | None = None,
                       first_index: int = 0) -> tuple[list[ChunkLocation], WriteStats]:
    """Upload ``items`` (``(chunk_id, tensor)`` pairs) as data objects of save ``attempt``,
    numbered from ``first_index`` (a writer calling this several times for one attempt passes
    the count of objects its earlier calls wrote).

    Returns one :class:`ChunkLocation` per uploaded item, in the order of ``items`` (every item
    unless ``known`` is given: see the module docstring; ``known`` implies ``hashing``).
    """
    sizes = [_nbytes(t) for _, t in items]
    locations: list[ChunkLocation | None] = [None] * len(items)
    staging_budget = _ByteBudget(options.max_staging_bytes)
    hashes: list[bytes] = [b""] * len(items)
    known_crcs: list[tuple[int, ...] | None] = [None] * len(items)  # from the hashing pass

    async def upload(obj_index: int, members: list[int]) -> int:
        key = data_key(attempt, rank, first_index + obj_index)
        needs_copy = sum(sizes[i] for i in members
                         if not is_byte_viewable(items[i][1]))
        async with staging_budget.hold(needs_copy):
            if needs_copy:
                tensors = await asyncio.to_thread(
                    lambda: [host_contiguous(items[i][1]) for i in members])
            else:
                tensors = [items[i][1] for i in members]
            views = [byte_view(t) for t in tensors]
            crcs = [known_crcs[i] for i in members]
            todo = [k for k, c in enumerate(crcs) if c is None]
            if todo:
                computed = await asyncio.to_thread(
                    lambda vs=views: [block_crcs(vs[k], options.checksum_block_size)
                                      for k in todo])
                for k, c in zip(todo, computed):
                    crcs[k] = c
            offset = 0
            for i, view, crc in zip(members, views, crcs):
                locations[i] = ChunkLocation(items[i][0], key, offset, len(view), crc, hashes[i])
                offset += len(view)
            segments = [v for v in views if len(v)]
            await store.put(key, segments if segments else b"")
            del tensors, views, segments
        return offset

    tasks: list[asyncio.Future] = []
    reused: list[int] = []
    try:
        if hashing or known:
            await _hash_and_pack(items, sizes, hashes, known_crcs, known or {}, options,
                                 staging_budget, reused, lambda members: tasks.append(
                                     asyncio.ensure_future(upload(len(tasks), members))), tasks)
        else:
            tasks += [asyncio.ensure_future(upload(k, members))
                      for k, members in enumerate(pack_in_order(sizes, options.object_size))]
        written = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    stats = WriteStats(sum(written), len(tasks),
                       reused=tuple((items[i][0], hashes[i]) for i in reused),
                       bytes_reused=sum(sizes[i] for i in reused))
    return [loc for loc in locations if loc is not None], stats


async def _hash_and_pack(items, sizes, hashes, crcs, known, options, budget, reused, launch,
                         tasks) -> None:
    """Hash every item in order and compute its block crcs (``hashes[i]``, ``crcs[i]``; batches
    in a worker thread); items whose hash ``known`` holds go to ``reused``, the others are cut
    into objects by the rule of ``pack_in_order`` and each object is passed to ``launch`` as
    soon as it is cut."""
    current: list[int] = []
    filled = 0
    for batch in _batches(sizes):
        copies = sum(sizes[i] for i in batch if not is_byte_viewable(items[i][1]))
        async with budget.hold(copies):
            digests = await asyncio.to_thread(_digest_tensors, [items[i][1] for i in batch],
                                              options.checksum_block_size)
        for i, (digest, item_crcs) in zip(batch, digests):
            hashes[i], crcs[i] = digest, item_crcs
            if known.get(items[i][0]) == digest:
                reused.append(i)
                continue
            if current and filled + sizes[i] > options.object_size:
                launch(current)
                current, filled = [], 0
            current.append(i)
            filled += sizes[i]
        failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
        if failed is not None:
            await failed  # an upload failed: stop hashing, raise its error
    if current:
        launch(current)


def _batches(sizes: Sequence[int]):
    batch: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if batch and (len(batch) >= _HASH_BATCH_ITEMS or filled + n > _HASH_BATCH_BYTES):
            yield batch
            batch, filled = [], 0
        batch.append(i)
        filled += n
    if batch:
        yield batch


def _digest_tensors(tensors, block_size: int) -> list[tuple[bytes, tuple[int, ...]]]:
    return [hash_and_block_crcs(byte_view(host_contiguous(t)), block_size) for t in tensors]


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
