"""Writing a checkpoint piece by piece, in one process and bounded memory. No collective.
(Reading one piece at a time: :class:`cloudckpt.api.read_tensors.TensorReader`.)

Used by ``cloudckpt.convert`` (:mod:`cloudckpt.dcp.convert`), which streams a checkpoint of
another format in without holding it in memory.

```python
out = StreamingSave("s3://bucket/other")              # refuses a committed checkpoint there
out.add_tensor("w", "float32", (16, 16))
out.write("w", (0, 0), t)                             # kept until about batch_bytes, then uploaded
out.write("w", (8, 0), torch.zeros(8, 16))
out.set_value("step", 7)
result = out.commit()                                 # the manifest last, in create mode
```

Contract of :class:`StreamingSave`:
- Pieces are uploaded as data objects (the save's own ``data/<attempt>/`` objects, crc32c per
  checksum block, as :func:`cloudckpt.save` writes them) once about ``batch_bytes`` of them
  are waiting, so memory holds at most one batch (plus what the caller holds).
- :meth:`commit` uploads what is left, builds the manifest (every tensor's pieces must cover
  it exactly once: :class:`~cloudckpt.errors.CoverageError` otherwise, and nothing is
  committed) and writes it in create mode: the checkpoint exists only then, and a checkpoint
  committed at the URL meanwhile stays (:class:`~cloudckpt.errors.CheckpointExists`).
  ``cloudckpt.load``, ``load_full`` and ``verify`` accept the result like any other.
- A ``StreamingSave`` that is dropped without :meth:`commit` leaves data objects and no
  manifest: an incomplete checkpoint that ``CheckpointManager.prune`` / ``cloudckpt rm``
  remove.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from cloudckpt import layout
from cloudckpt.dataplane.writer import WriterOptions, write_chunks
from cloudckpt.errors import CheckpointExists, ObjectExists, ObjectNotFound, PlanningError
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.planning.load.chunk_index import coverage_errors
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.statedict.dtypes import dtype_name


class StreamingSave:
    """Write the checkpoint at ``url`` from this process, piece by piece (module doc).

    ``storage``: :class:`cloudckpt.storage.StorageOptions`; ``options``: the
    :class:`~cloudckpt.SaveOptions` fields that apply (``object_size``,
    ``checksum_block_size``, ``max_staging_bytes``); ``batch_bytes``: pieces waiting before an
    upload; ``allow_pickle``: values msgpack cannot hold are pickled instead of refused.
    Raises :class:`~cloudckpt.errors.CheckpointExists` at once when ``url`` holds a committed
    checkpoint.
    """

    def __init__(
        self,
        url: str,
        *,
        storage=None,
        options: SaveOptions | None = None,
        batch_bytes: int = 256 << 20,
        allow_pickle: bool = False,
        metadata: dict | None = None,
    ):
        self.url = url
        self.storage = storage
        self.options = options or SaveOptions()
        self.batch_bytes = batch_bytes
        self.allow_pickle = allow_pickle
        self.started = time.perf_counter()
        self._store = shared_store(url, storage)  # opened once, used by every upload
        try:
            run_coroutine(self._store.head(layout.MANIFEST_KEY))
        except ObjectNotFound:
            pass
        else:
            raise CheckpointExists(f"a checkpoint is already committed at {url}")
        self.attempt = layout.new_attempt_id()
        self._builder = ManifestBuilder(
            world_size=1, metadata=metadata, checksum_block_size=self.options.checksum_block_size
        )
        self._dtypes: dict[str, str] = {}
        self._order: list[tuple[str, str]] = []  # (name, "x" | "v") in the order added
        self._waiting: list[tuple[str, tuple[int, ...], torch.Tensor]] = []
        self._waiting_bytes = 0
        self._objects = 0
        self.bytes_written = 0

    def add_tensor(self, name: str, dtype: str | torch.dtype, shape: Sequence[int]) -> None:
        """Declare tensor ``name`` (its pieces come through :meth:`write`)."""
        dtype = dtype_name(dtype) if isinstance(dtype, torch.dtype) else dtype
        self._builder.add_tensor(name, dtype, shape)
        self._dtypes[name] = dtype
        self._order.append((name, "x"))

    def write(self, name: str, offsets: Sequence[int], tensor: torch.Tensor) -> None:
        """The piece of tensor ``name`` at ``offsets`` (its shape is the piece's sizes). The
        tensor is kept, unchanged by the caller, until it is uploaded."""
        if name not in self._dtypes:
            raise PlanningError(f"write of {name!r}: call add_tensor first")
        if dtype_name(tensor.dtype) != self._dtypes[name]:
            raise PlanningError(
                f"piece of {name!r} is {tensor.dtype}, the tensor {self._dtypes[name]}"
            )
        if tensor.numel() == 0:
            return
        self._waiting.append((name, tuple(int(o) for o in offsets), tensor))
        self._waiting_bytes += tensor.numel() * tensor.element_size()
        if self._waiting_bytes >= self.batch_bytes:
            self._upload()

    def set_value(self, name: str, value: Any) -> None:
        """A non-tensor value (msgpack-able, or pickled with ``allow_pickle``; otherwise
        :class:`~cloudckpt.errors.UnsupportedValueError` and nothing is kept)."""
        self._builder.set_value(name, value, allow_pickle=self.allow_pickle)
        self._order.append((name, "v"))

    def commit(self, structure: Any = None) -> SaveResult:
        """Upload what waits, then write the manifest (module doc). ``structure`` (a
        :mod:`cloudckpt.statedict.flatten` structure) defaults to a flat dict of the names in the
        order they were added."""
        self._upload()
        if structure is None:
            structure = ["d", [[name, [tag, name]] for name, tag in self._order]]
        self._builder.structure = structure
        manifest = self._builder.build()
        problems = coverage_errors(manifest)
        if problems:
            raise problems[0]
        try:
            run_coroutine(
                self._store.put(layout.MANIFEST_KEY, encode_manifest(manifest), mode="create")
            )
        except ObjectExists as exc:
            raise CheckpointExists(f"a checkpoint was committed at {self.url} meanwhile") from exc
        return SaveResult(
            url=self.url,
            bytes_written=self.bytes_written,
            objects=self._objects,
            seconds=time.perf_counter() - self.started,
            rank_bytes_written=self.bytes_written,
            attempt=self.attempt,
        )

    def _upload(self) -> None:
        if not self._waiting:
            return
        waiting, self._waiting, self._waiting_bytes = self._waiting, [], 0
        o = self.options
        locations, stats = run_coroutine(
            write_chunks(
                self._store,
                [(i, t) for i, (_, _, t) in enumerate(waiting)],
                rank=0,
                attempt=self.attempt,
                options=WriterOptions(
                    object_size=o.object_size,
                    checksum_block_size=o.checksum_block_size,
                    max_staging_bytes=o.max_staging_bytes,
                ),
                first_index=self._objects,
            )
        )
        for loc in locations:
            name, offsets, tensor = waiting[loc.chunk_id]
            self._builder.add_chunk(
                name,
                offsets,
                tuple(tensor.shape),
                loc.object_key,
                loc.byte_offset,
                loc.byte_length,
                loc.crcs,
            )
        self._objects += stats.objects
        self.bytes_written += stats.bytes_written
