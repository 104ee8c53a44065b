"""``TieredStore``: each object read from the nearest of the stores that hold it, and from the
next one when that fails.

Holders are given per key, nearest first (this node's tier, the peers holding a replica, the
object store). A read (``read_ranges``, ``head``, ``get``) tries them in order; a holder that
fails (its bytes fail their crc32c twice: ``ChecksumError``; the object is missing; the peer
does not answer) is logged at WARNING with the key and the holder, counted in
``TierCounters``, and the next one is tried. Bytes of a failed read never reach the caller: a
range with sinks writes them only from a read that verified, and a range with ``out`` is
written again by the next holder. The last holder's error is raised when every holder failed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from cloudckpt.errors import ObjectNotFound, StorageError
from cloudckpt.storage.base import ObjectInfo, ReadRange, StoreStats

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class TierCounters:
    """What a tiered read did: ``reads`` per holder name, ``failures`` (a holder failed and the
    next one was tried; ``failed``: each ``"<holder>:<key>"``), ``healed`` (a later holder then
    served it), ``lost`` (none could)."""

    reads: dict[str, int] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)
    failures: int = 0
    healed: int = 0
    lost: int = 0


COUNTERS = TierCounters()  #: this process's totals (benchmarks and tests read them)


@dataclass(frozen=True)
class Holder:
    """A store holding objects, with the name logs and counters use ("local", "peer 2", "s3");
    ``sizes``: the size of each object it holds as its inventory says (untrusted like its
    bytes; ``None``: not said, a HEAD asks)."""

    name: str
    store: Any  # an ObjectStore, or the read subset of one (a PeerStore)
    sizes: Mapping[str, int] | None = None


class TieredStore:
    """Reads of one checkpoint's objects from their holders (see the module docstring)."""

    remote = False  #: every rank reads its own regions from its nearest holder
    local_root = None

    def __init__(
        self, url: str, holders: Mapping[str, Sequence[Holder]], default: Sequence[Holder] = ()
    ):
        self.url = url
        self.stats = StoreStats()
        self._holders = {k: tuple(v) for k, v in holders.items()}
        self._default: tuple[Holder, ...] = tuple(default)

    def holders(self, key: str) -> tuple[Holder, ...]:
        return self._holders.get(key, self._default)

    async def _each(self, key: str, op: Callable[[Any], Awaitable[T]]) -> T:
        last: Exception | None = None
        failed = False
        for holder in self.holders(key):
            try:
                result = await op(holder.store)
            except (StorageError, OSError, ValueError) as exc:  # IntegrityError is a ValueError
                failed = True
                COUNTERS.failures += 1
                COUNTERS.failed.add(f"{holder.name}:{key}")
                log.warning(
                    "cloudckpt: %s of %s failed (%s): reading it from the next tier",
                    key,
                    holder.name,
                    f"{type(exc).__name__}: {exc}"[:300],
                )
                last = exc
                continue
            COUNTERS.reads[holder.name] = COUNTERS.reads.get(holder.name, 0) + 1
            if failed:
                COUNTERS.healed += 1
            return result
        if last is None:
            raise ObjectNotFound(f"{self.url}/{key}: no tier holds it", key=key)
        COUNTERS.lost += 1
        raise last

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        return await self._each(key, lambda store: store.read_ranges(key, ranges))

    async def head(self, key: str) -> ObjectInfo:
        return await self._each(key, lambda store: store.head(key))

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return await self._each(key, lambda store: store.get(key, max_bytes=max_bytes))
