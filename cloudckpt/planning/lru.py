"""A small thread-safe LRU mapping: the one bounded cache of planning.

Contract:
- :class:`LRUCache` holds at most ``maxsize`` entries; :meth:`LRUCache.put` of a new key beyond
  that evicts the least recently used one. :meth:`LRUCache.get` of a held key, and ``put`` of any
  key, make it the most recently used.
- Every method takes the cache's lock, so one cache can be shared between threads (an async
  save's background thread plans while the training thread does). A value is computed by the
  caller outside the lock: two threads missing the same key may both compute it, and the last
  ``put`` wins (callers cache pure functions of the key, so either value is right).
- ``hits`` and ``misses`` count :meth:`get` calls that found / did not find their key.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most ``maxsize`` ``key -> value`` entries, least recently used evicted first."""

    def __init__(self, maxsize: int):
        if type(maxsize) is not int or maxsize < 1:
            raise ValueError(f"maxsize must be an integer of at least 1, got {maxsize!r}")
        self.maxsize = maxsize
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or ``None`` if not held."""
        with self._lock:
            try:
                value = self._entries[key]
            except KeyError:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return value

    def put(self, key: K, value: V) -> None:
        """Hold ``key -> value`` as the most recently used entry, evicting beyond ``maxsize``."""
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.maxsize:
                self._entries.popitem(last=False)

    def snapshot(self) -> dict[K, V]:
        """A copy of the entries, least recently used first (recency unchanged)."""
        with self._lock:
            return dict(self._entries)

    def clear(self) -> None:
        """Drop every entry (the counters stay)."""
        with self._lock:
            self._entries.clear()

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
