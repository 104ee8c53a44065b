"""Writing DCP items into data files of a store, and the commit of a DCP checkpoint.

Shared by :class:`cloudckpt.dcp.StorageWriter` and ``cloudckpt.convert``.

Contract of :func:`write_files`:
- Items are packed in the order given into data files of about ``object_size`` bytes (an item
  larger than that gets a file of its own), named ``<prefix><n>.distcp`` as DCP names them
  (``__<rank>_<n>.distcp``).
- Each item's data is resolved lazily (``resolve(i)``), in worker threads, when its file is
  about to be written; a tensor that is not a contiguous CPU tensor owning its storage is copied
  first, with at most ``max_staging_bytes`` of such copies alive at once (a file needing more
  waits until it can hold the budget alone). Other tensors are uploaded from their own memory.
- Files upload concurrently (multipart for large ones; the store bounds requests in flight). On
  the first failure the other uploads are cancelled and the error propagates.
- Returns, per item, its ``_StorageInfo`` (file, offset, length) and its
  :class:`~cloudckpt.dcp.metadata.ItemChecksums`.

:func:`commit` writes the checksums file, then ``.metadata`` in create mode: a checkpoint is
complete exactly when its ``.metadata`` exists, and an existing one is never replaced
(:class:`~cloudckpt.errors.CheckpointExists`).
"""

from __future__ import annotations

import asyncio
import io
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from cloudckpt.checksum import crc32c
from cloudckpt.dcp.items import Item, block_crcs_of, bytes_item, owns_its_storage, tensor_item
from cloudckpt.dcp.metadata import (
    Checksums,
    ItemChecksums,
    checksums_key,
    encode_checksums,
    metadata_key,
)
from cloudckpt.errors import CheckpointExists, ObjectExists, ObjectNotFound
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.storage.base import ByteBudget, run_all

DATA_SUFFIX = ".distcp"
DCP_VERSION: str
try:  # DCP's format version of the metadata, as FileSystemWriter records it
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    DCP_VERSION = CURRENT_DCP_VERSION
except ImportError:  # pragma: no cover - older torch
    DCP_VERSION = "1.0.0"


@dataclass(frozen=True, kw_only=True)
class FileOptions:
    object_size: int = 128 << 20
    checksum_block_size: int = 4 << 20
    max_staging_bytes: int = 256 << 20


class StoredAt(Protocol):
    """Where an item's bytes are: torch's ``filesystem._StorageInfo``, as read here."""

    @property
    def relative_path(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


@dataclass(frozen=True)
class Written:
    """Where one item landed and its checksums."""

    info: StoredAt  # torch's _StorageInfo
    checks: ItemChecksums


def _as_item(data) -> Item:
    if isinstance(data, torch.Tensor):
        return tensor_item(data)
    if isinstance(data, (io.BytesIO, bytes, bytearray, memoryview)):
        return bytes_item(data)
    raise TypeError(f"a DCP item resolves to a tensor or io.BytesIO, got {type(data).__name__}")


def _build(data: list, block: int) -> list[tuple[Item, list[int]]]:
    """Each resolved datum as an item, with its block crcs."""
    out = []
    for d in data:
        item = _as_item(d)
        out.append((item, block_crcs_of(item.segments, block)))
    return out


def _copy_bytes(data) -> int:
    """Bytes a copy of ``data`` takes before upload (tensors that do not own their storage)."""
    if isinstance(data, torch.Tensor) and not owns_its_storage(data.detach()):
        return data.numel() * data.element_size()
    return 0


async def write_files(
    store,
    sizes: Sequence[int],
    resolve: Callable[[int], object],
    *,
    prefix: str,
    options: FileOptions,
    first_file: int = 0,
) -> list[Written]:
    """Write items ``0 .. len(sizes) - 1`` (``sizes``: their expected bytes, for packing) into
    data files (module doc), numbered from ``first_file``."""
    from cloudckpt.statedict.torch_private import storage_info_class

    _StorageInfo = storage_info_class()

    groups = pack_in_order(list(sizes), options.object_size)
    written: list[Written | None] = [None] * len(sizes)
    budget = ByteBudget(max(1, options.max_staging_bytes))
    block = options.checksum_block_size

    async def upload(n: int, members: list[int]) -> None:
        name = f"{prefix}{first_file + n}{DATA_SUFFIX}"
        data = await asyncio.to_thread(lambda: [resolve(i) for i in members])
        held = await budget.acquire(sum(_copy_bytes(d) for d in data))
        try:
            built = await asyncio.to_thread(_build, data, block)
            data.clear()
            offset = 0
            for i, (item, crcs) in zip(members, built):
                length = item.length
                written[i] = Written(
                    _StorageInfo(name, offset, length),
                    ItemChecksums(length, item.data_offset, tuple(crcs)),
                )
                offset += length
            segments = [s for item, _ in built for s in item.segments if len(s)]
            await store.put(name, segments if segments else b"")
            del built, segments
        finally:
            budget.release(held)

    await run_all([upload(n, members) for n, members in enumerate(groups)])
    return [w for w in written if w is not None]


def refuse_existing(store, url: str, rank: int | None = None):
    """Coroutine: raise ``CheckpointExists`` when the checkpoint's ``.metadata`` exists."""

    async def check() -> None:
        try:
            await store.head(metadata_key(rank))
        except ObjectNotFound:
            return
        raise CheckpointExists(
            f"a DCP checkpoint is already committed at {url} (its "
            f"{metadata_key(rank)} exists); save to a new prefix"
        )

    return check()


async def commit(
    store,
    url: str,
    metadata,
    checks: dict,
    *,
    save_id: str,
    block_size: int,
    rank: int | None = None,
) -> int:
    """Write the checksums file, then the pickled ``metadata`` as ``.metadata`` (or
    ``__<rank>.metadata``) in create mode. ``checks``: ``(file, offset) -> ItemChecksums``.
    Returns the size of ``.metadata``."""
    raw = pickle.dumps(metadata)
    sidecar = Checksums(
        save_id=save_id,
        block_size=block_size,
        metadata_crc32c=crc32c(raw),
        metadata_size=len(raw),
        items=checks,
    )
    await store.put(checksums_key(rank), encode_checksums(sidecar))
    try:
        await store.put(metadata_key(rank), raw, mode="create")
    except ObjectExists as exc:
        raise CheckpointExists(
            f"a DCP checkpoint was committed at {url} meanwhile (its {metadata_key(rank)} exists)"
        ) from exc
    return len(raw)
