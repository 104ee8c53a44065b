"""``cloudckpt.load`` / ``load_full`` / ``read_manifest``: the distributed load protocol.

Every rank of the process group calls :func:`load` with the state dict it wants filled (its own
sharding, any world size). Phases (each a :meth:`~cloudckpt.transport.ControlChannel.phase`,
closed by a fail-together exchange):

1. ``load manifest``: the coordinator reads and decodes it (or every rank reads it, with
   ``share_manifest=False``), while every rank flattens its state dict (after ``state_dict()``
   on stateful values); the coordinator reports the manifest's length
   (:class:`~cloudckpt.api.reports.ManifestRead`) and the bytes follow in one broadcast.
2. ``load planning``: every rank decodes and validates the manifest, plans the reads of every
   requested piece (strict: missing names fail; an error flattening the state dict is raised
   here) and reports its plan (:class:`~cloudckpt.api.reports.LoadPlanReport`); meanwhile the
   coordinator checks the stored objects' extents (``ManifestSource.check``, started as soon
   as it has decoded the manifest in phase 1, its outcome reported in this phase), before any
   data is read or any buffer sized from the manifest.
3. ``load``: the read-once assignment, computed identically on every rank (broadcast subgroups
   created or reused); each rank fetches its own regions (crc-verified) in the background while
   the broadcast batches run in the one global order, and every region lands in its destination
   (dtype converted).
4. ``load restore``: only when every rank has all of its data, values are set and
   ``load_state_dict()`` is called on stateful values; closed by an exchange (so that an error
   there fails every rank) unless no rank's restore runs code that may raise (no stateful
   value, values in plain dicts and lists: every rank said so with its plan).

:func:`load_from` runs the same phases on any :class:`ManifestSource` (the safetensors import,
:mod:`cloudckpt.hf`, builds a manifest without checksums: its bytes are not verified).
Destinations are written only with verified bytes; a rank that fails leaves its tensors possibly
half filled, and every rank raises the same error; no rank replaces a value or calls
``load_state_dict()`` when any rank failed to move its data.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from cloudckpt.api.load_data import move_data
from cloudckpt.api.load_wanted import Wanted
from cloudckpt.api.reports import LoadPlanReport, ManifestRead
from cloudckpt.dataplane.destinations import fetch_into
from cloudckpt.errors import ManifestError, ObjectNotFound
from cloudckpt.manifest.codec import decode_manifest
from cloudckpt.manifest.model import Manifest
from cloudckpt.options import LoadOptions, LoadResult
from cloudckpt.planning.load.hints import unexpected_names_message
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.runtime.loop import (
    open_in_background,
    run_coroutine,
    shared_store,
    submit,
    wait_for_pending_save,
)
from cloudckpt.statedict.dtypes import torch_dtype
from cloudckpt.statedict.flatten import unflatten_state_dict
from cloudckpt.statedict.placement import placement
from cloudckpt.stored import fetch_checkpoint_manifest, read_manifest_bytes, reading_view
from cloudckpt.transport import INLINE_BYTES, ControlChannel

log = logging.getLogger(__name__)


def read_manifest(url: str, *, storage=None, allow_pickle: bool = False) -> Manifest:
    """Read and validate the manifest of the checkpoint at ``url`` (no collective)."""
    return decode_manifest(read_manifest_bytes(url, storage), allow_pickle=allow_pickle)


def load(
    state_dict: Mapping[str, Any],
    url: str,
    *,
    process_group=None,
    storage=None,
    allow_pickle: bool = False,
    strict: bool = True,
    options: LoadOptions | None = None,
    map_location=None,
) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``. Collective.

    Tensors (plain, DTensor, :class:`cloudckpt.GlobalPiece`) are filled in place, converting
    dtype when the stored one differs. Non-tensor values are replaced. With ``strict`` (the
    default) a name missing from the checkpoint raises :class:`MissingKeysError`; names stored but
    not requested are reported in ``LoadResult.unexpected_keys``. ``process_group``: the ranks
    that load together (default: the world); ``"self"``: this process alone, no collective.
    ``map_location`` (as ``torch.load`` takes it, :mod:`cloudckpt.statedict.placement`) is
    checked, and needs no more: the bytes land in the state dict's own tensors, on their
    devices, which is where ``torch.load(..., map_location)`` followed by ``load_state_dict``
    would leave them.
    """
    placement(map_location)  # a bad one fails here, before any collective
    return load_from(
        state_dict,
        StoredManifest(url, storage, allow_pickle),
        process_group=process_group,
        strict=strict,
        options=options,
    )


