"""The body of a load's ``load`` phase: moving tensor bytes, own reads and read-once broadcasts.

Used by :mod:`cloudckpt.api.load` (which sequences the surrounding phases). The plan is
planning's (:func:`~cloudckpt.planning.broadcast.plan.plan_broadcasts`: which path each read
item takes, the rounds), the bytes are the data plane's (:mod:`cloudckpt.dataplane`); this
module chooses the broadcasts the transport can run and runs the collectives, in an order
every rank follows.

Contract:
- Every destination element is written only with bytes whose checksum block was verified (by
  the store for fetched bytes; by the source rank, which says so before sending, for broadcast
  bytes). A failure leaves destinations possibly half filled and is raised on this rank; the
  caller's ``load`` phase turns it into the same error on every rank.
- Every rank runs the rounds in the same global order (computed identically from the
  exchanged plans), so no rank waits in a collective its peers never join. A round with one
  source is a broadcast; a round with several is an exchange: all of the group's sources send
  at once (``Broadcaster.exchange``, a ring among the members), so every member's link is busy.
- A source that cannot fetch still takes part and says so: in a round of window batches
  (through buffers, ``Round.buffered``) with a status byte at the end of the bytes it sends
  anyway (no collective of its own); in a round with run batches (which may land straight in
  destinations) first, before the bytes: a 1-byte status broadcast, or an all-gather of every
  member's. A slot whose source failed is skipped by every receiver, and the source's error
  reaches every rank at the end of the phase.
"""

from __future__ import annotations

import torch

from cloudckpt.dataplane.broadcast import BroadcastSession, sent_ok
from cloudckpt.dataplane.destinations import fetch_into
from cloudckpt.options import LoadOptions
from cloudckpt.planning.broadcast.groups import select_broadcasts
from cloudckpt.planning.broadcast.plan import plan_broadcasts, split_reads
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.runtime.loop import run_coroutine, submit
from cloudckpt.transport import Broadcaster


def move_data(store, manifest, plans, channel, dests, options: LoadOptions):
    """Fetch own regions and run the broadcasts. Returns (fetched, received, broadcast count)."""
    mine = plans[channel.rank].reads
    broadcast = options.broadcast if options.broadcast is not None else store.remote
    if channel.size == 1 or not broadcast:
        return run_coroutine(fetch_into(store, manifest, mine, dests, options.max_read_bytes)), 0, 0

    broadcaster = Broadcaster(channel)
    # every shared region is a candidate, however small: a group's broadcasts run when they
    # move min_broadcast_bytes in all (small regions travel together in its batches)
    assignment = assign_readers(plans, min_broadcast_bytes=0)
    if broadcaster.can_use_subgroups:
        kept = select_broadcasts(
            assignment.broadcasts,
            options.max_broadcast_groups,
            min_group_bytes=options.min_broadcast_bytes,
        )
    elif broadcaster.backend == "gloo":  # a strict subgroup job: whole-channel gloo only
        kept = select_broadcasts(
            assignment.broadcasts,
            options.max_broadcast_groups,
            only_group=tuple(range(channel.size)),
            min_group_bytes=options.min_broadcast_bytes,
        )
    else:
        kept = ()
    reads = split_reads(plans[channel.rank], assignment, kept)
    own = submit(fetch_into(store, manifest, reads.own_reads, dests, options.max_read_bytes // 2))
    session = None
    try:
        plan = plan_broadcasts(
            manifest,
            assignment,
            kept,
            reads.items_by_broadcast,
            rank=channel.rank,
            batch_bytes=options.broadcast_batch_bytes,
            max_read_bytes=options.max_read_bytes,
        )
        session = BroadcastSession(store, manifest, plan, dests, device=broadcaster.device)
        broadcaster.prepare(plan.member_sets)  # every rank creates every group, in order
        run_broadcasts(session, broadcaster)
    finally:
        if session is not None:
            session.cancel_pending()
        own_fetched = own.result()  # re-raises the background error, if any
    if session.failure is not None:
        raise session.failure
    return session.fetched + own_fetched, session.received, session.count


def run_broadcasts(session: BroadcastSession, broadcaster: Broadcaster) -> None:
    """Run the session's rounds in the global order: for each, the sources' bytes with their
    statuses (or, for run batches, the statuses first), delivered to this rank's destinations
    where the status says the source read its batch."""
    status = torch.zeros(1, dtype=torch.uint8, device=broadcaster.device)
    for pos, round_ in enumerate(session.rounds):
        session.prefetch(pos)  # this rank's batch of this round, if any, and the next ones
        landing = session.land(pos)
        try:
            if round_.exchange:
                _exchange(session, broadcaster, pos, landing)
                continue
            assert landing is not None  # a one-source round always lands (see land)
            batch = round_.batches[0]
            if round_.buffered:
                # through buffers: the source's status (did it fetch and verify the batch?)
                # rides at the end of the bytes, which a failing source sends all the same
                wire = session.wire(landing, status=True)
                broadcaster.broadcast(wire, src=batch.src, members=round_.members)
                if sent_ok(wire):
                    session.deliver(landing, wire[:-1])
                continue
            # first the source says whether it fetched and verified the batch: a failing
            # source still takes part, so no peer is left waiting in a broadcast
            status.fill_(1 if landing.ok else 0)
            broadcaster.broadcast(status, src=batch.src, members=round_.members)
            if int(status.item()) != 1:
                # the source recorded its own error, which the load phase raises on every rank
                # (as the source's error type); a receiver just skips the batch
                continue
            wire = session.wire(landing)
            broadcaster.broadcast(wire, src=batch.src, members=round_.members)
            session.deliver(landing, wire)
        finally:
            session.release(landing)


def _exchange(session: BroadcastSession, broadcaster: Broadcaster, pos: int, landing) -> None:
    """One exchange round: every source's batch passed around the members with its status at
    its end (window batches), or every member's status first (1: nothing to send, or fetched
    ok) and then the ok sources' batches (run batches); each is delivered where it arrives."""
    members = session.rounds[pos].members
    if session.rounds[pos].buffered:
        # through buffers: every source's status rides at the end of its slot
        slots = _pass_around(session, broadcaster, pos, landing, None)
        session.deliver_round(pos, slots, [not t.numel() or sent_ok(t) for t in slots.tensors])
        return
    statuses = torch.zeros(len(members), dtype=torch.uint8, device=broadcaster.device)
    mine = statuses[members.index(session.rank) :][:1]
    mine.fill_(0 if landing is not None and not landing.ok else 1)
    broadcaster.all_gather(statuses, mine, members=members)
    oks = [bool(v) for v in statuses.tolist()]
    slots = _pass_around(session, broadcaster, pos, landing, oks)
    session.deliver_round(pos, slots, oks)


def _pass_around(session: BroadcastSession, broadcaster: Broadcaster, pos: int, landing, oks):
    """Round ``pos``'s slots (``session.exchange_slots``) after the exchange among its
    members; released again if the exchange fails."""
    slots = session.exchange_slots(pos, landing, oks)
    try:
        broadcaster.exchange(slots.tensors, members=session.rounds[pos].members)
    except BaseException:
        session.release_slots(slots)
        raise
    return slots
