"""Read once, share: this rank's bytes in a load's broadcast rounds (no collective here).

A :class:`BroadcastSession` moves the bytes of this rank's share of the rounds, a finished
:class:`~cloudckpt.planning.broadcast.plan.BroadcastPlan` (planned identically on every rank by
:func:`~cloudckpt.planning.broadcast.plan.plan_broadcasts`): fetching the batches this rank is
the source of (ahead, in the order the rounds use them, a few at a time, within the plan's
byte budget), where each batch lands, and copying what arrived into the destinations. It runs
no collective: :func:`cloudckpt.api.load_data.run_broadcasts` drives it, round by round, in the
one global order::

    for pos, round_ in enumerate(session.rounds):
        session.prefetch(pos)          # this rank's batches of this round and the next ones
        landing = session.land(pos)    # the source waits for its verified fetch
        if round_.exchange:            # several sources at once
            # window batches only (round_.buffered): every slot comes, its status at its end
            slots = session.exchange_slots(pos, landing, None)
            # api: exchange the slots among the members; oks: sent_ok(slot) per member
            # otherwise: api all-gathers every member's status (landing.ok, or 1): oks, and
            # slots = session.exchange_slots(pos, landing, oks), exchanged the same way
            session.deliver_round(pos, slots, oks)
        else:                          # one source
            wire = session.wire(landing, status=round_.buffered)
            # api: the data broadcast of wire (after a status broadcast unless buffered)
            session.deliver(landing, wire if not round_.buffered else wire[:-1])
        session.release(landing)

Contract:
- Bytes reach a destination only once verified: a source's fetch is crc-verified by the store
  before :meth:`~BroadcastSession.land` reports it ``ok``; a receiver's bytes were verified by
  the source, which says so (its status) before sending them; a slot whose source said it
  failed is never delivered.
- Run batches land in place when this rank's destination is a contiguous CPU tensor of the
  stored dtype (the source reads straight into it and sends from there; a receiver takes the
  bytes there, in a broadcast or an exchange); everything else goes through pooled buffers and
  is copied out, dtype converted.
- A source fetches its batches in the order of the rounds, one at a time (a run batch in a few
  concurrent requests; so the first round's bytes are complete first, and each later fetch
  runs while earlier rounds are sent) and at most ``_LOOKAHEAD`` rounds ahead, with the bytes
  of pooled buffers it holds bounded by the budget; after a failed fetch the rest start at once
  (so a dead store fails every fetch within one retry deadline, not one after another).
- A source's fetch error is recorded in :attr:`~BroadcastSession.failure` (first one wins) and
  its batches report ``ok=False``; :meth:`~BroadcastSession.cancel_pending` stops fetches not
  consumed and waits for them, so none writes into a destination after the load returns.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from cloudckpt.dataplane.buffers import BufferPool, byte_view, flat_bytes, is_byte_viewable
from cloudckpt.dataplane.destinations import DestinationBytes, dest_view, sub_view
from cloudckpt.dataplane.reader import read_windows, run_ranges, stored_dtype, window_boxes
from cloudckpt.planning.batching import pack_in_order
from cloudckpt.planning.broadcast.parts import RunPart
from cloudckpt.planning.broadcast.plan import BroadcastPlan
from cloudckpt.planning.broadcast.rounds import BroadcastBatch, Round, RunBatch
from cloudckpt.planning.load.plan import ReadItem
from cloudckpt.planning.load.windows import boxes_in_flat_range, dense_run
from cloudckpt.runtime.loop import BackgroundTask, start_task
from cloudckpt.storage.base import run_all

#: a source starts fetching at most this many rounds after the one being sent.
_LOOKAHEAD = 12
#: a source's batch fetches running at once (started in round order), until one fails: one,
#: so that the link's whole rate goes to the batch the next round needs.
_FETCHES_IN_FLIGHT = 1
#: a run batch's blocks are read in requests of about this many bytes, concurrently.
_REQUEST_BYTES = 4 << 20


@dataclass(frozen=True)
class Landing:
    """Where this rank's bytes of one batch are while it is sent.

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