class ManifestSource(Protocol):
    """Where a load's manifest comes from (:func:`load_from`): the data objects are under
    ``url`` (opened with ``storage``, once per load, by :func:`load_from`); ``read(store)``
    returns the bytes describing them, ``store`` being ``url``'s store (run by the
    coordinator, or by every rank without ``share_manifest``; may raise); ``decode(raw)`` turns
    them into a validated :class:`~cloudckpt.manifest.Manifest` (every rank, same bytes, same
    manifest; may raise); ``check(manifest, store)`` is the coordinator's check of the stored
    objects before anything is allocated (may raise); ``data_store(store, raw)`` is the store
    every rank's data phase reads through (the safetensors import wraps it to check whole
    files against the store's checksums). A source may also have ``read_async(store)`` and
    ``check_async(manifest, store)``, the same as coroutines run on cloudckpt's loop (no worker
    thread per call: :class:`StoredManifest` has them)."""

    @property
    def url(self) -> str: ...

    @property
    def storage(self) -> Any: ...

    def read(self, store) -> bytes: ...

    def decode(self, raw: bytes) -> Manifest: ...

    def check(self, manifest: Manifest, store) -> None: ...

    def data_store(self, store, raw: bytes): ...


@dataclass(frozen=True)
class StoredManifest:
    """The :class:`ManifestSource` of a cloudckpt checkpoint: its ``manifest.msgpack``."""

    url: str
    storage: Any = None
    allow_pickle: bool = False

    def read(self, store) -> bytes:
        return read_manifest_bytes(self.url, store=store)

    async def read_async(self, store) -> bytes:
        """:meth:`read` as a coroutine on cloudckpt's loop (see :func:`_start_read`)."""
        return await fetch_checkpoint_manifest(self.url, store)

    def decode(self, raw: bytes) -> Manifest:
        return decode_manifest(raw, allow_pickle=self.allow_pickle)

    def decode_validated(self, raw: bytes) -> Manifest:
        """:meth:`decode` of bytes the coordinator decoded already: without the saved nesting,
        which a load does not use (see :func:`_decode_shared`)."""
        return decode_manifest(raw, allow_pickle=self.allow_pickle, structure=False)

    def check(self, manifest: Manifest, store) -> None:
        run_coroutine(check_object_extents(store, manifest))

    async def check_async(self, manifest: Manifest, store) -> None:
        """:meth:`check` as a coroutine on cloudckpt's loop (see :func:`_start_check`)."""
        await check_object_extents(store, manifest)

    def data_store(self, store, raw: bytes):
        """The store itself: every chunk carries its own crcs."""
        return store


