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
- With ``hashing`` (the default; a non-empty ``known`` implies it), every item's bytes get a
  content hash (:func:`cloudckpt.checksum.content_hash`) and their block crcs in one pass
  (:func:`cloudckpt.checksum.hash_and_block_crcs`: the bytes are read once, as without hashing).
  Without ``known`` (no base) that pass is the crc pass of each object as it uploads, packed as
  above. With ``known`` it runs in worker threads, in item order, ahead of the uploads; an item
  whose chunk id is in ``known``
  with the same hash *and* the same block crcs is not uploaded (it is returned in
  :attr:`WriteStats.reused`: its bytes are already stored by the base checkpoint), the others
  are packed as above as their hashes
  arrive, and each object starts uploading as soon as it is cut. A device or strided tensor is
  copied to host for hashing under the same ``max_staging_bytes`` bound, and copied again only
  if it is uploaded. Without ``hashing`` nothing is hashed.
- The hashing may start before the upload (:class:`ItemDigests`, passed as ``digests``: an
  incremental save hashes while its coordinator reads and pins the base); the upload then
  takes each item's values as they become ready.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from cloudckpt.checksum import block_crcs, hash_and_block_crcs
from cloudckpt.dataplane.buffers import byte_view, host_contiguous, is_byte_viewable
from cloudckpt.layout import data_key
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.planning.save.incremental import KnownChunk
from cloudckpt.storage.base import ByteBudget


@dataclass(frozen=True, kw_only=True)
class WriterOptions:
    """How data objects are cut and how much host memory copies may take."""

    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20


#: Chunk id -> the base's content hash and block crcs of that chunk (what ``write_chunks``
#: compares an item's own with).
KnownItems = Mapping[int, KnownChunk]

#: Items hashed per worker-thread call (at most, and about this many bytes at most).
_HASH_BATCH_ITEMS = 64
_HASH_BATCH_BYTES = 16 << 20


@dataclass(frozen=True)
class ChunkLocation:
    """Where one written item's bytes are: object key, byte offset and length, per-block crcs;
    ``content_hash`` (8 bytes: :func:`cloudckpt.checksum.content_hash`) when the write hashed,
    else ``b""``."""

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


def _crcs_of(views: Sequence[memoryview], block_size: int) -> list[tuple[int, ...]]:
    """The block crcs of each of ``views`` (run in a worker thread)."""
    return [block_crcs(v, block_size) for v in views]


def _hashes_and_crcs_of(
    views: Sequence[memoryview], block_size: int
) -> list[tuple[bytes, tuple[int, ...]]]:
    """The content hash and block crcs of each of ``views`` (run in a worker thread)."""
    return [hash_and_block_crcs(v, block_size) for v in views]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ItemDigests:
    """The content hash and block crcs of each of ``items`` (``(chunk_id, tensor)`` pairs), in
    item order, computed from :meth:`start` on (batches in a worker thread; device or strided
    tensors copied under ``options.max_staging_bytes``, a budget the upload given these digests
    shares).

    Start it early to overlap the hashing with other work, then pass it to :func:`write_chunks`
    with the same ``items`` and ``options``; :meth:`stop` it if the upload never runs. Both
    run on cloudckpt's loop."""

    def __init__(
        self, items: Sequence[tuple[int, torch.Tensor]], options: WriterOptions = WriterOptions()
    ):
        self.items = items
        self.block_size = options.checksum_block_size
        self.budget = ByteBudget(max(1, options.max_staging_bytes))
        self.hashes: list[bytes] = [b""] * len(items)
        self.crcs: list[tuple[int, ...] | None] = [None] * len(items)
        self.ready = 0  # items[:ready] are digested
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()

    async def start(self) -> None:
        """Start hashing (a task on the running loop); a second call does nothing."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
            self._task.add_done_callback(lambda _task: self._changed.set())

    async def stop(self) -> None:
        """Cancel the hashing and wait until it has stopped (nothing to do once it finished)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        items = self.items
        for batch in _batches([_nbytes(t) for _, t in items]):
            copies = sum(_nbytes(items[i][1]) for i in batch if not is_byte_viewable(items[i][1]))
            async with _holding(self.budget, copies):
                digests = await asyncio.to_thread(
                    _digest_tensors, [items[i][1] for i in batch], self.block_size
                )
            for i, (digest, crcs) in zip(batch, digests):
                self.hashes[i], self.crcs[i] = digest, crcs
            self.ready = batch[-1] + 1
            self._changed.set()

    async def wait_for(self, n: int) -> None:
        """Wait until ``items[:n]`` are digested; raise what stopped the hashing if it stopped
        before (``RuntimeError`` if it was cancelled or never started)."""
        while self.ready < n:
            task = self._task
            if task is None:
                raise RuntimeError("the hashing of these items was never started")
            if task.done():
                if task.cancelled():
                    raise RuntimeError("the hashing of this save's items was cancelled")
                raise task.exception() or RuntimeError("the hashing stopped early")
            self._changed.clear()
            await self._changed.wait()


