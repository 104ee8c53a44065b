"""A bounded cache of each rank's shares of global save plans, keyed by every rank's plan
fingerprint.

Protocol (run by save.py): each rank reports ``local_plan.fingerprint()`` (16 bytes) together
with the digests of the plans it holds (:meth:`SavePlanCache.held`, its vote) in one exchange, so
every rank builds the same key with :func:`save_plan_cache_key`. A rank holds its own
:class:`~cloudckpt.planning.save.share.SaveShare` of each plan (the coordinator's with the
plan's skeleton). Caches of different ranks can differ (a rank restarted, or evicted the entry),
so a cached plan is reused only if every rank holds the key's :func:`key_digest`; otherwise the
coordinator plans again and sends every rank its share.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from cloudckpt.planning.lru import LRUCache
from cloudckpt.planning.save.share import SaveShare


def save_plan_cache_key(
    fingerprints: Sequence[bytes],
    *,
    replicas_to_lowest_rank: bool = False,
    rate_weights: Sequence[float] | None = None,
) -> tuple[bytes, ...]:
    """The cache key: the planning options (the replica rule, and the rate weights the plan
    spreads replicated bytes by: :func:`cloudckpt.planning.save.rates.replica_weights`) plus
    every rank's fingerprint, in rank order.

    Fingerprints cover names, dtypes, global shapes, boxes, value names, rank and world size.
    """
    rule = b"lowest" if replicas_to_lowest_rank else b"balanced"
    if rate_weights is not None and not replicas_to_lowest_rank:
        rule += b":" + struct.pack(f"<{len(rate_weights)}d", *rate_weights)
    return (rule, *(bytes(f) for f in fingerprints))


def key_digest(key: tuple[bytes, ...]) -> bytes:
    """16-byte hash of a cache key (cheap to exchange and compare between ranks)."""
    h = hashlib.blake2b(digest_size=16)
    for part in key:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


class SavePlanCache:
    """LRU of ``key -> SaveShare`` (this rank's share of the key's plan) holding at most
    ``maxsize`` plans; thread-safe.

    Entries are held by :func:`key_digest`; ``hits`` / ``misses`` count :meth:`get` calls."""

    def __init__(self, maxsize: int = 8):
        if maxsize < 1:
            raise ValueError("maxsize must be at least 1")
        self.maxsize = maxsize
        self._plans: LRUCache[bytes, SaveShare] = LRUCache(maxsize)

    @property
    def hits(self) -> int:
        return self._plans.hits

    @property
    def misses(self) -> int:
        return self._plans.misses

    def get(self, key: tuple[bytes, ...]) -> SaveShare | None:
        return self._plans.get(key_digest(key))

    def held(self) -> dict[bytes, SaveShare]:
        """A snapshot of the cached plans by key digest (what this rank can reuse)."""
        return self._plans.snapshot()

    def put(self, key: tuple[bytes, ...], plan: SaveShare) -> None:
        self._plans.put(key_digest(key), plan)

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)
