"""Reading parts of DCP items from a store: batched, coalesced, verified, bounded in memory.

A *part* is what one consumer wants from one stored item: a box of a stored tensor chunk, or a
whole non-tensor item. :func:`read_parts` reads a list of parts and hands each to a
:class:`Consumer`, always in the calling thread (DCP's planners are not thread-safe).

Contract:
- Before any buffer or destination exists, every item is checked against the real size of its
  data file (one HEAD per file, concurrently) and every wanted chunk's tensor against its item's
  length: an item past the end of its file raises :class:`~cloudckpt.errors.InvalidRange`
  (what reading it would raise), a tensor larger than its item
  :class:`~cloudckpt.errors.IntegrityError`.
- Items of one data file are read in offset order, in batches of about ``batch_bytes``, each one
  ``read_ranges`` call (the store coalesces neighbouring ranges into few large GETs and runs them
  concurrently); several batches are in flight while their fetched bytes stay under
  ``max_bytes`` (a batch larger than that runs alone).
- An item with checksums (written by :class:`cloudckpt.dcp.StorageWriter`) is read in whole
  checksum blocks, each verified before any of its bytes reaches a destination: a damaged byte
  raises :class:`~cloudckpt.errors.ChecksumError` naming the file and range. When the wanted box
  is one contiguous run of the stored chunk and the destination a contiguous CPU tensor of the
  stored dtype, the verified bytes land straight in the destination; otherwise in a buffer of
  the box's span, copied out (dtype converted) afterwards.
- An item without checksums (written by ``FileSystemWriter`` and the like) is read whole and
  given to ``torch.load(weights_only=True)``; stream transforms named by its
  ``transform_descriptors`` are applied first (torch's extension registry).
- The consumer's ``target`` is asked for a batch's destinations just before the batch is read,
  ``commit`` / ``take_bytes`` once its bytes are in place.
"""

from __future__ import annotations

import collections
import functools
import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from cloudckpt.dcp.items import byte_view, load_tensor, region_span
from cloudckpt.dcp.metadata import ItemChecksums
from cloudckpt.errors import IntegrityError, InvalidRange, ManifestError
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.runtime.loop import run_coroutine, start_task
from cloudckpt.storage.base import ReadRange, run_all

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata


@dataclass(frozen=True)
class Part:
    """One wanted piece of stored item ``index``: a box (``offsets``, ``lengths``) of its tensor
    chunk, or, with ``is_bytes``, the whole non-tensor item. ``ref`` is the consumer's own
    handle (a DCP ``ReadItem``, say)."""

    ref: Any
    index: Any
    is_bytes: bool
    offsets: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()


class Consumer(Protocol):
    def target(self, part: Part) -> torch.Tensor:
        """The tensor (of the box's shape) the part's values go into."""

    def commit(self, part: Part, tensor: torch.Tensor) -> None:
        """The part's values are in ``tensor`` (the one ``target`` gave)."""

    def take_bytes(self, part: Part, data: bytes) -> None:
        """The stored bytes of a non-tensor item."""


@dataclass
class _Unit:
    """One stored item and the parts wanting it."""

    index: Any
    info: Any
    checks: ItemChecksums | None
    dtype: torch.dtype | None
    sizes: tuple[int, ...]
    parts: list = field(default_factory=list)

    def cost(self) -> int:
        if self.checks is None or any(p.is_bytes for p in self.parts) or self.dtype is None:
            return self.info.length
        item = self.dtype.itemsize
        return sum(
            b - a
            for a, b, _ in (region_span(self.sizes, p.offsets, p.lengths, item) for p in self.parts)
        )


class ChunkIndex:
    """dtype and sizes of every stored tensor chunk, by ``(fqn, offsets)`` (from the metadata)."""

    def __init__(self, metadata: Metadata) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.chunks: dict = {}
        for fqn, entry in metadata.state_dict_metadata.items():
            if isinstance(entry, TensorStorageMetadata):
                for chunk in entry.chunks:
                    self.chunks[(fqn, tuple(chunk.offsets))] = (
                        entry.properties.dtype,
                        tuple(chunk.sizes),
                    )

    def of(self, index) -> tuple[torch.dtype, tuple[int, ...]]:
        key = (index.fqn, tuple(index.offset or ()))
        if key not in self.chunks:
            raise ManifestError(
                f"no stored chunk of {index.fqn!r} at {key[1]}",
                path=".metadata state_dict_metadata",
            )
        return self.chunks[key]