def load_from(
    state_dict: Mapping[str, Any],
    source: ManifestSource,
    *,
    process_group=None,
    strict: bool = True,
    options: LoadOptions | None = None,
) -> LoadResult:
    """:func:`load` from any :class:`ManifestSource` (a cloudckpt checkpoint, an index of
    foreign files such as safetensors): the same four phases, the same guarantees. Collective."""
    wait_for_pending_save()
    options = options or LoadOptions()
    channel = ControlChannel(process_group, timeout=options.timeout)
    channel.join("load", options.join_as or source.url, options.join_timeout)
    started = time.perf_counter()

    raw, manifest, store = b"", None, None
    checking: concurrent.futures.Future | None = None  # the coordinator's check of the objects
    try:
        with channel.phase("load manifest", ManifestRead) as reading:
            # the read runs in the background while this rank flattens its state dict (which
            # needs no manifest; an error doing so is raised in "load planning", where it
            # belongs); the one opening of the checkpoint's store for this load (a malformed
            # URL fails here)
            own_store = shared_store(source.url, source.storage)
            open_in_background(own_store)  # every rank's client starts while it flattens
            reads = channel.is_coordinator or not options.share_manifest
            read = _start_read(source, own_store) if reads else None
            try:
                flattened: Wanted | Exception = Wanted.of(state_dict, channel)
            except Exception as exc:  # noqa: BLE001 - kept for the planning phase
                flattened = exc
            finally:
                if read is not None:
                    raw = read.result()  # the read's own error, if any, wins
            if channel.is_coordinator:
                store, manifest = reading_view(
                    source.url, source.storage, source.decode(raw), store=own_store
                )
                # the coordinator checks the stored objects from here on, while the manifest
                # travels and every rank plans: nothing is allocated from the manifest before
                # the data phase, which follows the planning exchange, where the check's
                # outcome is reported
                checking = _start_check(source, manifest, store)
                reading.report = ManifestRead(length=len(raw))
        if options.share_manifest:
            raw = channel.broadcast_bytes(
                raw if channel.is_coordinator else None, length=reading.reports[0].length
            )

        with channel.phase(
            "load planning", LoadPlanReport, inline=plan_slot_bytes(channel.size)
        ) as planning:
            if manifest is None:
                decode = _decode_shared(source) if options.share_manifest else source.decode
                store, manifest = reading_view(
                    source.url, source.storage, decode(raw), store=own_store
                )
            if isinstance(flattened, Exception):
                raise flattened
            wanted = flattened
            wanted.check_replaceable(state_dict, manifest)
            plan = plan_local_load(
                manifest,
                wanted.requests,
                rank=channel.rank,
                value_names=tuple(wanted.flat.values),
                strict=strict,
            )
            planning.report = LoadPlanReport(plan, wanted.restore_can_fail(state_dict))
            if checking is not None:
                checking.result()
    finally:
        if checking is not None:  # nothing of this load runs on after it returned or raised
            concurrent.futures.wait([checking])

    with channel.phase("load"):
        fetched, received, broadcasts = move_data(
            source.data_store(store, raw),
            manifest,
            [r.plan for r in planning.reports],
            channel,
            wanted.dests,
            options,
        )

    # only once every rank has all of its data; closed by an exchange when a rank's restore
    # runs code that may raise (load_state_dict(), a container's own item assignment)
    if any(r.restore_can_fail for r in planning.reports):
        with channel.phase("load restore"):
            wanted.restore(state_dict, manifest)
    else:
        wanted.restore(state_dict, manifest)

    if plan.unexpected and channel.is_coordinator:
        log.warning("cloudckpt.load: %s", unexpected_names_message(plan.unexpected))
    return LoadResult(
        url=source.url,
        bytes_fetched=fetched,
        bytes_received=received,
        seconds=time.perf_counter() - started,
        unexpected_keys=tuple(plan.unexpected),
        broadcasts=broadcasts,
    )


