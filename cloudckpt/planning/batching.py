"""Batching: cutting ordered byte runs into bounded groups. Pure (ints and tuples, no torch).

Several users, one cutting rule (:func:`pack_in_order`: keep the order, start a new group when
the open one is not empty and the next item would take it past the cap; so only a group of one
item exceeds the cap):

- the writer packs a rank's items into data objects (:func:`pack_in_order` on item sizes);
- the reader groups the byte spans it fetches into one ``read_ranges`` call per batch of one
  object (:func:`batch_by_object`), so the store coalesces neighbours into few large GETs;
- a load's broadcast parts travel in batches (:mod:`cloudckpt.planning.broadcast.rounds`).

Pieces sharing one buffer each start at a multiple of :data:`WINDOW_ALIGN` (:func:`aligned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: every window starts at a multiple of this in a shared buffer (dtype views need alignment).
WINDOW_ALIGN = 64


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of :data:`WINDOW_ALIGN`."""
    return -(-nbytes // WINDOW_ALIGN) * WINDOW_ALIGN


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


@dataclass(frozen=True, slots=True)
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
    :func:`aligned` lengths with ``cap``. Every span is in exactly
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