def read_parts(
    store,
    parts: Sequence[Part],
    *,
    storage_data,
    checksums: dict | None,
    chunks: ChunkIndex,
    consumer: Consumer,
    batch_bytes: int,
    max_bytes: int,
    block_size: int,
    allow_transforms: bool = True,
) -> int:
    """Read ``parts`` (module doc). Returns the bytes fetched."""
    units: dict = {}
    for part in parts:
        unit = units.get(part.index)
        if unit is None:
            info = storage_data.get(part.index)
            if info is None:
                raise ManifestError(
                    f"no storage entry for {part.index.fqn!r}", path=".metadata storage_data"
                )
            checks = (checksums or {}).get((info.relative_path, info.offset))
            if checks is not None and checks.length != info.length:
                raise IntegrityError(
                    f"{info.relative_path} at {info.offset}: the checksums "
                    f"file says {checks.length} bytes, .metadata {info.length}"
                )
            dtype, sizes = (None, ()) if part.is_bytes else chunks.of(part.index)
            unit = units[part.index] = _Unit(part.index, info, checks, dtype, sizes)
            _check_fits(unit)
        unit.parts.append(part)
    _check_files(store, units.values())
    ordered = sorted(units.values(), key=lambda u: (u.info.relative_path, u.info.offset))
    batches: list[list[_Unit]] = []
    by_file: dict[str, list[_Unit]] = collections.defaultdict(list)
    for u in ordered:
        by_file[u.info.relative_path].append(u)
    for file_units in by_file.values():
        for group in pack_in_order([u.cost() for u in file_units], batch_bytes):
            batches.append([file_units[i] for i in group])

    fetched = 0
    pending: collections.deque = collections.deque()
    in_flight = 0
    try:
        for batch in batches:
            prepared = _Batch(batch, consumer, block_size, allow_transforms)
            while pending and in_flight + prepared.nbytes > max_bytes:
                done, task = pending.popleft()
                if task is not None:
                    task.result()
                in_flight -= done.nbytes
                fetched += done.deliver()
            task = (
                start_task(store.read_ranges(prepared.key, prepared.ranges))
                if prepared.ranges
                else None
            )
            pending.append((prepared, task))
            in_flight += prepared.nbytes
        while pending:
            done, task = pending[0]
            if task is not None:
                task.result()
            pending.popleft()
            fetched += done.deliver()
    finally:
        # on an error, the reads still in flight stop before this returns: none of them
        # writes into a destination afterwards
        for _, task in pending:
            if task is not None:
                task.cancel_and_wait()
    return fetched


def _check_fits(unit: _Unit) -> None:
    """The chunk's tensor fits in its item (before anything is allocated for either)."""
    if unit.dtype is None:
        return
    nbytes = unit.dtype.itemsize * math.prod(unit.sizes)
    start = unit.checks.data_offset if unit.checks is not None else 0
    if start + nbytes > unit.info.length:
        raise IntegrityError(
            f"{unit.info.relative_path} at {unit.info.offset}: a tensor of "
            f"{nbytes} bytes does not fit in its {unit.info.length}-byte item "
            "(a damaged or hostile .metadata: copy the checkpoint again)"
        )


def _check_files(store, units) -> None:
    """Every item lies inside its data file, by the files' real sizes (one HEAD per file, at
    once), before any buffer or destination exists."""
    by_file: dict[str, list] = collections.defaultdict(list)
    for u in units:
        by_file[u.info.relative_path].append(u.info)
    names = list(by_file)
    infos = run_coroutine(run_all([store.head(name) for name in names]))
    for name, found in zip(names, infos):
        for info in by_file[name]:
            if info.offset + info.length > found.size:
                raise InvalidRange(
                    f"{name}: .metadata puts an item of {info.length} bytes at "
                    f"{info.offset}, past the file's {found.size} bytes (a "
                    "truncated file or a damaged .metadata: copy the checkpoint "
                    "again)",
                    key=name,
                    operation="read",
                )