def load_full(
    url: str,
    *,
    storage=None,
    allow_pickle: bool = False,
    options: LoadOptions | None = None,
    map_location=None,
) -> dict:
    """Consolidate the checkpoint at ``url`` into full tensors in this process.

    No collective; works with or without ``torch.distributed``. Returns the nested state dict
    with the saved structure (dicts, lists, tuples) and non-tensor values restored. Tensors are
    read on CPU and placed as ``map_location`` says (as ``torch.load`` takes it; ``"meta"``:
    shapes and dtypes only, nothing read; :mod:`cloudckpt.statedict.placement`).
    """
    place = placement(map_location)
    options = options or LoadOptions()
    store = shared_store(url, storage)
    manifest = decode_manifest(read_manifest_bytes(url, store=store), allow_pickle=allow_pickle)
    store, manifest = reading_view(url, storage, manifest, store=store)
    run_coroutine(check_object_extents(store, manifest))  # before allocating declared shapes
    leaves: dict[str, Any] = dict(manifest.values)
    requests, dests = [], []
    for name, record in manifest.tensors.items():
        if place.meta:
            leaves[name] = torch.empty(record.shape, dtype=torch_dtype(record.dtype), device="meta")
            continue
        full = torch.empty(tuple(record.shape), dtype=torch_dtype(record.dtype))
        leaves[name] = full
        requests.append(
            PieceSpec(
                name=name,
                dtype=record.dtype,
                global_shape=tuple(record.shape),
                offsets=(0,) * len(record.shape),
                sizes=tuple(record.shape),
                broadcastable=False,
            )
        )
        dests.append(full)
    plan = plan_local_load(manifest, requests, rank=0, value_names=tuple(manifest.values))
    run_coroutine(fetch_into(store, manifest, plan.reads, dests, options.max_read_bytes))
    if not place.meta:
        leaves.update({name: place.apply(leaves[name]) for name in manifest.tensors})
    return unflatten_state_dict(manifest.structure, leaves)


async def check_object_extents(store, manifest) -> None:
    """Refuse a manifest whose chunks reach past the end of the objects actually stored.

    One HEAD per data object. Run before anything is allocated from declared shapes or chunk
    lengths, so a manifest cannot make a load reserve memory that real objects do not justify.
    Raises :class:`ManifestError` naming the object.
    """
    extents = manifest.object_extents()

    async def check(index: int, key: str) -> None:
        need = extents.get(key, 0)
        if need == 0:
            return
        try:
            info = await store.head(key)
        except ObjectNotFound as exc:
            raise ManifestError(f"data object {key} is missing", path=f"objects[{index}]") from exc
        if info.size < need:
            raise ManifestError(
                f"data object {key} holds {info.size} bytes, the manifest refers to {need}",
                path=f"objects[{index}]",
            )

    await asyncio.gather(*(check(i, k) for i, k in enumerate(manifest.objects)))


# -- helpers ------------------------------------------------------------------------------------


def plan_slot_bytes(ranks: int) -> int:
    """Bytes of each rank's slot in the first all-gather of the planning exchange: a load plan
    that fits (most: 10 KiB holds about 450 read items) is exchanged in one all-gather instead
    of two. At most 64 KiB, and every rank receives at most 4 MiB in all."""
    return max(INLINE_BYTES, min(64 << 10, (4 << 20) // max(ranks, 1)))


def _start_read(source: ManifestSource, store) -> concurrent.futures.Future:
    """``source.read(store)`` started in the background: the source's ``read_async`` on the
    loop when it has one (no worker thread to wake up while the caller flattens), else its
    ``read`` in a worker thread."""
    read_async = getattr(source, "read_async", None)
    if read_async is None:
        return submit(asyncio.to_thread(source.read, store))
    started = threading.Event()

    async def read() -> bytes:
        started.set()
        return await read_async(store)

    future = submit(read())
    # a moment for the loop thread to take the GIL and send the request (it holds the GIL
    # until it waits for the answer), so that the flattening that follows runs while the
    # store answers instead of keeping the request from being sent (measured: 5 ms late)
    started.wait(_READ_START_WAIT)
    return future


#: the longest the caller waits for its manifest read to have started (see :func:`_start_read`)
_READ_START_WAIT = 0.002


def _start_check(source: ManifestSource, manifest: Manifest, store) -> concurrent.futures.Future:
    """``source.check(manifest, store)`` started in the background (``check_async`` on the loop
    when the source has one, as :func:`_start_read`)."""
    check_async = getattr(source, "check_async", None)
    if check_async is not None:
        return submit(check_async(manifest, store))
    return submit(asyncio.to_thread(source.check, manifest, store))


def _decode_shared(source: ManifestSource):
    """How a rank decodes the manifest bytes the coordinator read, decoded (every check of
    ``decode``) and broadcast: the source's ``decode_validated`` when it has one (it may leave
    out what a load does not use), else ``decode``."""
    return getattr(source, "decode_validated", None) or source.decode
