"""``cloudckpt.load`` / ``load_full`` / ``read_manifest``: the distributed load protocol.

Every rank of the process group calls :func:`load` with the state dict it wants filled (its own
sharding, any world size). Phases, each closed by a fail-together exchange:

1. manifest: the coordinator reads it and broadcasts the bytes (or every rank reads it, with
   ``share_manifest=False``); every rank decodes and validates it.
2. plan: flatten the state dict (after ``state_dict()`` on stateful values), plan the reads of
   every requested piece (strict: missing names fail), exchange the plans.
3. read-once assignment: computed identically on every rank; broadcast subgroups created or
   reused.
4. data: each rank fetches its own regions (crc-verified) in the background while the broadcast
   batches run in the one global order; every region lands in its destination (dtype converted).
5. values and ``load_state_dict()`` on stateful values.

Destinations are written only with verified bytes; a rank that fails leaves its tensors possibly
half filled, and every rank raises the same error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from cloudckpt import layout
from cloudckpt.errors import CheckpointNotFound, ManifestError, ObjectNotFound
from cloudckpt.manifest import decode_manifest
from cloudckpt.options import LoadOptions, LoadResult
from cloudckpt.planning import (PieceSpec, assign_readers, decode_local_load_plan,
                                encode_local_load_plan, plan_local_load)
from cloudckpt.buffers import BufferPool
from cloudckpt.planning.windows import plan_windows
from cloudckpt.reader import (WINDOW_ALIGN, fetch_regions, layout_windows, read_windows,
                              window_boxes)
from cloudckpt.runtime import run_coroutine, shared_store, wait_for_pending_save, submit
from cloudckpt.stateful import resolve_stateful, restore_stateful
from cloudckpt.storage import local_path
from cloudckpt.statedict import flatten_state_dict, set_by_path, torch_dtype, unflatten_state_dict
from cloudckpt.transport import Broadcaster, ControlChannel

log = logging.getLogger(__name__)


def read_manifest(url: str, *, storage=None, allow_pickle: bool = False):
    """Read and validate the manifest of the checkpoint at ``url`` (no collective)."""
    return decode_manifest(_read_manifest_bytes(url, storage), allow_pickle=allow_pickle)


def _read_manifest_bytes(url: str, storage) -> bytes:
    store = shared_store(url, storage)
    try:
        return run_coroutine(store.get(layout.MANIFEST_KEY))
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no committed checkpoint at {url} (no manifest)") from exc


def load(state_dict: Mapping[str, Any], url: str, *, process_group=None, storage=None,
         allow_pickle: bool = False, strict: bool = True,
         options: LoadOptions | None = None) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``. Collective.

    Tensors (plain, DTensor, :class:`cloudckpt.GlobalPiece`) are filled in place, converting
    dtype when the stored one differs. Non-tensor values are replaced. With ``strict`` (the
    default) a name missing from the checkpoint raises :class:`MissingKeysError`; names stored but
    not requested are reported in ``LoadResult.unexpected_keys``.
    """
    wait_for_pending_save()
    options = options or LoadOptions()
    channel = ControlChannel(process_group, timeout=options.timeout)
    started = time.perf_counter()
    store = shared_store(url, storage)

    raw, error, manifest = b"", None, None
    if channel.is_coordinator or not options.share_manifest:
        try:
            raw = _read_manifest_bytes(url, storage)
            if channel.is_coordinator:
                manifest = decode_manifest(raw, allow_pickle=allow_pickle)
                run_coroutine(check_object_extents(store, manifest))
        except BaseException as exc:
            error = exc
    channel.agree("load manifest", b"", error)
    if options.share_manifest:
        raw = channel.broadcast_bytes(raw if channel.is_coordinator else None)

    error, payload = None, b""
    try:
        if manifest is None:
            manifest = decode_manifest(raw, allow_pickle=allow_pickle)
        broadcastable = _broadcast_predicate(channel)
        resolved, found = resolve_stateful(state_dict)
        flat = flatten_state_dict(resolved, is_broadcastable=broadcastable)
        requests, dests = [], []
        for leaf in flat.tensors.values():
            for spec, tensor in leaf.pieces:
                requests.append(spec)
                dests.append(tensor)
        plan = plan_local_load(manifest, requests, rank=channel.rank,
                               value_names=tuple(flat.values), strict=strict)
        payload = encode_local_load_plan(plan)
    except BaseException as exc:
        error = exc
    raw_plans = channel.agree("load planning", payload, error)

    error = None
    fetched = received = broadcasts = 0
    try:
        plans = [decode_local_load_plan(b) for b in raw_plans]
        fetched, received, broadcasts = _move_data(store, manifest, plans, channel, dests, options)
        for name, leaf in flat.values.items():
            if name in manifest.values:
                _assign_value(state_dict, resolved, found, leaf.path, manifest.values[name])
        restore_stateful(resolved, found)
    except BaseException as exc:
        error = exc
    channel.agree("load", b"", error)
    if plan.unexpected and channel.is_coordinator:
        shown = ", ".join(plan.unexpected[:8]) + (" ..." if len(plan.unexpected) > 8 else "")
        log.warning("cloudckpt.load: %d stored name(s) were not requested and stay unloaded: %s "
                    "(a fresh optimizer has no state to fill: gather it with "
                    "torch.distributed.checkpoint.state_dict.get_state_dict first)",
                    len(plan.unexpected), shown)
    return LoadResult(url=url, bytes_fetched=fetched, bytes_received=received,
                      seconds=time.perf_counter() - started,
                      unexpected_keys=tuple(plan.unexpected), broadcasts=broadcasts)