@dataclass(frozen=True)
class ExchangeSlots:
    """Where each member's batch of an exchange round is on this rank (see
    :meth:`BroadcastSession.exchange_slots`): ``tensors[j]`` (on the session's device) holds,
    or receives, member ``j``'s bytes (empty: nothing comes from ``j``); ``in_place[j]``: they
    land straight in this rank's destination; ``pooled``: pool buffers to give back."""

    tensors: tuple[torch.Tensor, ...]
    in_place: tuple[bool, ...]
    pooled: tuple[torch.Tensor, ...]


class _InOrder:
    """Runs coroutines at most ``limit`` at once, admitted in the order they asked; after
    :meth:`open`, all at once. Used on the background loop only."""

    def __init__(self, limit: int):
        self.limit, self.busy, self.opened = limit, 0, False
        self._waiting: deque[asyncio.Future] = deque()

    async def run(self, make: Callable):
        if not self.opened and (self.busy >= self.limit or self._waiting):
            turn = asyncio.get_running_loop().create_future()
            self._waiting.append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():  # admitted as it was cancelled
                    self._leave()
                raise
        else:
            self.busy += 1
        try:
            return await make()
        except Exception:
            self.open()
            raise
        finally:
            self._leave()

    def open(self) -> None:
        self.opened = True
        self._admit()

    def _leave(self) -> None:
        self.busy -= 1
        self._admit()

    def _admit(self) -> None:
        while self._waiting and (self.opened or self.busy < self.limit):
            turn = self._waiting.popleft()
            if not turn.done():  # a cancelled waiter is skipped
                self.busy += 1
                turn.set_result(None)


#: smaller copies of delivered bytes keep the GIL (ctypes and torch calls release it, and each
#: release hands it to the loop thread receiving this rank's own reads: measured, 250 small
#: regions took 34 ms of hand-offs)
_GIL_COPY_BYTES = 1 << 20