async def write_chunks(
    store,
    items: Sequence[tuple[int, torch.Tensor]],
    *,
    rank: int,
    attempt: str,
    options: WriterOptions = WriterOptions(),
    hashing: bool = False,
    known: KnownItems | None = None,
    first_index: int = 0,
    digests: ItemDigests | None = None,
) -> tuple[list[ChunkLocation], WriteStats]:
    """Upload ``items`` (``(chunk_id, tensor)`` pairs) as data objects of save ``attempt``,
    numbered from ``first_index`` (a writer calling this several times for one attempt passes
    the count of objects its earlier calls wrote).

    Returns one :class:`ChunkLocation` per uploaded item, in the order of ``items`` (every item
    unless ``known``, chunk id -> ``(content hash, block crcs)`` of the base, is given: see the
    module docstring; a non-empty ``known`` or ``digests``, the :class:`ItemDigests` of these
    ``items`` already running, implies ``hashing``).
    """
    sizes = [_nbytes(t) for _, t in items]
    locations: list[ChunkLocation | None] = [None] * len(items)
    own_digests = digests is None and bool(known)  # a base: hash ahead, skip what it holds
    hash_on_upload = digests is None and hashing and not known  # no base: one pass per object
    if own_digests:
        digests = ItemDigests(items, options)
        await digests.start()
    elif digests is not None and len(digests.items) != len(items):
        raise ValueError("the digests given are not those of these items")
    if digests is not None:  # hashes and crcs come from the hashing pass
        staging_budget, hashes, known_crcs = digests.budget, digests.hashes, digests.crcs
    else:
        staging_budget = ByteBudget(max(1, options.max_staging_bytes))
        hashes, known_crcs = [b""] * len(items), [None] * len(items)

    async def upload(obj_index: int, members: list[int]) -> int:
        key = data_key(attempt, rank, first_index + obj_index)
        needs_copy = sum(sizes[i] for i in members if not is_byte_viewable(items[i][1]))
        async with _holding(staging_budget, needs_copy):
            if needs_copy:
                tensors = await asyncio.to_thread(
                    lambda: [host_contiguous(items[i][1]) for i in members]
                )
            else:
                tensors = [items[i][1] for i in members]
            views = [byte_view(t) for t in tensors]
            given = [known_crcs[i] for i in members]
            todo = [k for k, c in enumerate(given) if c is None]
            computed: dict[int, tuple[int, ...]] = {}
            if todo and hash_on_upload:
                digested = await asyncio.to_thread(
                    _hashes_and_crcs_of, [views[k] for k in todo], options.checksum_block_size
                )
                for k, (digest, item_crcs) in zip(todo, digested):
                    hashes[members[k]], computed[k] = digest, item_crcs
            elif todo:
                blocks = await asyncio.to_thread(
                    _crcs_of, [views[k] for k in todo], options.checksum_block_size
                )
                computed = dict(zip(todo, blocks))
            crcs = [c if c is not None else computed[k] for k, c in enumerate(given)]
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
        if digests is not None:
            await _pack_digested(
                items,
                sizes,
                digests,
                known or {},
                options,
                reused,
                lambda members: tasks.append(asyncio.ensure_future(upload(len(tasks), members))),
                tasks,
            )
        else:
            tasks += [
                asyncio.ensure_future(upload(k, members))
                for k, members in enumerate(pack_in_order(sizes, options.object_size))
            ]
        written = await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if own_digests and digests is not None:
            await digests.stop()
        raise
    stats = WriteStats(
        sum(written),
        len(tasks),
        reused=tuple((items[i][0], hashes[i]) for i in reused),
        bytes_reused=sum(sizes[i] for i in reused),
    )
    return [loc for loc in locations if loc is not None], stats


async def _pack_digested(
    items, sizes, digests: ItemDigests, known, options, reused, launch, tasks
) -> None:
    """Take every item in order as ``digests`` gets to it; items whose hash ``known`` holds go
    to ``reused``, the others are cut into objects by the rule of ``pack_in_order`` and each
    object is passed to ``launch`` as soon as it is cut."""
    current: list[int] = []
    filled = 0
    for i in range(len(items)):
        if digests.ready <= i:
            failed = next((t for t in tasks if t.done() and t.exception() is not None), None)
            if failed is not None:
                await failed  # an upload failed: stop here, raise its error
            await digests.wait_for(i + 1)
        if known.get(items[i][0]) == (digests.hashes[i], digests.crcs[i]):
            reused.append(i)
            continue
        if current and filled + sizes[i] > options.object_size:
            launch(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes[i]
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


@contextlib.asynccontextmanager
async def _holding(budget: ByteBudget, n: int):
    """Hold ``n`` bytes of ``budget`` (first come, first served; clipped to its limit) for the
    block. A holder never asks again before leaving, so the hashing and the uploads sharing one
    budget cannot wait for each other."""
    taken = await budget.acquire(n)
    try:
        yield
    finally:
        budget.release(taken)