def load_full(url: str, *, storage=None, allow_pickle: bool = False,
              options: LoadOptions | None = None) -> dict:
    """Consolidate the checkpoint at ``url`` into full CPU tensors in this process.

    No collective; works with or without ``torch.distributed``. Returns the nested state dict
    with the saved structure (dicts, lists, tuples) and non-tensor values restored.
    """
    options = options or LoadOptions()
    manifest = read_manifest(url, storage=storage, allow_pickle=allow_pickle)
    store = shared_store(url, storage)
    run_coroutine(check_object_extents(store, manifest))  # before allocating declared shapes
    leaves: dict[str, Any] = dict(manifest.values)
    requests, dests = [], []
    for name, record in manifest.tensors.items():
        full = torch.empty(tuple(record.shape), dtype=torch_dtype(record.dtype))
        leaves[name] = full
        requests.append(PieceSpec(name=name, dtype=record.dtype, global_shape=tuple(record.shape),
                                  offsets=(0,) * len(record.shape), sizes=tuple(record.shape),
                                  broadcastable=False))
        dests.append(full)
    plan = plan_local_load(manifest, requests, rank=0, value_names=tuple(manifest.values))
    run_coroutine(_fetch_into(store, manifest, plan.reads, dests, options.max_read_bytes))
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
            raise ManifestError(f"data object {key} holds {info.size} bytes, the manifest "
                                f"refers to {need}", path=f"objects[{index}]")

    await asyncio.gather(*(check(i, k) for i, k in enumerate(manifest.objects)))


# -- data movement ------------------------------------------------------------------------------


def _broadcast_predicate(channel: ControlChannel):
    """Destinations the job's broadcast backend can carry: CUDA for NCCL, CPU for gloo."""
    device_type = "cuda" if channel.backend == "nccl" else "cpu"
    return lambda t: t.device.type == device_type


def _region_key(r) -> tuple:
    return (r.name, r.chunk_index, tuple(r.src_offsets), tuple(r.lengths))


def _dest_view(dests, item) -> torch.Tensor:
    view = dests[item.request_index]
    for dim, (off, n) in enumerate(zip(item.dest_offsets, item.lengths)):
        view = view.narrow(dim, off, n)
    return view


async def _fetch_into(store, manifest, reads, dests, max_bytes: int) -> int:
    """Fetch each distinct region of ``reads`` once and copy it into every destination needing it."""
    by_region: dict[tuple, list] = defaultdict(list)
    for item in reads:
        by_region[_region_key(item)].append(item)
    regions = [items[0] for items in by_region.values()]

    def consume(region, offsets, tensor):
        for item in by_region[_region_key(region)]:
            _sub_view(_dest_view(dests, item), offsets, tensor.shape).copy_(tensor)

    def targets(region):
        return [_dest_view(dests, item) for item in by_region[_region_key(region)]]

    return await fetch_regions(store, manifest, regions, consume=consume, targets=targets,
                               max_bytes=max_bytes)


