"""Moving a load's tensor bytes: own reads, and read-once-then-broadcast. Used by
:mod:`cloudckpt.api.load` (which sequences the surrounding phases).

Contract:
- Every destination element is written only with bytes whose checksum block was verified (by
  the store for fetched bytes; by the source rank, which says so before sending, for broadcast
  bytes). A failure leaves destinations possibly half filled and is raised on this rank; the
  caller's ``load`` phase turns it into the same error on every rank.
- Every rank runs the broadcasts in the same global order (computed identically from the
  exchanged plans), so no rank waits in a broadcast its peers never join; a source that cannot
  fetch still takes part and says so first.
- Large regions stored as one contiguous run travel as *run windows*: the source reads them
  straight into its own destination (verified in place) and broadcasts from there; receivers
  take them straight into theirs. Other regions travel in batches of checksum-aligned windows
  through pooled buffers. Only the source of a window fetches it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.buffers import BufferPool, byte_view, flat_bytes, is_byte_viewable
from cloudckpt.options import LoadOptions
from cloudckpt.planning import assign_readers
from cloudckpt.planning.windows import boxes_in_flat_range, plan_run_windows, plan_windows
from cloudckpt.reader import (WINDOW_ALIGN, fetch_regions, layout_windows, read_windows,
                              run_ranges, window_boxes)
from cloudckpt.runtime import run_coroutine, start_task, submit
from cloudckpt.statedict import torch_dtype
from cloudckpt.transport import Broadcaster

#: bytes per broadcast window (the unit a source fetches and verifies before sending).
WINDOW_BYTES = 16 << 20
#: regions at least this large that are one contiguous stored run travel as run windows.
RUN_MIN_BYTES = 1 << 20
#: a source starts fetching at most this many of its next batches ahead of the broadcasts.
_LOOKAHEAD = 12


def region_key(r) -> tuple:
    return (r.name, r.chunk_index, tuple(r.src_offsets), tuple(r.lengths))


def dest_view(dests, item) -> torch.Tensor:
    """The part of destination ``item.request_index`` that ``item`` fills."""
    view = dests[item.request_index]
    for dim, (off, n) in enumerate(zip(item.dest_offsets, item.lengths)):
        view = view.narrow(dim, off, n)
    return view


def sub_view(view: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The box ``offsets`` + ``lengths`` of ``view``."""
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off or n != view.shape[dim]:
            view = view.narrow(dim, off, n)
    return view


async def fetch_into(store, manifest, reads, dests, max_bytes: int) -> int:
    """Fetch each distinct region of ``reads`` once and copy it into every destination needing
    it (straight into the destinations when their layout allows). Returns the bytes fetched."""
    by_region: dict[tuple, list] = defaultdict(list)
    for item in reads:
        by_region[region_key(item)].append(item)
    regions = [items[0] for items in by_region.values()]

    def consume(region, offsets, tensor):
        for item in by_region[region_key(region)]:
            sub_view(dest_view(dests, item), offsets, tensor.shape).copy_(tensor)

    def targets(region):
        return [dest_view(dests, item) for item in by_region[region_key(region)]]

    return await fetch_regions(store, manifest, regions, consume=consume, targets=targets,
                               max_bytes=max_bytes)