class BroadcastSession:
    """The bytes of ``plan`` on this rank (see module doc): ``dests``, its destination tensors
    (the plan's read items index them); ``device``: where sent buffers live (CPU for gloo, CUDA
    for NCCL)."""

    def __init__(self, store, manifest, plan: BroadcastPlan, dests, *, device: torch.device):
        self.store, self.plan, self.dests, self.device = store, plan, dests, device
        self.rank, self.broadcasts, self._mine = plan.rank, plan.broadcasts, plan.sends
        self.items_by_broadcast = plan.items_by_broadcast
        self.pool = BufferPool(plan.buffer_bytes)
        self.dtypes = {name: stored_dtype(manifest, name) for name in plan.region_names}
        self.landing = DestinationBytes(dests)
        self._pending: dict[int, _PendingFetch] = {}
        self._gate = _InOrder(_FETCHES_IN_FLIGHT)
        self.fetched = self.received = 0
        self.failure: BaseException | None = None

    @property
    def rounds(self) -> tuple[Round, ...]:
        """The rounds this rank takes part in, in the global order."""
        return self.plan.rounds

    @property
    def batches(self) -> tuple[BroadcastBatch, ...]:
        """The batches of those rounds (this rank sends or receives each)."""
        return self.plan.batches

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
            return flat_bytes(view)[part.run.lo : part.run.hi], None
        buf = self.pool.take()
        return buf[: part.run.hi - part.run.lo], buf

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
        """Start fetching this rank's batches of rounds ``pos`` to ``pos + _LOOKAHEAD``, in
        round order, within the byte budget (the fetches themselves run a few at a time: see
        module doc), so its reads overlap the rounds before. Round ``pos``'s always starts if
        it has not (the budget only stops fetching ahead), so :meth:`land` never waits for a
        fetch nobody started."""
        ahead = sum(p.buffered for p in self._pending.values())
        for k in range(pos, min(pos + 1 + _LOOKAHEAD, len(self.rounds))):
            if k not in self._mine or k in self._pending:
                continue
            size = self._buffered(self._mine[k])
            if self._pending and size and ahead + size > self.plan.fetch_budget:
                break
            self._start(k, size)
            ahead += size

    def _start(self, k: int, size: int) -> None:
        batch = self._mine[k]
        if isinstance(batch, RunBatch):
            run = batch.part.run
            land, pooled = self._run_landing(batch.part)
            ranges = run_ranges(run, [byte_view(land)], base=run.lo)
            groups = [
                [ranges[i] for i in g]
                for g in pack_in_order([r.length for r in ranges], _REQUEST_BYTES)
            ]
            task = start_task(
                self._gate.run(
                    lambda: run_all(self.store.read_ranges(run.object_key, g) for g in groups)
                )
            )
            self._pending[k] = _PendingFetch(task, land, pooled, size)
        else:
            buf = self.pool.take()
            windows = [p.window for p in batch.parts]
            task = start_task(self._gate.run(lambda: read_windows(self.store, windows, buf)))
            self._pending[k] = _PendingFetch(task, buf, buf, size)

    def cancel_pending(self) -> None:
        """Stop the fetches not consumed (after a failure) and wait until they have stopped, so
        none writes into a destination after the load returns; their buffers are dropped."""
        for fetch in self._pending.values():
            fetch.task.cancel_and_wait()
        self._pending.clear()

    # -- one round ------------------------------------------------------------------------------

    def land(self, pos: int) -> Landing | None:
        """Where this rank's bytes of round ``pos`` are: the batch it sends (waiting for its
        fetch: a failure is recorded in :attr:`failure` and reported as ``ok=False``), or, in a
        one-source round it receives, where the batch will arrive. None in an exchange round
        this rank sends nothing in (what it receives arrives in :meth:`exchange_slots`)."""
        round_ = self.rounds[pos]
        batch = self._mine.get(pos)
        if batch is not None:
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
        if round_.exchange:
            return None
        batch = round_.batches[0]
        if isinstance(batch, RunBatch):
            buf, pooled = self._run_landing(batch.part)
            return Landing(batch, buf, pooled, True)
        buf = self.pool.take()
        return Landing(batch, buf, buf, True)

    def wire(self, landing: Landing, *, status: bool = False) -> torch.Tensor:
        """The tensor a one-source round's batch travels in, on :attr:`device`: all of a run
        batch's landing, the used part of a window batch's buffer (copied to the device for
        NCCL). With ``status`` (a window batch), one byte more: the source's status (1: fetched
        and verified), set here on the source (see :func:`sent_ok`)."""
        n = landing.batch.nbytes
        if status:
            if landing.batch.src == self.rank:
                landing.buf[n] = 1 if landing.ok else 0
            n += 1
        wire = landing.buf[:n]
        return wire if self.device.type == "cpu" else wire.to(self.device)

    def exchange_slots(
        self, pos: int, landing: Landing | None, oks: Sequence[bool] | None
    ) -> ExchangeSlots:
        """Where each member's batch of exchange round ``pos`` is, or arrives, on this rank:
        this rank's own batch where it landed; another source's, when ``oks`` (per member)
        says it is coming, in place in this rank's destination where it can (a run batch, a
        contiguous CPU destination of the stored dtype), else in a pool buffer (a device
        buffer for NCCL). ``oks=None`` (a round of window batches only, ``Round.buffered``):
        every source's slot comes, one byte longer, its source's status at its end (set here
        for this rank's own; read with :func:`sent_ok`)."""
        round_ = self.rounds[pos]
        empty = torch.empty(0, dtype=torch.uint8, device=self.device)
        tensors, in_place, pooled = [empty] * len(round_.members), [False] * len(round_.members), []
        status = oks is None
        for batch in round_.batches:
            j = round_.slot(batch.src)
            if oks is not None and not oks[j]:
                continue
            n = batch.nbytes + status
            if batch.src == self.rank:
                assert landing is not None  # this rank's own batch has landed (see land)
                if status:
                    landing.buf[batch.nbytes] = 1 if landing.ok else 0
                buf, flat = landing.buf[:n].to(self.device), landing.in_place
            elif self.device.type != "cpu":
                buf, flat = torch.empty(n, dtype=torch.uint8, device=self.device), False
            elif isinstance(batch, RunBatch):
                buf, held = self._run_landing(batch.part)
                flat = held is None
                if held is not None:
                    pooled.append(held)
            else:
                held = self.pool.take()
                pooled.append(held)
                buf, flat = held[:n], False
            tensors[j], in_place[j] = buf, flat
        return ExchangeSlots(tuple(tensors), tuple(in_place), tuple(pooled))

    def release(self, landing: Landing | None) -> None:
        """Give a batch's pool buffer back (after its round, delivered or not)."""
        if landing is not None and landing.pooled is not None:
            self.pool.give(landing.pooled)

    def deliver(self, landing: Landing, wire: torch.Tensor) -> None:
        """Copy a one-source round's bytes ``wire`` (on :attr:`device`) to every destination of
        this rank that needs them (dtype converted); counts received bytes."""
        self._deliver(landing.batch, wire, landing.in_place)

    def deliver_round(self, pos: int, slots: ExchangeSlots, oks: Sequence[bool]) -> None:
        """Copy every batch of exchange round ``pos`` whose source said it is ok (``oks``, per
        member) from its slot to this rank's destinations (those it did not land in); counts
        received bytes. Gives the round's pool buffers back."""
        round_ = self.rounds[pos]
        try:
            for batch in round_.batches:
                j = round_.slot(batch.src)
                if oks[j]:
                    self._deliver(batch, slots.tensors[j], slots.in_place[j])
        finally:
            self.release_slots(slots)

    def release_slots(self, slots: ExchangeSlots) -> None:
        """Give an exchange round's pool buffers back (delivered or not)."""
        for buf in slots.pooled:
            self.pool.give(buf)

    def _deliver(self, batch: BroadcastBatch, wire: torch.Tensor, in_place: bool) -> None:
        if batch.src != self.rank:
            self.received += sum(p.payload_bytes for p in batch.parts)
        if isinstance(batch, RunBatch):
            self._deliver_run(batch.part, wire, in_place)
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
            for offsets, sizes in boxes_in_flat_range(
                (0,) * len(lengths), lengths, lengths, lo, hi
            ):
                n = math.prod(sizes)
                sub_view(view, offsets, sizes).copy_(elements[pos : pos + n].view(sizes))
                pos += n

    def _deliver_windows(self, batch, wire: torch.Tensor) -> None:
        layout, _ = batch.layout()
        wire_bytes = None  # the wire's bytes (CPU), viewed for the first byte copy
        for part, offset in zip(batch.parts, layout):
            items = self.items_by_broadcast.get(part.broadcast, ())
            if not items:
                continue
            region = self.broadcasts[part.broadcast].region
            dtype = self.dtypes[region.name]
            window = part.window
            if len(window.boxes) == 1 and wire.device.type == "cpu":
                # the usual small region: whole in one window, its elements one run there;
                # destinations of the stored dtype take its bytes with one copy each
                run = dense_run(window)
                if run is not None and run[1] == region.nbytes and run[1] < _GIL_COPY_BYTES:
                    wire_bytes = byte_view(wire) if wire_bytes is None else wire_bytes
                    start, n = offset + run[0], run[1]
                    rest: list[ReadItem] = []
                    for item in items:
                        views = self.landing.views((item,), dtype)
                        if views is None or len(views[0]) != n:
                            rest.append(item)
                        else:  # holding the GIL, which the loop thread wants
                            views[0][:] = wire_bytes[start : start + n]
                    items = tuple(rest)
            for sub, piece in window_boxes(window, wire, offset, dtype) if items else ():
                for item in items:
                    sub_view(dest_view(self.dests, item), sub.offsets, sub.lengths).copy_(piece)


def sent_ok(wire: torch.Tensor) -> bool:
    """The status at the end of a batch's bytes sent with it (see
    :meth:`BroadcastSession.wire` / :meth:`BroadcastSession.exchange_slots`): whether its
    source fetched and verified them."""
    return int(wire[-1].item()) == 1
