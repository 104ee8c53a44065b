"""Read once, broadcast: this rank's bytes in a load's broadcast batches (no collective here).

A :class:`BroadcastSession` holds this rank's share of the batches (planned identically on every
rank: :func:`~cloudckpt.planning.parts.plan_parts`, :func:`~cloudckpt.planning.batching.batch_parts`)
and everything about their bytes: fetching the batches this rank is the source of (ahead of
time, within a byte budget), where each batch lands, and copying what arrived into the
destinations. It runs no collective: :func:`cloudckpt.api.load_data.run_broadcasts` drives it,
batch by batch, in the one global order::

    for pos, batch in enumerate(session.batches):
        session.prefetch(pos)          # this batch (if it is this rank's) and the next ones
        landing = session.land(pos)    # the source waits for its verified fetch
        wire = session.wire(landing)
        # api: status broadcast (landing.ok), then (if ok) the data broadcast of wire
        session.deliver(landing, wire)
        session.release(landing)

Contract:
- Bytes reach a destination only once verified: a source's fetch is crc-verified by the store
  before :meth:`~BroadcastSession.land` reports it ``ok``; a receiver's bytes were verified by
  the source, which says so (the status broadcast) before sending them.
- Run batches land in place when this rank's destination is a contiguous CPU tensor of the
  stored dtype (the source reads straight into it; a receiver takes the broadcast there);
  everything else goes through pooled buffers and is copied out, dtype converted.
- A source's fetch error is recorded in :attr:`~BroadcastSession.failure` (first one wins) and
  its batches report ``ok=False``; :meth:`~BroadcastSession.cancel_pending` stops fetches not
  consumed and waits for them, so none writes into a destination after the load returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from cloudckpt.dataplane.buffers import BufferPool, byte_view, flat_bytes, is_byte_viewable
from cloudckpt.dataplane.destinations import dest_view, sub_view
from cloudckpt.dataplane.reader import read_windows, run_ranges, window_boxes
from cloudckpt.planning.batching import BroadcastBatch, RunBatch, batch_parts
from cloudckpt.planning.parts import WINDOW_ALIGN, RunPart, plan_parts
from cloudckpt.planning.windows import boxes_in_flat_range
from cloudckpt.runtime import BackgroundTask, start_task
from cloudckpt.statedict import torch_dtype

#: bytes per broadcast window (the unit a source fetches and verifies before sending).
WINDOW_BYTES = 16 << 20
#: regions at least this large that are one contiguous stored run travel as run windows.
RUN_MIN_BYTES = 1 << 20
#: a source starts fetching at most this many batches after the one being broadcast.
_LOOKAHEAD = 12


@dataclass(frozen=True)
class Landing:
    """Where this rank's bytes of one batch are while it is broadcast.

    ``buf``: a pool buffer, or (a run batch landing in place) the bytes of this rank's first
    destination of the region. ``pooled``: the pool buffer to give back once the batch is done
    (None when landing in place). ``ok``: for the source, whether it fetched and verified the
    batch; True on receivers.
    """

    batch: BroadcastBatch
    buf: torch.Tensor
    pooled: torch.Tensor | None
    ok: bool

    @property
    def in_place(self) -> bool:
        return self.pooled is None


@dataclass(frozen=True)
class _PendingFetch:
    """A source's fetch of one batch in flight: into ``buf`` (see :class:`Landing`), holding
    ``buffered`` bytes of the pool."""

    task: BackgroundTask
    buf: torch.Tensor
    pooled: torch.Tensor | None
    buffered: int


class BroadcastSession:
    """This rank's share of the broadcast batches (see module doc).

    ``broadcasts``: the assignment's broadcasts (the one global order); ``kept``: indices of
    those that run (:func:`~cloudckpt.planning.groups.select_broadcasts`); ``items_by_broadcast``:
    this rank's read items each kept broadcast serves; ``dests``: this rank's destinations;
    ``device``: where broadcast buffers live (CPU for gloo, CUDA for NCCL).
    """

    def __init__(self, store, manifest, broadcasts: Sequence, kept: Sequence[int],
                 items_by_broadcast: dict, dests: Sequence[torch.Tensor], *, rank: int,
                 device: torch.device, batch_bytes: int, max_read_bytes: int):
        self.store, self.manifest, self.rank, self.device = store, manifest, rank, device
        self.broadcasts, self.items_by_broadcast, self.dests = broadcasts, items_by_broadcast, dests
        # small batch sizes (tests) shrink the windows too, so every path runs at small scale
        parts = plan_parts(manifest, broadcasts, kept, min(WINDOW_BYTES, batch_bytes),
                           min(RUN_MIN_BYTES, batch_bytes))
        every = batch_parts(broadcasts, parts, batch_bytes)
        #: the groups every rank must prepare, members or not (sorted)
        self.member_sets: list[tuple[int, ...]] = sorted({b.members for b in every})
        #: the batches this rank takes part in, in the global order
        self.batches: list[BroadcastBatch] = [b for b in every if rank in b.members]
        self.pool = BufferPool(max([b.nbytes for b in every] or [0]) + WINDOW_ALIGN)
        self.budget = max(max_read_bytes // 4, batch_bytes)
        self.dtypes = {name: torch_dtype(manifest.tensors[name].dtype)
                       for name in {broadcasts[i].region.name for i in kept}}
        self._pending: dict[int, _PendingFetch] = {}
        self.fetched = self.received = 0
        self.failure: BaseException | None = None

    @property
    def count(self) -> int:
        """Batches this rank takes part in."""
        return len(self.batches)

    # -- where a batch's bytes live on this rank ----------------------------------------------

    def _run_landing(self, part: RunPart) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bytes, pool buffer or None) for a run part: this rank's destination bytes when it
        can take them in place, else the start of a pool buffer (to give back after use)."""
        view = self._in_place_view(part)
        if view is not None:
            return flat_bytes(view)[part.run.lo:part.run.hi], None
        buf = self.pool.take()
        return buf[:part.run.hi - part.run.lo], buf

    def _in_place_view(self, part: RunPart) -> torch.Tensor | None:
        """This rank's destination of a run part's region, when it can take the bytes in
        place: a contiguous CPU destination of the stored dtype."""
        items = self.items_by_broadcast.get(part.broadcast, ())
        if not items or self.device.type != "cpu":
            return None
        view = dest_view(self.dests, items[0])
        dtype = self.dtypes[self.broadcasts[part.broadcast].region.name]
        if view.dtype == dtype and is_byte_viewable(view):
            return view
        return None

    def _buffered(self, batch: BroadcastBatch) -> int:
        """Pool bytes a batch holds while its fetch is in flight (none for a run batch landing
        in place: its bytes go straight to the destination)."""
        if isinstance(batch, RunBatch) and self._in_place_view(batch.part) is not None:
            return 0
        return batch.nbytes

    # -- fetching as the source -------------------------------------------------------------------

    def prefetch(self, pos: int) -> None:
        """Start fetching this rank's source batches among ``batches[pos:]`` (batch ``pos``
        and at most ``_LOOKAHEAD`` after it, within the byte budget), so its reads overlap the
        broadcasts of other sources. Batch ``pos`` always starts if it has not (the budget
        only stops fetching ahead), so :meth:`land` never waits for a fetch nobody started."""
        ahead = sum(p.buffered for p in self._pending.values())
        for k in range(pos, min(pos + 1 + _LOOKAHEAD, len(self.batches))):
            batch = self.batches[k]
            if batch.src != self.rank or k in self._pending:
                continue
            size = self._buffered(batch)
            if self._pending and size and ahead + size > self.budget:
                break
            self._start(k, size)
            ahead += size

    def _start(self, k: int, size: int) -> None:
        batch = self.batches[k]
        if isinstance(batch, RunBatch):
            run = batch.part.run
            land, pooled = self._run_landing(batch.part)
            ranges = run_ranges(run, [byte_view(land)], base=run.lo)
            task = start_task(self.store.read_ranges(run.object_key, ranges))
            self._pending[k] = _PendingFetch(task, land, pooled, size)
        else:
            buf = self.pool.take()
            task = start_task(read_windows(self.store, [p.window for p in batch.parts], buf))
            self._pending[k] = _PendingFetch(task, buf, buf, size)

    def cancel_pending(self) -> None:
        """Stop the fetches not consumed (after a failure) and wait until they have stopped, so
        none writes into a destination after the load returns; their buffers are dropped."""
        for fetch in self._pending.values():
            fetch.task.cancel_and_wait()
        self._pending.clear()

    # -- one batch ----------------------------------------------------------------------------------

    def land(self, pos: int) -> Landing:
        """Where batch ``pos``'s bytes are on this rank. The source waits for its fetch: a
        failure is recorded in :attr:`failure` and reported as ``ok=False``."""
        batch = self.batches[pos]
        if batch.src == self.rank:
            if pos not in self._pending:  # not prefetched (see prefetch): start it now
                self._start(pos, self._buffered(batch))
            fetch = self._pending.pop(pos)
            try:
                fetch.task.result()
                ok = True
                self.fetched += sum(p.fetch_bytes for p in batch.parts)
            except Exception as exc:  # reported to every rank at the end of the load phase
                self.failure = self.failure or exc
                ok = False
            return Landing(batch, fetch.buf, fetch.pooled, ok)
        if isinstance(batch, RunBatch):
            buf, pooled = self._run_landing(batch.part)
            return Landing(batch, buf, pooled, True)
        buf = self.pool.take()
        return Landing(batch, buf, buf, True)

    def wire(self, landing: Landing) -> torch.Tensor:
        """The tensor a batch travels in, on :attr:`device`: all of a run batch's landing, the
        used part of a window batch's buffer (copied to the device for NCCL)."""
        if isinstance(landing.batch, RunBatch):
            wire = landing.buf
        else:
            wire = landing.buf[:landing.batch.layout()[1]]
        return wire if self.device.type == "cpu" else wire.to(self.device)

    def release(self, landing: Landing) -> None:
        """Give a batch's pool buffer back (after its broadcast, delivered or not)."""
        if landing.pooled is not None:
            self.pool.give(landing.pooled)

    def deliver(self, landing: Landing, wire: torch.Tensor) -> None:
        """Copy a broadcast batch's bytes ``wire`` (on :attr:`device`) to every destination of
        this rank that needs them (dtype converted); counts received bytes."""
        batch = landing.batch
        if batch.src != self.rank:
            self.received += sum(p.payload_bytes for p in batch.parts)
        if isinstance(batch, RunBatch):
            self._deliver_run(batch.part, wire, landing.in_place)
        else:
            self._deliver_windows(batch, wire)

    def _deliver_run(self, part: RunPart, wire: torch.Tensor, in_place: bool) -> None:
        """With ``in_place``, the first destination already holds the bytes: they landed there."""
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

    def _deliver_windows(self, batch, wire: torch.Tensor) -> None:
        layout, _ = batch.layout()
        for part, offset in zip(batch.parts, layout):
            items = self.items_by_broadcast.get(part.broadcast, ())
            if not items:
                continue
            dtype = self.dtypes[self.broadcasts[part.broadcast].region.name]
            for sub, piece in window_boxes(part.window, wire, offset, dtype):
                for item in items:
                    sub_view(dest_view(self.dests, item), sub.offsets, sub.lengths).copy_(piece)
