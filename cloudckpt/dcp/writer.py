"""``cloudckpt.dcp.StorageWriter``: torch DCP's ``StorageWriter`` on cloudckpt's storage.

```python
import torch.distributed.checkpoint as dcp
from cloudckpt.dcp import StorageWriter
dcp.save(state_dict, storage_writer=StorageWriter("s3://bucket/run/step-100"))
```

The checkpoint is DCP's own layout: data files ``__<rank>_<n>.distcp`` holding ``torch.save``
archives of the items (see :mod:`cloudckpt.dcp.items`) and ``.metadata``, DCP's pickled
``Metadata``; copied to a folder, ``FileSystemReader`` loads it. What cloudckpt adds:

- uploads through cloudckpt's store: tensors sent from their own memory, large files multipart,
  files of a rank concurrently, retries, a bounded number of copies (:class:`DCPOptions`);
- crc32c of every block of every item in ``.metadata.checksums``, written before ``.metadata``
  (see :mod:`cloudckpt.dcp.metadata`); :class:`cloudckpt.dcp.StorageReader` verifies them;
- the commit rule of cloudckpt: ``.metadata`` is written last, in create mode. A prefix that
  already holds a ``.metadata`` is refused before anything is written (``CheckpointExists``;
  DCP reports it as its ``CheckpointException`` naming the coordinator), and so is a
  ``.metadata`` created meanwhile by another writer: the first commit stays.

Every DCP planner works: the writer only stores what ``planner.resolve_data`` gives (tensors on
any device, views, ``io.BytesIO`` values). ``dcp.async_save`` works too (DCP stages the state on
the CPU, then calls this writer from its thread). With ``use_collectives=False`` each rank
writes ``__<rank>_*.distcp`` and its own ``__<rank>.metadata``, as DCP's ``FileSystemWriter``.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from dataclasses import dataclass

from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as _TorchStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from cloudckpt.dcp.metadata import ItemChecksums
from cloudckpt.dcp.options import DCPOptions
from cloudckpt.dcp.writes import DCP_VERSION, FileOptions, commit, refuse_existing, write_files
from cloudckpt.errors import ConfigError
from cloudckpt.runtime.loop import run_coroutine, shared_store


@dataclass(frozen=True)
class FilePrefix:
    """A rank's data file names start with this (``__<rank>_``): the plan's storage data."""

    prefix: str


@dataclass(frozen=True)
class ChecksummedWriteResult(WriteResult):
    """DCP's ``WriteResult`` with the item's checksums, on their way to the coordinator's
    ``finish`` (which stores plain ``_StorageInfo`` in ``.metadata``)."""

    checksums: ItemChecksums | None = None


def checkpoint_url(checkpoint_id) -> str:
    """A DCP ``checkpoint_id`` as a store URL (``s3://...``, ``file://...`` or a path)."""
    from cloudckpt.storage.urls import parse_store_url

    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise ConfigError(
            f"a checkpoint id must be a URL or a path, got {type(checkpoint_id).__name__}"
        )
    url = os.fspath(checkpoint_id)
    parse_store_url(url)  # ConfigError with a hint for anything else
    return url.rstrip("/") if url.startswith("s3://") else url


def valid_checkpoint_id(checkpoint_id) -> bool:
    try:
        checkpoint_url(checkpoint_id)
    except ConfigError:
        return False
    return True


class StorageWriter(_TorchStorageWriter):
    """DCP storage writer for ``url`` (``s3://BUCKET/PATH``, ``file:///PATH`` or a path).

    ``storage``: :class:`cloudckpt.storage.StorageOptions` (endpoint, credentials, retries;
    ``None``: the standard AWS chain). ``options``: :class:`DCPOptions`. See the module doc.
    """

    def __init__(self, url: str | os.PathLike, storage=None, *, options: DCPOptions | None = None):
        super().__init__()
        self.url = checkpoint_url(url)
        self.storage = storage
        self.options = options or DCPOptions()
        self.save_id = str(uuid.uuid4())
        self.is_coordinator = False
        self.rank: int | None = None
        self.use_collectives = True

    # -- DCP's StorageWriter interface ----------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id:
            self.url = checkpoint_url(checkpoint_id)
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    @property
    def checkpoint_id(self) -> str:
        return self.url

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if self._rank_local():
            run_coroutine(refuse_existing(self._store(), self.url, self.rank))
            return dataclasses.replace(plan, storage_data=FilePrefix(f"__{self.rank}_"))
        if self.is_coordinator:
            run_coroutine(refuse_existing(self._store(), self.url))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=FilePrefix(f"__{i}_"))
            if plan.storage_data is None
            else plan
            for i, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = plan.items
        sizes = [
            0 if it.type == WriteItemType.BYTE_IO else (it.tensor_storage_size() or 0)
            for it in items
        ]
        o = self.options
        written = run_coroutine(
            write_files(
                self._store(),
                sizes,
                lambda i: planner.resolve_data(items[i]),
                prefix=plan.storage_data.prefix,
                options=FileOptions(
                    object_size=o.object_size,
                    checksum_block_size=o.checksum_block_size,
                    max_staging_bytes=o.max_staging_bytes,
                ),
            )
        )
        results: list[WriteResult] = [
            ChecksummedWriteResult(
                index=item.index,
                size_in_bytes=w.info.length,
                storage_data=w.info,
                checksums=w.checks,
            )
            for item, w in zip(items, written)
        ]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage_md, checks = {}, {}
        for rank_results in results:
            for wr in rank_results:
                storage_md[wr.index] = wr.storage_data
                found = getattr(wr, "checksums", None)
                if found is not None:
                    checks[(wr.storage_data.relative_path, wr.storage_data.offset)] = found
        metadata.version = DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        run_coroutine(
            commit(
                self._store(),
                self.url,
                metadata,
                checks,
                save_id=self.save_id,
                block_size=self.options.checksum_block_size,
                rank=self.rank if self._rank_local() else None,
            )
        )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return valid_checkpoint_id(checkpoint_id)

    # -- helpers ----------------------------------------------------------------------------------

    def _rank_local(self) -> bool:
        return not self.use_collectives and self.rank is not None

    def _store(self):
        return shared_store(self.url, self.storage)
