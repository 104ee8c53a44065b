"""A load's broadcast plan: this rank's share of the read-once rounds, as one frozen value.

:func:`plan_broadcasts` turns the reader assignment
(:func:`~cloudckpt.planning.broadcast.readers.assign_readers`) and the kept broadcasts
(:func:`~cloudckpt.planning.broadcast.groups.select_broadcasts`) into a :class:`BroadcastPlan`:
the parts (:func:`~cloudckpt.planning.broadcast.parts.plan_parts`, windows sized by
:func:`~cloudckpt.planning.broadcast.parts.part_window_bytes`), each part's source balanced over
its group (:func:`~cloudckpt.planning.broadcast.rounds.balance_sources`), the batches and the
rounds (:func:`~cloudckpt.planning.broadcast.rounds.batch_parts`,
:func:`~cloudckpt.planning.broadcast.rounds.plan_rounds`), and which of this rank's read items
each kept broadcast serves (:func:`split_reads`: the rest it reads itself).

Contract:
- Pure (no I/O, no torch): every rank computing a plan from the same plans, assignment and
  options gets the same rounds in the same global order (:attr:`BroadcastPlan.member_sets` and
  the batches of every round it takes part in agree with every other rank's plan); only the
  rank's own selections (:attr:`~BroadcastPlan.rounds`, :attr:`~BroadcastPlan.sends`,
  :attr:`~BroadcastPlan.items_by_broadcast`) differ.
- :func:`split_reads` puts every read item of the rank in exactly one of
  :attr:`ReadSplit.own_reads` and :attr:`ReadSplit.items_by_broadcast` (by the broadcast that
  serves it, plan order kept); the rank fetches its own reads while the broadcasts are planned.
- A plan is a value: the data plane (:class:`cloudckpt.dataplane.broadcast.BroadcastSession`)
  moves its bytes and keeps its own progress; nothing here changes while it does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.batching import WINDOW_ALIGN
from cloudckpt.planning.broadcast.parts import part_window_bytes, plan_parts
from cloudckpt.planning.broadcast.readers import Broadcast, ReadAssignment
from cloudckpt.planning.broadcast.rounds import (
    BroadcastBatch,
    Round,
    balance_sources,
    batch_parts,
    plan_rounds,
)
from cloudckpt.planning.load.plan import LocalLoadPlan, ReadItem

#: the largest window a part carries (the unit a source fetches and verifies before sending).
WINDOW_BYTES = 16 << 20
#: regions at least this large that are one contiguous stored run travel as run windows.
RUN_MIN_BYTES = 1 << 20


@dataclass(frozen=True, kw_only=True)
class BroadcastPlan:
    """Rank ``rank``'s share of a load's broadcast rounds (see module doc).

    ``broadcasts``: the assignment's broadcasts (the one global order; parts and items refer to
    them by index); ``kept``: indices of those that run; ``member_sets``: the groups every rank
    must prepare, members or not (sorted); ``rounds``: the rounds this rank takes part in, in
    the global order; ``sends``: round position (in ``rounds``) -> the batch this rank is the
    source of there; ``items_by_broadcast``: this rank's read items each kept broadcast
    serves (:func:`split_reads`; the rest it fetches itself);
    ``buffer_bytes``: the size of one pooled buffer (the largest batch of any rank, aligned
    room to spare); ``fetch_budget``: the pooled bytes a source may hold in fetches ahead.
    """

    rank: int
    broadcasts: tuple[Broadcast, ...]
    kept: tuple[int, ...]
    member_sets: tuple[tuple[int, ...], ...]
    rounds: tuple[Round, ...]
    sends: Mapping[int, BroadcastBatch]
    items_by_broadcast: Mapping[int, tuple[ReadItem, ...]]
    buffer_bytes: int
    fetch_budget: int

    @cached_property
    def batches(self) -> tuple[BroadcastBatch, ...]:
        """The batches of :attr:`rounds` (this rank sends or receives each), in order."""
        return tuple(b for r in self.rounds for b in r.batches)

    @property
    def region_names(self) -> frozenset[str]:
        """Names of the tensors whose regions the kept broadcasts carry."""
        return frozenset(self.broadcasts[i].region.name for i in self.kept)


@dataclass(frozen=True, kw_only=True)
class ReadSplit:
    """A rank's read items by the path they take: ``items_by_broadcast``, those each kept
    broadcast serves (plan order kept); ``own_reads``, those the rank fetches itself."""

    items_by_broadcast: Mapping[int, tuple[ReadItem, ...]]
    own_reads: tuple[ReadItem, ...]


def split_reads(plan: LocalLoadPlan, assignment: ReadAssignment, kept: Sequence[int]) -> ReadSplit:
    """Rank ``plan.rank``'s read items: served by a broadcast in ``kept`` (indices into
    ``assignment.broadcasts``) or read by the rank itself; each in exactly one."""
    served_by = assignment.broadcast_of(plan.rank)
    by_kept = np.isin(served_by, np.asarray(kept, dtype=np.int64))
    items = plan.table.items()
    served: dict[int, list[ReadItem]] = {}
    for i, b in zip(np.flatnonzero(by_kept).tolist(), served_by[by_kept].tolist()):
        served.setdefault(b, []).append(items[i])
    return ReadSplit(
        items_by_broadcast={b: tuple(v) for b, v in served.items()},
        own_reads=tuple(items[i] for i in np.flatnonzero(~by_kept).tolist()),
    )


def plan_broadcasts(
    manifest: Manifest,
    assignment: ReadAssignment,
    kept: Sequence[int],
    items_by_broadcast: Mapping[int, tuple[ReadItem, ...]],
    *,
    rank: int,
    batch_bytes: int,
    max_read_bytes: int,
) -> BroadcastPlan:
    """Rank ``rank``'s :class:`BroadcastPlan` of the broadcasts ``kept`` (indices into
    ``assignment.broadcasts``, ascending); ``items_by_broadcast``: the rank's read items each
    serves (:func:`split_reads`). ``batch_bytes`` caps a batch (and, when small, as in tests,
    the windows and the run threshold too, so every path runs at small scale);
    ``max_read_bytes`` bounds the windows (an exchange buffer holds one per rank) and the fetch
    budget. Raises :class:`~cloudckpt.errors.ManifestError` for a region past its chunk's
    bytes."""
    kept = tuple(kept)
    broadcasts = assignment.broadcasts
    loads = assignment.own_bytes(kept)
    total = sum(broadcasts[i].region.nbytes for i in kept)
    window = part_window_bytes(total, len(loads), min(WINDOW_BYTES, batch_bytes), max_read_bytes)
    parts = plan_parts(manifest, broadcasts, kept, window, min(RUN_MIN_BYTES, batch_bytes))
    sources = balance_sources(broadcasts, parts, loads)
    every = plan_rounds(batch_parts(broadcasts, parts, window, sources))
    rounds = tuple(r for r in every if rank in r.members)
    biggest = max([b.nbytes for r in every for b in r.batches] or [0])
    return BroadcastPlan(
        rank=rank,
        broadcasts=broadcasts,
        kept=kept,
        member_sets=tuple(sorted({r.members for r in every})),
        rounds=rounds,
        sends={pos: b for pos, r in enumerate(rounds) for b in r.batches if b.src == rank},
        items_by_broadcast=items_by_broadcast,
        buffer_bytes=biggest + WINDOW_ALIGN,
        fetch_budget=max(max_read_bytes // 4, biggest),
    )