def _sub_view(view: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The box ``offsets`` + ``lengths`` of ``view``."""
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off or n != view.shape[dim]:
            view = view.narrow(dim, off, n)
    return view


def _move_data(store, manifest, plans, channel, dests, options: LoadOptions):
    """Fetch own regions and run the broadcasts. Returns (fetched, received, broadcast count)."""
    mine = plans[channel.rank].reads
    broadcast = options.broadcast if options.broadcast is not None else \
        local_path(store.url) is None
    if channel.size == 1 or not broadcast:
        return run_coroutine(_fetch_into(store, manifest, mine, dests, options.max_read_bytes)), 0, 0

    broadcaster = Broadcaster(channel)
    assignment = assign_readers(plans, min_broadcast_bytes=options.min_broadcast_bytes)
    kept = _keep_busiest_groups(assignment.broadcasts, options.max_broadcast_groups)
    if not broadcaster.can_use_subgroups:  # a strict subgroup job: whole-channel gloo only
        whole = tuple(range(channel.size))
        kept = {i for i in kept if tuple(assignment.broadcasts[i].group) == whole
                and broadcaster.backend == "gloo"}
    # each of this rank's read items is served by a kept broadcast, or read by the rank itself
    served_by = assignment.broadcast_of(channel.rank)
    items_by_broadcast: dict[int, list] = defaultdict(list)
    own_reads = []
    for i, item in enumerate(mine):
        b = int(served_by[i])
        if b >= 0 and b in kept:
            items_by_broadcast[b].append(item)
        else:
            own_reads.append(item)
    own = submit(_fetch_into(store, manifest, own_reads, dests, options.max_read_bytes // 2))

    # regions travel as checksum-aligned windows: the source reads them straight into the batch
    # buffer (verified in place) and every member copies the parts it needs out of it
    parts = _window_parts(manifest, assignment.broadcasts, sorted(kept), _WINDOW_BYTES)
    batches = _batch_broadcasts(assignment.broadcasts, parts, options.broadcast_batch_bytes)
    broadcaster.prepare(sorted({members for members, _, _ in batches}))
    fetched = received = 0
    my_batches = [k for k, (members, _, _) in enumerate(batches) if channel.rank in members]
    pending: dict[int, Any] = {}
    slab = max([layout_windows([p.window for p in b[2]])[1] for b in batches] or [0]) + WINDOW_ALIGN
    pool = BufferPool(slab)
    window_bytes = max(options.max_read_bytes // 4, options.broadcast_batch_bytes)

    def prefetch(pos: int) -> None:
        """Start fetching this rank's source batches among the next ones, within a byte budget,
        so its reads overlap the broadcasts of other sources."""
        ahead = sum(_batch_bytes(batches[k][2]) for k in pending)
        for k in my_batches[pos:pos + 8]:
            _, src, batch_parts = batches[k]
            if src != channel.rank or k in pending:
                continue
            size = _batch_bytes(batch_parts)
            if pending and ahead + size > window_bytes:
                break
            pending[k] = submit(_pack_windows(store, [p.window for p in batch_parts], pool))
            ahead += size

    dtypes = {name: torch_dtype(manifest.tensors[name].dtype)
              for name in {assignment.broadcasts[i].region.name for i in kept}}
    failure: BaseException | None = None
    try:
        prefetch(0)
        for pos, k in enumerate(my_batches):
            members, src, batch_parts = batches[k]
            prefetch(pos + 1)
            windows = [p.window for p in batch_parts]
            layout, total = layout_windows(windows)
            # the byte after the payload says whether the source could fetch and verify the
            # batch: a failing source still takes part (with status 0), so no peer is left
            # waiting in a broadcast
            if src == channel.rank:
                try:
                    buf = pending.pop(k).result()
                    fetched += sum(w.length for w in windows)
                except Exception as exc:  # reported to every rank by the final agree()
                    failure = failure or exc
                    buf = pool.take()
                    buf[total] = 0
            else:
                buf = pool.take()
            try:
                wire = buf[:total + 1]
                if broadcaster.device.type != "cpu":
                    wire = wire.to(broadcaster.device)
                broadcaster.broadcast(wire, src=src, members=members)
                if int(wire[total].item()) != 1:
                    if failure is None:
                        failure = RuntimeError(f"rank {src} could not read the data it broadcasts")
                    continue
                if src != channel.rank:
                    received += sum(w.length for w in windows)
                for part, offset in zip(batch_parts, layout):
                    items = items_by_broadcast.get(part.broadcast, ())
                    if not items:
                        continue
                    dtype = dtypes[assignment.broadcasts[part.broadcast].region.name]
                    for sub, piece in window_boxes(part.window, wire, offset, dtype):
                        for item in items:
                            _sub_view(_dest_view(dests, item), sub.offsets,
                                      sub.lengths).copy_(piece)
            finally:
                pool.give(buf)
    finally:
        for fut in pending.values():
            fut.cancel()
        own_fetched = own.result()  # re-raises the background error, if any
    if failure is not None:
        raise failure
    return fetched + own_fetched, received, len(my_batches)


#: bytes per broadcast window (the unit a source fetches and verifies before sending).
_WINDOW_BYTES = 16 << 20


def _keep_busiest_groups(broadcasts, limit: int) -> set[int]:
    """Indices of the broadcasts of at most ``limit`` distinct groups (those moving the most)."""
    weight: dict[tuple, int] = defaultdict(int)
    for b in broadcasts:
        weight[tuple(b.group)] += b.region.nbytes
    keep = {g for g, _ in sorted(weight.items(), key=lambda gw: (-gw[1], gw[0]))[:limit]}
    return {i for i, b in enumerate(broadcasts) if tuple(b.group) in keep}


@dataclass(frozen=True)
class _Part:
    """One window of broadcast ``broadcast``'s region."""

    broadcast: int
    window: Any


def _window_parts(manifest, broadcasts, indices, window_bytes: int) -> list[_Part]:
    """The windows of every kept broadcast's region, in order. Pure: identical on every rank."""
    return [_Part(i, w) for i in indices
            for w in plan_windows(manifest, broadcasts[i].region, window_bytes)]


def _batch_bytes(parts) -> int:
    return layout_windows([p.window for p in parts])[1]


def _batch_broadcasts(broadcasts, parts: list[_Part], batch_bytes: int):
    """Group ``parts`` (in global order) by their broadcast's (group, src), in order of first
    appearance, cut into batches of at most ``batch_bytes`` (a window larger than that travels
    alone).

    Batches of different (group, src) are then interleaved round-robin. Returns
    ``[(members, src, [parts])]``, identical on every rank.
    """
    open_batch: dict[tuple, list] = {}
    batches: list[list] = []
    for part in parts:
        b = broadcasts[part.broadcast]
        key = (tuple(b.group), b.src)
        size = -(-part.window.length // WINDOW_ALIGN) * WINDOW_ALIGN
        batch = open_batch.get(key)
        if batch is None or (batch[3] and batch[3] + size > batch_bytes):
            batch = [tuple(b.group), b.src, [], 0]
            open_batch[key] = batch
            batches.append(batch)
        batch[2].append(part)
        batch[3] += size
    # interleave sources round-robin, so every source's reads run while others broadcast
    queues: dict[tuple, list] = {}
    for batch in batches:
        queues.setdefault((batch[0], batch[1]), []).append(batch)
    ordered: list[list] = []
    while queues:
        for key in list(queues):
            ordered.append(queues[key].pop(0))
            if not queues[key]:
                del queues[key]
    return [(m, s, p) for m, s, p, _ in ordered]


async def _pack_windows(store, windows, pool: BufferPool) -> torch.Tensor:
    """Fetch ``windows`` (verified) into a pooled buffer laid out by :func:`layout_windows`,
    followed by one status byte set to 1. The caller gives the buffer back to ``pool``."""
    buf = pool.take()
    try:
        await read_windows(store, windows, buf)
    except BaseException:
        pool.give(buf)
        raise
    buf[layout_windows(windows)[1]] = 1
    return buf


def _assign_value(original, resolved, found, path: tuple, value) -> None:
    """Set a loaded non-tensor value in the resolved tree, and in the caller's own containers
    unless the path goes through a stateful object (which gets it via load_state_dict)."""
    set_by_path(resolved, path, value)
    if any(path[:len(p)] == p for p, _ in found):
        return
    try:
        set_by_path(original, path, value)
    except TypeError:  # a value inside a tuple cannot be replaced in place
        pass
