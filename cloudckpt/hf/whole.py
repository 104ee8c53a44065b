"""Checking a safetensors file against the checksum its store holds of the whole object.

Safetensors files carry no checksum of their own. Where the store holds one of the whole object
(:meth:`~cloudckpt.storage.base.ObjectStore.whole_checksum`: S3's full-object CRC32C, or the MD5
ETag of a single-part upload), the coordinator reads it with the file's header
(:mod:`cloudckpt.hf.source`) and every rank's load reads through a :class:`VerifyingStore`,
which checks the file when that rank has read every byte of its data section (the header bytes
were read already: they are in the header bundle).

Contract (:class:`VerifyingStore`):

- Everything but ``read_ranges`` is the inner store's. ``read_ranges`` returns what the inner
  store returns; for a file with a checksum it first folds the bytes just read into that file's
  running checksum (``crc32c``: in any order, each range's crc combined in place,
  :func:`crc32c_combine`; ``md5``: in file order only). When the ranges read so far cover the
  whole data section, the file is checked, and a mismatch raises
  :class:`~cloudckpt.errors.ChecksumError` (``key``: the file) from the call that completed it,
  before its bytes reach the caller (the load then fails on every rank together; earlier bytes
  of the file may already be in their destinations, as for any failed load).
- Not checked, silently: a file of which this rank reads only part (a partial load, a file
  whose tensors several ranks read and broadcast), an MD5 file whose ranges come out of order,
  and a file read with overlapping ranges that start inside bytes already folded. Nothing is
  held per file but a few integers (crc) or a hash state (md5) and one entry per range read
  ahead of the first unread byte.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from cloudckpt.checksum import crc32c, crc32c_combine
from cloudckpt.errors import ChecksumError

#: Folding more bytes than this at once runs in a worker thread (keeps the event loop free).
_THREAD_BYTES = 4 << 20


class RunningMd5(Protocol):
    """A ``hashlib`` MD5 object, as :class:`ExpectedFile` uses it."""

    def copy(self) -> RunningMd5: ...
    def update(self, data: bytes | memoryview, /) -> None: ...
    def digest(self) -> bytes: ...


@dataclass(frozen=True)
class ExpectedFile:
    """What a file's bytes must hash to: ``kind`` / ``value`` as
    :class:`~cloudckpt.storage.base.WholeChecksum`; ``size`` the whole file's; ``head_size``
    the bytes before its data (length prefix and header, read already) and ``head_state``
    their running checksum (an int for crc32c, a ``hashlib`` MD5 object): :meth:`of` makes
    one from those bytes."""

    kind: str
    value: int | bytes
    size: int
    head_size: int
    head_state: int | RunningMd5

    @classmethod
    def of(cls, kind: str, value: int | bytes, size: int, head: bytes) -> ExpectedFile:
        state = crc32c(head) if kind == "crc32c" else hashlib.md5(head)
        return cls(kind=kind, value=value, size=size, head_size=len(head), head_state=state)


class _Running:
    """One file's running checksum: folded up to ``pos``; ``ahead`` holds ranges (crc only)
    read beyond it, by start: ``(end, crc)``."""

    def __init__(self, want: ExpectedFile):
        self.want = want
        self.pos = want.head_size
        state = want.head_state  # an int exactly for crc32c (:meth:`ExpectedFile.of`)
        self.md5 = None if isinstance(state, int) else state.copy()
        self.crc = state if isinstance(state, int) else 0
        self.ahead: dict[int, tuple[int, int]] = {}
        self.lock = asyncio.Lock()  # one fold at a time (a fold may run in a worker thread)

    def fold(self, pieces: list[tuple[int, memoryview]]) -> bool:
        """Fold ``pieces`` (offset, bytes); False when the file cannot be checked any more."""
        for offset, view in sorted(pieces, key=lambda p: p[0]):
            end = offset + len(view)
            if end <= self.pos or not len(view):
                continue  # read again: folded already
            if offset < self.pos:
                return False  # starts inside folded bytes
            if self.md5 is not None:
                if offset != self.pos:
                    return False
                self.md5.update(view)
                self.pos = end
            else:
                if offset in self.ahead and self.ahead[offset][0] != end:
                    return False
                self.ahead[offset] = (end, crc32c(view))
        while self.pos in self.ahead:
            end, crc = self.ahead.pop(self.pos)
            self.crc = crc32c_combine(self.crc, crc, end - self.pos)
            self.pos = end
        return True

    @property
    def complete(self) -> bool:
        return self.pos >= self.want.size

    def matches(self) -> bool:
        if self.md5 is not None:
            return self.md5.digest() == self.want.value
        return self.crc == self.want.value


class VerifyingStore:
    """The inner store, with safetensors files checked as they are read whole (module doc)."""

    def __init__(self, inner, expected: Mapping[str, ExpectedFile]):
        self._inner = inner
        self._running = {k: _Running(w) for k, w in expected.items() if w.size > w.head_size}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def read_ranges(self, key: str, ranges) -> list[memoryview]:
        views = await self._inner.read_ranges(key, ranges)
        running = self._running.get(key)
        if running is None:
            return views
        pieces = []
        for r, view in zip(ranges, views):
            if r.sinks:  # bytes verified by their own crc, not returned here
                self._running.pop(key, None)
                return views
            pieces.append((r.offset, view))
        size = sum(len(v) for _, v in pieces)
        async with running.lock:
            ok = (
                await asyncio.to_thread(running.fold, pieces)
                if size > _THREAD_BYTES
                else running.fold(pieces)
            )
        if key not in self._running:
            return views  # given up on, or checked, by a concurrent call
        if not ok:
            self._running.pop(key, None)
        elif running.complete:
            self._running.pop(key, None)
            if not running.matches():
                want = running.want
                what = "CRC32C" if want.kind == "crc32c" else "MD5 (its ETag)"
                raise ChecksumError(
                    f"{key}: the bytes read do not match the {what} the store holds of the "
                    f"whole file: the file changed or was damaged in transit; read it again, "
                    f"or re-upload it if this persists",
                    key=key,
                    offset=0,
                    length=want.size,
                )
        return views
