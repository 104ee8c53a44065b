"""Batching: cutting ordered byte runs into bounded groups. Pure (ints and tuples, no torch).

Three users, one cutting rule (:func:`pack_in_order`: keep the order, start a new group when
the open one is not empty and the next item would take it past the cap; so only a group of one
item exceeds the cap):

- the writer packs a rank's items into data objects (:func:`pack_in_order` on item sizes);
- the reader groups the byte spans it fetches into one ``read_ranges`` call per batch of one
  object (:func:`batch_by_object`), so the store coalesces neighbours into few large GETs;
- a load's broadcasts travel in batches per (group, source) (:func:`batch_parts`), interleaved
  round-robin so every source's reads overlap the others' broadcasts.

Every rank computing :func:`batch_parts` from the same inputs gets the same batches, in the
same order: that order is the one sequence of broadcasts every rank runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from cloudckpt.planning.parts import Part, RunPart, WindowPart, aligned, layout_windows


def pack_in_order(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """Indices ``0 .. len(sizes) - 1`` cut in order into groups of at most ``cap`` bytes: a new
    group starts when the open one is non-empty and ``sizes[i]`` would take it past ``cap``
    (an item larger than ``cap`` is a group alone)."""
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, n in enumerate(sizes):
        if current and filled + n > cap:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += n
    if current:
        groups.append(current)
    return groups


@dataclass(frozen=True)
class Span:
    """Bytes ``[start, start + length)`` of object ``object_key`` that one fetch piece reads."""

    object_key: str
    start: int
    length: int


@dataclass(frozen=True)
class ObjectBatch:
    """Spans (indices into the input) read by one ``read_ranges`` call on ``object_key``,
    in byte order."""

    object_key: str
    members: tuple[int, ...]


def batch_by_object(spans: Sequence[Span], cap: int) -> list[ObjectBatch]:
    """Group ``spans`` per object (objects in order of first appearance), each object's spans
    sorted by start (ties keep input order) and cut by :func:`pack_in_order` on their
    :func:`~cloudckpt.planning.parts.aligned` lengths with ``cap``. Every span is in exactly
    one batch."""
    per_object: dict[str, list[int]] = {}
    for i, s in enumerate(spans):
        per_object.setdefault(s.object_key, []).append(i)
    batches: list[ObjectBatch] = []
    for key, members in per_object.items():
        members.sort(key=lambda i: spans[i].start)
        for group in pack_in_order([aligned(spans[i].length) for i in members], cap):
            batches.append(ObjectBatch(key, tuple(members[j] for j in group)))
    return batches


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
    its :func:`~cloudckpt.planning.parts.layout_windows` offset."""

    members: tuple[int, ...]
    src: int
    parts: tuple[WindowPart, ...]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire (and of buffer used): the windows' aligned lengths."""
        return sum(p.nbytes for p in self.parts)

    def layout(self) -> tuple[list[int], int]:
        """Offset of each part's window in the batch buffer, and the bytes used."""
        return layout_windows([p.window for p in self.parts])


BroadcastBatch = Union[RunBatch, WindowBatch]


def batch_parts(broadcasts, parts: Sequence[Part], batch_bytes: int) -> list[BroadcastBatch]:
    """Cut ``parts`` (in global order) into broadcast batches.

    Parts are grouped by their broadcast's (group, src), keys in order of first appearance,
    each key's parts keeping their order: a run part is a :class:`RunBatch` alone; consecutive
    window parts between runs are cut by :func:`pack_in_order` with ``batch_bytes``. The keys'
    batch sequences are then interleaved round-robin (first batch of every key, then the
    second, ...), so every source's reads run while others broadcast.
    """
    per_key: dict[tuple, list[BroadcastBatch]] = {}
    windows: dict[tuple, list[WindowPart]] = {}

    def close(key) -> None:
        pending = windows.pop(key, [])
        for group in pack_in_order([p.nbytes for p in pending], batch_bytes):
            per_key[key].append(WindowBatch(key[0], key[1], tuple(pending[j] for j in group)))

    for part in parts:
        b = broadcasts[part.broadcast]
        key = (tuple(b.group), b.src)
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