class _Batch:
    """The read ranges of a batch of units of one file and what to do once they are in."""

    def __init__(self, units: list[_Unit], consumer: Consumer, block: int, transforms: bool):
        self.key = units[0].info.relative_path
        self.block = block
        self.consumer = consumer
        self.transforms = transforms
        self.blocks: dict[int, tuple[int, int, list]] = {}  # file offset -> (length, crc, sinks)
        self.plain: list[ReadRange] = []
        self.after: list[Callable[[], None]] = []
        self.nbytes = 0
        for unit in units:
            self._plan(unit)
        ranges = [
            ReadRange(off, length, crc32c=crc, sinks=tuple(sinks))
            if sinks
            else ReadRange(off, length, crc32c=crc)  # verified, then dropped
            for off, (length, crc, sinks) in sorted(self.blocks.items())
        ]
        self.ranges = sorted(ranges + self.plain, key=lambda r: r.offset)

    # -- planning -----------------------------------------------------------------------------

    def _sink(self, unit: _Unit, checks: ItemChecksums, start: int, dest: memoryview) -> None:
        """Verified bytes ``[start, start + len(dest))`` of ``unit``'s item go into ``dest``."""
        block = self.block
        end = start + len(dest)
        for k in range(start // block, -(-end // block)):
            b0, b1 = k * block, min((k + 1) * block, unit.info.length)
            lo, hi = max(start, b0), min(end, b1)
            if hi > lo:
                self._block(unit, checks, k)[2].append((lo - b0, dest[lo - start : hi - start]))

    def _block(self, unit: _Unit, checks: ItemChecksums, k: int) -> tuple[int, int, list]:
        b0 = k * self.block
        b1 = min(b0 + self.block, unit.info.length)
        return self.blocks.setdefault(unit.info.offset + b0, (b1 - b0, checks.crcs[k], []))

    def _verify_whole(self, unit: _Unit, checks: ItemChecksums) -> None:
        """Read and verify every block of the item, also those holding no wanted value (the
        archive around the tensor's bytes): a load that takes a whole item checks all of it."""
        if unit.info.length:
            for k in range(len(checks.crcs)):
                self._block(unit, checks, k)

    def _whole(self, unit: _Unit) -> memoryview:
        """A buffer receiving the whole item (verified when it has checksums)."""
        buf = memoryview(bytearray(unit.info.length))
        self.nbytes += len(buf)
        if unit.checks is not None:
            self._sink(unit, unit.checks, 0, buf)
        elif len(buf):
            self.plain.append(ReadRange(unit.info.offset, len(buf), out=buf))
        return buf

    def _plan(self, unit: _Unit) -> None:
        if any(p.is_bytes for p in unit.parts):
            whole = self._whole(unit)
            for part in unit.parts:
                self.after.append(functools.partial(self._take_bytes, part, whole))
            return
        checks, dtype, sizes = unit.checks, unit.dtype, unit.sizes
        if checks is None or dtype is None or unit.info.transform_descriptors:
            self._plan_loaded(unit)  # (dtype is None only for bytes items, handled above)
            return
        itemsize = dtype.itemsize  # the tensor fits in its item: _check_fits
        for part in unit.parts:
            target = self.consumer.target(part)
            a, b, contiguous = region_span(sizes, part.offsets, part.lengths, itemsize)
            if b == a:
                self.after.append(functools.partial(self.consumer.commit, part, target))
                continue
            if contiguous and _lands_directly(target, dtype):
                self._sink(unit, checks, checks.data_offset + a, byte_view(target))
                self.nbytes += b - a
                self.after.append(functools.partial(self.consumer.commit, part, target))
                continue
            staging = torch.empty(b - a, dtype=torch.uint8)
            self.nbytes += b - a
            self._sink(unit, checks, checks.data_offset + a, byte_view(staging))
            self.after.append(
                functools.partial(self._copy_out, part, target, staging, dtype, sizes)
            )
        if any(
            all(o == 0 for o in p.offsets) and tuple(p.lengths) == tuple(sizes) for p in unit.parts
        ):
            self._verify_whole(unit, checks)

    def _take_bytes(self, part: Part, whole: memoryview) -> None:
        self.consumer.take_bytes(part, bytes(whole))

    def _plan_loaded(self, unit: _Unit) -> None:
        buf = self._whole(unit)
        targets = [(p, self.consumer.target(p)) for p in unit.parts]

        def deliver() -> None:
            stream = io.BytesIO(buf)
            what = f"{unit.info.relative_path} at {unit.info.offset} ({unit.index.fqn})"
            descriptors = unit.info.transform_descriptors
            if descriptors:
                stream = io.BytesIO(_untransform(unit, stream, descriptors, self.transforms))
            tensor = load_tensor(stream.getbuffer(), what)
            if tuple(tensor.shape) != unit.sizes:
                raise IntegrityError(
                    f"{what}: holds a tensor of shape {tuple(tensor.shape)}, "
                    f".metadata says {unit.sizes}"
                )
            for part, target in targets:
                view = tensor
                for dim, (off, n) in enumerate(zip(part.offsets, part.lengths)):
                    view = view.narrow(dim, off, n)
                target.copy_(view)
                self.consumer.commit(part, target)

        self.after.append(deliver)

    def _copy_out(self, part: Part, target: torch.Tensor, buf: torch.Tensor, dtype, sizes) -> None:
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        values = buf.view(dtype).as_strided(tuple(part.lengths), tuple(strides), 0)
        target.copy_(values)
        self.consumer.commit(part, target)

    # -- delivery -----------------------------------------------------------------------------

    def deliver(self) -> int:
        """Copy out and commit, in the calling thread; returns the bytes fetched."""
        for step in self.after:
            step()
        fetched = sum(r.length for r in self.ranges)
        self.after.clear()
        return fetched


def _lands_directly(target: torch.Tensor, dtype: torch.dtype) -> bool:
    return (
        target.dtype == dtype
        and target.device.type == "cpu"
        and target.layout == torch.strided
        and target.is_contiguous()
        and not target.is_conj()
        and not target.is_neg()
    )


def _untransform(unit: _Unit, stream, descriptors, allowed: bool) -> bytes:
    if not allowed:
        raise IntegrityError(
            f"{unit.info.relative_path}: stream transforms "
            f"{list(descriptors)} are not supported here"
        )
    try:
        from cloudckpt.statedict.torch_private import stream_transform_classes

        ExtensionRegistry, StreamTransformExtension = stream_transform_classes()
    except ImportError as exc:  # pragma: no cover - torch without DCP extensions
        raise IntegrityError(
            f"{unit.info.relative_path}: stream transforms {list(descriptors)} need a newer torch"
        ) from exc
    out = stream
    for ext in ExtensionRegistry().from_descriptor_list(list(descriptors)):
        if isinstance(ext, StreamTransformExtension):
            out = ext.transform_from(out)
    return out.read()