def move_data(store, manifest, plans, channel, dests, options: LoadOptions):
    """Fetch own regions and run the broadcasts. Returns (fetched, received, broadcast count)."""
    mine = plans[channel.rank].reads
    broadcast = options.broadcast if options.broadcast is not None else store.remote
    if channel.size == 1 or not broadcast:
        return run_coroutine(fetch_into(store, manifest, mine, dests, options.max_read_bytes)), 0, 0

    broadcaster = Broadcaster(channel)
    assignment = assign_readers(plans, min_broadcast_bytes=options.min_broadcast_bytes)
    kept = keep_busiest_groups(assignment.broadcasts, options.max_broadcast_groups)
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
    own = submit(fetch_into(store, manifest, own_reads, dests, options.max_read_bytes // 2))
    session = _BroadcastSession(store, manifest, channel, broadcaster, assignment,
                                items_by_broadcast, dests, options, sorted(kept))
    try:
        session.run()
    finally:
        session.cancel_pending()
        own_fetched = own.result()  # re-raises the background error, if any
    if session.failure is not None:
        raise session.failure
    return session.fetched + own_fetched, session.received, session.count


def keep_busiest_groups(broadcasts, limit: int) -> set[int]:
    """Indices of the broadcasts of at most ``limit`` distinct groups (those moving the most)."""
    weight: dict[tuple, int] = defaultdict(int)
    for b in broadcasts:
        weight[tuple(b.group)] += b.region.nbytes
    keep = {g for g, _ in sorted(weight.items(), key=lambda gw: (-gw[1], gw[0]))[:limit]}
    return {i for i, b in enumerate(broadcasts) if tuple(b.group) in keep}


@dataclass(frozen=True)
class Part:
    """One window of broadcast ``broadcast``'s region: a checksum-aligned ``window`` (batched
    through a buffer) or a ``run`` window (its own broadcast, straight between destinations)."""

    broadcast: int
    window: Any = None
    run: Any = None

    @property
    def nbytes(self) -> int:
        """Bytes this part takes in a broadcast."""
        if self.run is not None:
            return self.run.hi - self.run.lo
        return -(-self.window.length // WINDOW_ALIGN) * WINDOW_ALIGN

    @property
    def fetch_bytes(self) -> int:
        """Bytes the source reads from the store for this part."""
        if self.run is not None:
            return sum(b.length for b in self.run.blocks)
        return self.window.length


def plan_parts(manifest, broadcasts, indices, window_bytes: int,
               run_min_bytes: int = RUN_MIN_BYTES) -> list[Part]:
    """The windows of every kept broadcast's region, in order: run windows for regions of at
    least ``run_min_bytes`` stored as one run, buffer windows otherwise. Pure: identical on
    every rank."""
    parts: list[Part] = []
    for i in indices:
        region = broadcasts[i].region
        runs = plan_run_windows(manifest, region, window_bytes) \
            if region.nbytes >= run_min_bytes else None
        if runs is not None:
            parts.extend(Part(i, run=r) for r in runs)
        else:
            parts.extend(Part(i, window=w) for w in plan_windows(manifest, region, window_bytes))
    return parts


def batch_parts(broadcasts, parts: list[Part], batch_bytes: int):
    """Group ``parts`` (in global order) by their broadcast's (group, src), in order of first
    appearance, cut into batches of at most ``batch_bytes`` (a run window is a batch alone).

    Batches of different (group, src) are then interleaved round-robin, so every source's reads
    run while others broadcast. Returns ``[(members, src, [parts])]``, identical on every rank.
    """
    open_batch: dict[tuple, list] = {}
    batches: list[list] = []
    for part in parts:
        b = broadcasts[part.broadcast]
        key = (tuple(b.group), b.src)
        batch = open_batch.get(key)
        if part.run is not None or batch is None or (batch[3] and batch[3] + part.nbytes > batch_bytes):
            batch = [tuple(b.group), b.src, [], 0]
            batches.append(batch)
            open_batch[key] = None if part.run is not None else batch
        batch[2].append(part)
        batch[3] += part.nbytes
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


class _BroadcastSession:
    """Runs this rank's share of the broadcast batches (see module doc)."""

    def __init__(self, store, manifest, channel, broadcaster, assignment, items_by_broadcast,
                 dests, options: LoadOptions, kept: list[int]):
        self.store, self.manifest, self.channel = store, manifest, channel
        self.broadcaster, self.broadcasts = broadcaster, assignment.broadcasts
        self.items_by_broadcast, self.dests = items_by_broadcast, dests
        # small batch sizes (tests) shrink the windows too, so every path runs at small scale
        parts = plan_parts(manifest, self.broadcasts, kept,
                           min(WINDOW_BYTES, options.broadcast_batch_bytes),
                           min(RUN_MIN_BYTES, options.broadcast_batch_bytes))
        self.batches = batch_parts(self.broadcasts, parts, options.broadcast_batch_bytes)
        broadcaster.prepare(sorted({members for members, _, _ in self.batches}))
        self.mine = [k for k, (members, _, _) in enumerate(self.batches) if channel.rank in members]
        slab = max([sum(p.nbytes for p in b[2]) for b in self.batches] or [0]) + WINDOW_ALIGN
        self.pool = BufferPool(slab)
        self.budget = max(options.max_read_bytes // 4, options.broadcast_batch_bytes)
        self.pending: dict[int, tuple] = {}
        self.dtypes = {name: torch_dtype(manifest.tensors[name].dtype)
                       for name in {self.broadcasts[i].region.name for i in kept}}
        self.status = torch.zeros(1, dtype=torch.uint8, device=broadcaster.device)
        self.fetched = self.received = 0
        self.count = len(self.mine)
        self.failure: BaseException | None = None

    # -- where a batch's bytes live on this rank ----------------------------------------------

    def _landing(self, part: Part):
        """(bytes, pool buffer or None) for a run window: this rank's destination bytes when it
        can take them in place (a contiguous CPU destination of the stored dtype), else the
        start of a pool buffer (to give back after use)."""
        view = self._landing_in_place(part)
        if view is not None:
            return flat_bytes(view)[part.run.lo:part.run.hi], None
        buf = self.pool.take()
        return buf[:part.run.hi - part.run.lo], buf

    def _landing_in_place(self, part: Part) -> torch.Tensor | None:
        """This rank's destination of a run window's region, when it can take the bytes in
        place: a contiguous CPU destination of the stored dtype."""
        items = self.items_by_broadcast.get(part.broadcast, ())
        if not items or self.broadcaster.device.type != "cpu":
            return None
        view = dest_view(self.dests, items[0])
        dtype = self.dtypes[self.broadcasts[part.broadcast].region.name]
        if view.dtype == dtype and is_byte_viewable(view):
            return view
        return None

    def _prefetch(self, pos: int) -> None:
        """Start fetching this rank's source batches among the next ones, within the byte
        budget, so its reads overlap the broadcasts of other sources."""
        ahead = sum(entry[3] for entry in self.pending.values())
        for k in self.mine[pos:pos + _LOOKAHEAD]:
            _, src, parts = self.batches[k]
            if src != self.channel.rank or k in self.pending:
                continue
            size = self._buffered(parts)
            if self.pending and size and ahead + size > self.budget:
                break
            if parts[0].run is not None:
                land, pooled = self._landing(parts[0])
                ranges = run_ranges(parts[0].run, [byte_view(land)], base=parts[0].run.lo)
                fut = start_task(self.store.read_ranges(parts[0].run.object_key, ranges))
                self.pending[k] = (fut, land, pooled, size)
            else:
                buf = self.pool.take()
                fut = start_task(read_windows(self.store, [p.window for p in parts], buf))
                self.pending[k] = (fut, buf, buf, size)
            ahead += size

    def _buffered(self, parts) -> int:
        """Pool bytes a batch will hold while in flight (none for a run window landing in place:
        its bytes go straight to the destination)."""
        if parts[0].run is not None and self._landing_in_place(parts[0]) is not None:
            return 0
        return sum(p.nbytes for p in parts)

    def cancel_pending(self) -> None:
        """Stop the fetches not consumed (after a failure) and wait until they have stopped, so
        none writes into a destination after the load returns; their buffers are dropped."""
        for entry in self.pending.values():
            entry[0].cancel_and_wait()
        self.pending.clear()

    # -- the batches ----------------------------------------------------------------------------

    def run(self) -> None:
        self._prefetch(0)
        for pos, k in enumerate(self.mine):
            members, src, parts = self.batches[k]
            self._prefetch(pos + 1)
            if src == self.channel.rank:
                fut, buf, pooled, _ = self.pending.pop(k)
                try:
                    fut.result()
                    ok = True
                    self.fetched += sum(p.fetch_bytes for p in parts)
                except Exception as exc:  # reported to every rank at the end of the load phase
                    self.failure = self.failure or exc
                    ok = False
            elif parts[0].run is not None:
                (buf, pooled), ok = self._landing(parts[0]), True
            else:
                buf = pooled = self.pool.take()
                ok = True
            try:
                self._one(members, src, parts, buf, ok, in_place=pooled is None)
            finally:
                if pooled is not None:
                    self.pool.give(pooled)

    def _one(self, members, src, parts, buf: torch.Tensor, ok: bool, *, in_place: bool) -> None:
        """Run one batch; ``in_place``: ``buf`` is this rank's first destination of a run
        window (see :meth:`_landing`)."""
        # first the source says whether it fetched and verified the batch: a failing source
        # still takes part, so no peer is left waiting in a broadcast
        self.status.fill_(1 if ok else 0)
        self.broadcaster.broadcast(self.status, src=src, members=members)
        if int(self.status.item()) != 1:
            # the source records its own error, which the load phase raises on every rank
            # (as the source's error type); a receiver just skips the batch
            return
        if parts[0].run is not None:
            wire = buf
        else:
            wire = buf[:layout_windows([p.window for p in parts])[1]]
        on_device = self.broadcaster.device.type != "cpu"
        if on_device:
            wire = wire.to(self.broadcaster.device)
        self.broadcaster.broadcast(wire, src=src, members=members)
        if src != self.channel.rank:
            self.received += sum(p.nbytes if p.run is not None else p.window.length for p in parts)
        if parts[0].run is not None:
            self._deliver_run(parts[0], wire, in_place)
        else:
            self._deliver_windows(parts, wire)

    def _deliver_run(self, part: Part, wire: torch.Tensor, in_place: bool) -> None:
        """Copy a run window's bytes to every destination of this rank that needs them (with
        ``in_place``, the first one already holds them: they landed there)."""
        items = self.items_by_broadcast.get(part.broadcast, ())
        region = self.broadcasts[part.broadcast].region
        dtype = self.dtypes[region.name]
        elements = wire.view(dtype)
        lo, hi = part.run.lo // dtype.itemsize, part.run.hi // dtype.itemsize
        lengths = tuple(region.lengths)
        for item in items[1:] if in_place else items:
            view = dest_view(self.dests, item)
            pos = 0
            for offsets, sizes in boxes_in_flat_range((0,) * len(lengths), lengths, lengths, lo, hi):
                n = math.prod(sizes)
                sub_view(view, offsets, sizes).copy_(elements[pos:pos + n].view(sizes))
                pos += n

    def _deliver_windows(self, parts, wire: torch.Tensor) -> None:
        layout, _ = layout_windows([p.window for p in parts])
        for part, offset in zip(parts, layout):
            items = self.items_by_broadcast.get(part.broadcast, ())
            if not items:
                continue
            dtype = self.dtypes[self.broadcasts[part.broadcast].region.name]
            for sub, piece in window_boxes(part.window, wire, offset, dtype):
                for item in items:
                    sub_view(dest_view(self.dests, item), sub.offsets, sub.lengths).copy_(piece)
