"""``cloudckpt.dcp.StorageReader``: torch DCP's ``StorageReader`` on cloudckpt's storage.

```python
import torch.distributed.checkpoint as dcp
from cloudckpt.dcp import StorageReader
dcp.load(state_dict, storage_reader=StorageReader("s3://bucket/run/step-100"))
```

Reads any DCP checkpoint laid out as ``FileSystemWriter`` lays it out (``.metadata`` and
``*.distcp`` files): one written by :class:`cloudckpt.dcp.StorageWriter`, or by
``FileSystemWriter`` / s3torchconnector / fsspec and uploaded. Every DCP planner works
(resharding included: ``planner.resolve_tensor`` / ``commit_tensor`` / ``load_bytes``).

- ``.metadata`` is read by cloudckpt's own bounded pickle parser, which admits only DCP's
  metadata classes and builds them itself (:mod:`cloudckpt.dcp.metadata`): a hostile
  ``.metadata`` raises :class:`~cloudckpt.errors.ManifestError` in bounded time and memory,
  runs nothing and changes no class.
- With a checksums file that belongs to this ``.metadata`` (written by cloudckpt's writer), every
  byte that reaches a destination was verified by crc32c: a damaged byte raises
  :class:`~cloudckpt.errors.ChecksumError` naming the file and range. Without one the files load
  as they are (``torch.load(weights_only=True)`` of each item).
- Non-tensor values go to ``planner.load_bytes``; DCP's default planner unpickles them with
  ``weights_only=False``, which runs any code a value names. So before the planner sees a value
  this reader loads it with ``torch.load(weights_only=True)``; a value that needs more than
  torch's allow-list is refused (:class:`~cloudckpt.errors.PickleNotAllowed`) unless
  ``allow_pickle=True`` (trust the checkpoint's writer).
- Reads are batched, coalesced, concurrent and bounded in memory (:mod:`cloudckpt.dcp.reads`,
  :class:`DCPOptions`); tensors whose bytes are stored as one run land in the destination with
  no buffer.
"""

from __future__ import annotations

import io
import logging
import os
import re
import uuid

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader as _TorchStorageReader
from torch.futures import Future

from cloudckpt.dcp.metadata import (
    MAX_METADATA_BYTES,
    Checksums,
    checksums_key,
    decode_checksums,
    metadata_key,
    read_metadata,
)
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.reads import ChunkIndex, Part, read_parts
from cloudckpt.dcp.writer import checkpoint_url, valid_checkpoint_id
from cloudckpt.errors import (
    CheckpointNotFound,
    IntegrityError,
    ManifestError,
    ObjectNotFound,
    ObjectTooLarge,
    PickleNotAllowed,
)
from cloudckpt.runtime.loop import run_coroutine, shared_store

log = logging.getLogger(__name__)


async def fetch_small(store, key: str, what: str) -> bytes:
    """The bytes of ``.metadata`` or its checksums file, refused unread when over the limit."""
    try:
        return await store.get(key, max_bytes=MAX_METADATA_BYTES)
    except ObjectTooLarge as exc:
        raise ManifestError(
            f"is {exc.size} bytes, more than the {MAX_METADATA_BYTES} allowed "
            "(refused without reading it)",
            path=what,
        ) from exc


def load_checkpoint_metadata(
    store, url: str, rank: int | None = None
) -> tuple[Metadata, Checksums | None]:
    """The checked ``Metadata`` of the DCP checkpoint at ``url`` and the checksums that belong
    to it (None without a matching checksums file). ``CheckpointNotFound`` without
    ``.metadata``."""
    key = metadata_key(rank)
    try:
        raw = run_coroutine(fetch_small(store, key, key))
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no DCP checkpoint at {url} (no {key})") from exc
    metadata = read_metadata(raw)
    try:
        sidecar = decode_checksums(
            run_coroutine(fetch_small(store, checksums_key(rank), checksums_key(rank)))
        )
    except ObjectNotFound:
        return metadata, None
    if sidecar.matches(raw):
        return metadata, sidecar
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None and getattr(meta, "save_id", None) == sidecar.save_id:
        raise IntegrityError(
            f"{url}/{key} does not match the checksums its save wrote: the .metadata is damaged"
        )
    log.warning(
        "%s: %s belongs to another save (the prefix was written again): loading without checksums",
        url,
        checksums_key(rank),
    )
    return metadata, None


