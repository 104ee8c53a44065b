"""Prefix spreading: each key is stored under one of N hashed prefixes of the store's anchor
(the root URL given to ``open_store``), so a large job spreads its requests over N S3 key-space
partitions instead of hammering one prefix's request-rate limit.

``anchor/<h>/<key>`` where ``<h>`` is ``crc32c(key) % N`` in fixed-width hex and ``key`` is
relative to the anchor (a child store's keys include its prefix). Readers must open the same
anchor URL with the same N. Listings merge the N sorted listings back into one.
"""

from __future__ import annotations

import heapq
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from cloudckpt.checksum import crc32c

T = TypeVar("T")


class Spreader:
    """Maps anchor-relative keys to their hashed directory (``""`` when spreading is off)."""

    def __init__(self, n: int):
        self.n = n
        self.width = len(f"{n - 1:x}") if n > 1 else 1

    def __bool__(self) -> bool:
        return self.n > 0

    def dir_for(self, rel_key: str) -> str:
        if not self.n:
            return ""
        return f"{crc32c(rel_key.encode('utf-8')) % self.n:0{self.width}x}/"

    def all_dirs(self) -> list[str]:
        if not self.n:
            return [""]
        return [f"{i:0{self.width}x}/" for i in range(self.n)]


async def merge_sorted(
    iterators: Sequence[AsyncIterator[T]], sort_key: Callable[[T], str]
) -> AsyncIterator[T]:
    """Merge already-sorted async iterators into one sorted stream, dropping exact duplicates
    that arrive back to back (the same common prefix listed under several hashed dirs)."""
    heap: list[tuple[str, int, T]] = []
    for idx, it in enumerate(iterators):
        item = await anext_or_none(it)
        if item is not None:
            heap.append((sort_key(item), idx, item))
    heapq.heapify(heap)
    last: T | None = None
    while heap:
        _, idx, item = heapq.heappop(heap)
        if item != last:
            yield item
            last = item
        nxt = await anext_or_none(iterators[idx])
        if nxt is not None:
            heapq.heappush(heap, (sort_key(nxt), idx, nxt))


async def anext_or_none(it: AsyncIterator[T]) -> T | None:
    try:
        return await it.__anext__()
    except StopAsyncIteration:
        return None
