"""Broadcast batches and rounds: the one sequence of collectives of a load's broadcasts.

A load's broadcast parts (:mod:`cloudckpt.planning.broadcast.parts`) travel in batches per
(group, source) (:func:`batch_parts`), each part's source chosen so that every member of a
group fetches about as many bytes (:func:`balance_sources`), and the batches are arranged in
exchange rounds (:func:`plan_rounds`): in round ``k`` of a group every source of the group sends
its ``k``-th batch, all at once, so every member's link is busy.

Pure: every rank computing these from the same inputs gets the same batches and rounds, in the
same order: the rounds are the one sequence of collectives every rank runs.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from cloudckpt.planning.batching import aligned, pack_in_order
from cloudckpt.planning.broadcast.parts import Part, RunPart, WindowPart
from cloudckpt.planning.broadcast.readers import Broadcast
from cloudckpt.planning.load.windows import layout_windows


@dataclass(frozen=True)
class RunBatch:
    """One run part, broadcast alone from ``src`` to ``members`` (sorted channel ranks)."""

    members: tuple[int, ...]
    src: int
    part: RunPart

    @property
    def parts(self) -> tuple[RunPart]:
        return (self.part,)

    @property
    def nbytes(self) -> int:
        """Bytes on the wire."""
        return self.part.nbytes


@dataclass(frozen=True)
class WindowBatch:
    """Window parts broadcast together from ``src`` to ``members`` through one buffer, each at
    its :func:`~cloudckpt.planning.load.windows.layout_windows` offset."""

    members: tuple[int, ...]
    src: int
    parts: tuple[WindowPart, ...]

    @cached_property
    def nbytes(self) -> int:
        """Bytes on the wire (and of buffer used): the windows' aligned lengths."""
        return sum(p.nbytes for p in self.parts)

    def layout(self) -> tuple[list[int], int]:
        """Offset of each part's window in the batch buffer, and the bytes used."""
        return layout_windows([p.window for p in self.parts])


BroadcastBatch = RunBatch | WindowBatch


def balance_sources(
    broadcasts: Sequence[Broadcast], parts: Sequence[Part], loads: Sequence[int]
) -> list[int]:
    """The source (channel rank) of each part: every part goes to the member of its broadcast's
    group that fetches the fewest bytes so far, ``loads[r]`` (the bytes rank ``r`` reads for
    itself) counted in, the largest parts first (ties: the part first in order, the lowest
    rank). So each member of a group whose bytes are cut in many parts fetches about an even
    share of them, not whole regions (a state whose bytes are in a few large tensors included).
    """
    load = list(loads)
    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    sources = [0] * len(parts)
    for i in sorted(range(len(parts)), key=lambda i: -parts[i].fetch_bytes):
        group = tuple(broadcasts[parts[i].broadcast].group)
        heap = heaps.get(group)
        if heap is None:
            heap = heaps[group] = [(load[r], r) for r in group]
            heapq.heapify(heap)
        while True:  # entries go stale when a rank took a part through another group
            held, r = heap[0]
            if held == load[r]:
                break
            heapq.heapreplace(heap, (load[r], r))
        sources[i] = r
        load[r] += parts[i].fetch_bytes
        heapq.heapreplace(heap, (load[r], r))
    return sources


def batch_parts(
    broadcasts: Sequence[Broadcast],
    parts: Sequence[Part],
    batch_bytes: int,
    sources: Sequence[int] | None = None,
) -> list[BroadcastBatch]:
    """Cut ``parts`` (in global order) into broadcast batches.

    ``sources[i]`` is part ``i``'s source (:func:`balance_sources`); without it, its
    broadcast's ``src``. Parts are grouped by (their broadcast's group, source), keys in order
    of first appearance,
    each key's parts keeping their order: a run part is a :class:`RunBatch` alone; consecutive
    window parts between runs are cut by :func:`pack_in_order` with ``batch_bytes``. The keys'
    batch sequences are then interleaved round-robin (first batch of every key, then the
    second, ...), so every source's reads run while others broadcast.
    """
    per_key: dict[tuple[tuple[int, ...], int], list[BroadcastBatch]] = {}
    windows: dict[tuple[tuple[int, ...], int], list[WindowPart]] = {}

    def close(key: tuple[tuple[int, ...], int]) -> None:
        pending = windows.pop(key, [])
        for group in pack_in_order([p.nbytes for p in pending], batch_bytes):
            per_key[key].append(WindowBatch(key[0], key[1], tuple(pending[j] for j in group)))

    for i, part in enumerate(parts):
        b = broadcasts[part.broadcast]
        key = (tuple(b.group), b.src if sources is None else sources[i])
        per_key.setdefault(key, [])
        if isinstance(part, RunPart):
            close(key)
            per_key[key].append(RunBatch(key[0], key[1], part))
        else:
            windows.setdefault(key, []).append(part)
    for key in list(windows):
        close(key)
    queues = [list(q) for q in per_key.values()]
    ordered: list[BroadcastBatch] = []
    for round_ in range(max((len(q) for q in queues), default=0)):
        ordered.extend(q[round_] for q in queues if round_ < len(q))
    return ordered


@dataclass(frozen=True)
class Round:
    """One step of the schedule: every source in ``batches`` (at most one batch each, sources
    ascending) sends its batch to the other ``members`` (sorted channel ranks) at the same time.

    A round of one batch is a broadcast from its source; a round of several is an exchange: each
    member contributes a slot of :attr:`width` bytes at :meth:`slot` (a source its batch, the
    others nothing) and every member receives every slot.
    """

    members: tuple[int, ...]
    batches: tuple[BroadcastBatch, ...]

    @property
    def exchange(self) -> bool:
        """Whether several sources send in this round (an exchange, not a broadcast)."""
        return len(self.batches) > 1

    @property
    def buffered(self) -> bool:
        """Whether every batch of this round travels through buffers (window batches): its
        source's status can then ride at the end of its bytes (see
        :func:`cloudckpt.api.load_data.run_broadcasts`)."""
        return all(isinstance(b, WindowBatch) for b in self.batches)

    @property
    def width(self) -> int:
        """Bytes of each member's slot in an exchange: the largest batch, aligned."""
        return max(aligned(b.nbytes) for b in self.batches)

    def slot(self, rank: int) -> int:
        """Index of ``rank``'s slot (its position among the members)."""
        return self.members.index(rank)


def plan_rounds(batches: Sequence[BroadcastBatch]) -> list[Round]:
    """Arrange ``batches`` (as :func:`batch_parts` gives them) in rounds: per group (groups in
    order of first appearance), round ``k`` holds the ``k``-th batch of each of the group's
    sources that has one; the groups' rounds are then interleaved round-robin (first round of
    every group, then the second, ...). Every batch is in exactly one round, and each source's
    batches keep their order."""
    per_group: dict[tuple[int, ...], dict[int, list[BroadcastBatch]]] = {}
    for b in batches:
        per_group.setdefault(b.members, {}).setdefault(b.src, []).append(b)
    queues = []
    for members, by_src in per_group.items():
        depth = max(len(q) for q in by_src.values())
        queues.append(
            [
                Round(members, tuple(by_src[s][k] for s in sorted(by_src) if k < len(by_src[s])))
                for k in range(depth)
            ]
        )
    ordered: list[Round] = []
    for k in range(max((len(q) for q in queues), default=0)):
        ordered.extend(q[k] for q in queues if k < len(q))
    return ordered