class _PlannerConsumer:
    """Hands what :func:`read_parts` reads to a DCP load planner."""

    def __init__(self, planner: LoadPlanner, allow_pickle: bool):
        self.planner = planner
        self.allow_pickle = allow_pickle

    def target(self, part: Part) -> torch.Tensor:
        return self.planner.resolve_tensor(part.ref).detach()

    def commit(self, part: Part, tensor: torch.Tensor) -> None:
        self.planner.commit_tensor(part.ref, tensor)

    def take_bytes(self, part: Part, data: bytes) -> None:
        if not self.allow_pickle:
            check_value(data, part.ref.storage_index.fqn)
        self.planner.load_bytes(part.ref, io.BytesIO(data))


def check_value(data: bytes, fqn: str):
    """Load a stored non-tensor value with ``torch.load(weights_only=True)`` (returns it);
    ``PickleNotAllowed`` when torch's restricted unpickler refuses it."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
        named = re.search(r"GLOBAL ([\w.]+)", text)
        why = f"it names {named.group(1)}" if named else " ".join(text.split())[:120]
        raise PickleNotAllowed(
            f"value {fqn!r} of the DCP checkpoint cannot be read by torch.load(weights_only=True) "
            f"({why}); DCP's planner would unpickle it with weights_only=False, which runs any "
            "code it names: pass allow_pickle=True to cloudckpt.dcp.StorageReader only if you "
            "trust who wrote the checkpoint"
        ) from exc


class StorageReader(_TorchStorageReader):
    """DCP storage reader for ``url`` (``s3://BUCKET/PATH``, ``file:///PATH`` or a path).

    ``storage``: :class:`cloudckpt.storage.StorageOptions`; ``options``: :class:`DCPOptions`;
    ``allow_pickle``: hand non-tensor values that torch's ``weights_only`` unpickler refuses to
    the planner anyway. See the module doc.
    """

    def __init__(
        self,
        url: str | os.PathLike,
        storage=None,
        *,
        options: DCPOptions | None = None,
        allow_pickle: bool = False,
    ):
        super().__init__()
        self.url = checkpoint_url(url)
        self.storage = storage
        self.options = options or DCPOptions()
        self.allow_pickle = allow_pickle
        self.load_id = str(uuid.uuid4())
        self.storage_data: dict = {}
        self.rank: int | None = None
        self.use_collectives = True
        self._read: tuple[Metadata, Checksums | None] | None = None
        self._checksums: Checksums | None = None
        self._chunks: ChunkIndex | None = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.url = checkpoint_url(checkpoint_id)
        self.storage_data = {}
        self._read = None
        self._checksums = self._chunks = None
        self.load_id = str(uuid.uuid4())

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata, checksums = load_checkpoint_metadata(self._store(), self.url, kwargs.get("rank"))
        meta = getattr(metadata, "storage_meta", None)
        if meta is None:
            meta = metadata.storage_meta = StorageMeta()
        meta.load_id = self.load_id
        self._read = (metadata, checksums)
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args, **kwargs
    ) -> None:
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)
        if self._read is None or self._read[0] is not metadata:
            # metadata that did not come from read_metadata: check it, find its checksums
            from cloudckpt.dcp.metadata import check_metadata

            check_metadata(metadata)
            self._checksums = None
            log.info("%s: metadata not read by this reader: loading without checksums", self.url)
        else:
            self._checksums = self._read[1]
        self.storage_data = metadata.storage_data
        self._chunks = ChunkIndex(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if self._chunks is None:  # (its storage_data is empty too: no part could be found)
            raise RuntimeError("read_data before set_up_storage_reader")
        chunks = self._chunks
        parts = [
            Part(
                ref=item,
                index=item.storage_index,
                is_bytes=item.type == LoadItemType.BYTE_IO,
                offsets=tuple(item.storage_offsets),
                lengths=tuple(item.lengths),
            )
            for item in plan.items
        ]
        sums = self._checksums
        read_parts(
            self._store(),
            parts,
            storage_data=self.storage_data,
            checksums=sums.items if sums is not None else None,
            chunks=chunks,
            consumer=_PlannerConsumer(planner, self.allow_pickle),
            batch_bytes=self.options.read_batch_bytes,
            max_bytes=self.options.max_read_bytes,
            block_size=sums.block_size if sums is not None else 1,
        )
        future: Future[None] = Future()
        future.set_result(None)
        return future

    @property
    def checkpoint_id(self) -> str:
        return self.url

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_checkpoint_id(checkpoint_id)

    def _store(self):
        return shared_store(self.url, self.storage)
