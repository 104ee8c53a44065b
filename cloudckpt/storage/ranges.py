"""Planning of ranged reads: coalescing close ranges of one object into spans, splitting large
spans into pieces fetched concurrently, scattering a piece's byte stream into destination views,
and crc32c verification of what landed.

Pure (no I/O): shared by every backend.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from cloudckpt.checksum import Buffer, crc32c
from cloudckpt.errors import ChecksumError

if TYPE_CHECKING:
    from cloudckpt.storage.base import ReadRange

#: crc32c of buffers at least this large runs in a worker thread (the library releases the GIL).
_THREAD_CRC_BYTES = 4 * 1024 * 1024


@dataclass
class Piece:
    """One request: bytes ``[start, end)`` of the object, feeding the ``members`` ranges
    (indexes into the caller's range list, sorted by offset) where they intersect it."""

    start: int
    end: int
    members: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


def plan_pieces(
    offsets: Sequence[int], lengths: Sequence[int], *, gap: int, max_piece: int
) -> list[Piece]:
    """Group ranges into pieces: a range joins the current piece when it starts inside it or at
    most ``gap`` bytes after its end and the piece stays within ``max_piece`` bytes; a range
    longer than ``max_piece`` is cut into pieces of that size. Every byte of every range is in a
    piece that lists the range (a range starting before the current piece, inside an earlier
    cut of a long range, gets a piece of its own). Empty ranges get no piece."""
    order = sorted((i for i in range(len(offsets)) if lengths[i] > 0), key=lambda i: offsets[i])
    pieces: list[Piece] = []
    cur: Piece | None = None

    def joins(a: int, b: int) -> bool:
        return (
            cur is not None
            and cur.start <= a
            and a - cur.end <= gap
            and max(b, cur.end) - cur.start <= max_piece
        )

    for i in order:
        start, end = offsets[i], offsets[i] + lengths[i]
        for a in range(start, end, max_piece):
            b = min(a + max_piece, end)
            if cur is not None and joins(a, b):
                cur.end = max(cur.end, b)
                cur.members.append(i)
            else:
                cur = Piece(a, b, [i])
                pieces.append(cur)
    return pieces


class Scatter:
    """Copies a piece's byte stream into the destination views of the ranges it covers.

    ``feed(chunk, pos)`` takes bytes at absolute object position ``pos``; gap bytes are dropped.
    ``members``: ``(start, end, out)`` of each range the piece covers, by start (for a reader
    that writes bytes in place instead of feeding chunks).
    """

    def __init__(
        self,
        piece: Piece,
        offsets: Sequence[int],
        lengths: Sequence[int],
        outs: Sequence[memoryview | HeldRange],
    ):
        self._members = [(offsets[i], offsets[i] + lengths[i], outs[i]) for i in piece.members]
        self._first = 0

    @property
    def members(self) -> list[tuple[int, int, memoryview | HeldRange]]:
        return self._members

    def feed(self, chunk: Buffer, pos: int) -> None:
        members = self._members
        src = chunk if isinstance(chunk, memoryview) else memoryview(chunk)
        end = pos + len(src)
        i = self._first
        while i < len(members) and members[i][1] <= pos:
            i += 1
        self._first = i
        while i < len(members):
            off, stop, out = members[i]
            if off >= end:
                break
            a = max(off, pos)
            b = min(stop, end)
            if a < b:
                out[a - off : b - off] = src[a - pos : b - pos]
            i += 1


class HeldRange:
    """A range delivered to sinks: collects its bytes as they arrive (references to the received
    chunks, no copy); once all ``length`` bytes are there, checks their crc32c and copies the
    verified bytes into the sinks, in the thread that delivers the last byte (on the event loop
    this costs less than a hand-off to a worker thread: measured).

    Used as the ``out`` of a :class:`Scatter` member (slice assignment) or fed directly with
    :meth:`add`; a reader that writes bytes in place (``s3_rangeget``) asks for a
    :meth:`landing` view of a buffer the range owns and reports them with :meth:`landed`.
    Thread-safe. ``ok`` is None until complete, then whether the crc matched; ``actual`` is the
    crc found.
    """

    def __init__(self, rng: ReadRange):
        self.range = rng
        self.ok: bool | None = None
        self.actual: int | None = None
        self._parts: list[tuple[int, memoryview]] = []
        self._got = 0
        self._lock = threading.Lock()
        self._buf: bytearray | None = None
        self._pool: LandingPool | None = None
        self._run = (0, 0)  # landed bytes [start, end) of the own buffer not yet in _parts
        if rng.length == 0:
            self._finish()

    def __setitem__(self, where: slice, src: Buffer) -> None:
        self.add(where.start or 0, src)

    def add(self, pos: int, src: Buffer) -> None:
        """Bytes ``src`` at ``pos`` inside the range (``src`` unchanged until complete)."""
        view = src if isinstance(src, memoryview) else memoryview(src)
        with self._lock:
            self._parts.append((pos, view))
            self._got += len(view)
            complete = self._got >= self.range.length
        if complete:
            self._finish()

    def landing(self, pos: int, n: int, pool: LandingPool | None = None) -> memoryview:
        """A writable view of bytes ``[pos, pos + n)`` of the range in a buffer the range owns
        (of the range's length, taken from ``pool`` on first use): write them there, then call
        :meth:`landed`. The buffer goes back to the pool once the range is verified (or failed)."""
        with self._lock:
            if self._buf is None:
                self._pool = pool
                self._buf = (
                    pool.take(self.range.length)
                    if pool is not None
                    else bytearray(self.range.length)
                )
            return memoryview(self._buf)[pos : pos + n]

    def landed(self, pos: int, n: int) -> None:
        """Bytes ``[pos, pos + n)`` are in the :meth:`landing` buffer (each byte reported once);
        the range completes (crc, then the sinks) with its last byte."""
        with self._lock:
            start, end = self._run
            if pos != end or start == end:  # a new run of landed bytes
                if start != end and self._buf is not None:
                    self._parts.append((start, memoryview(self._buf)[start:end]))
                start = pos
            self._run = (start, pos + n)
            self._got += n
            complete = self._got >= self.range.length
        if complete:
            self._finish()

    def _finish(self) -> None:
        start, end = self._run
        if start != end and self._buf is not None:
            self._parts.append((start, memoryview(self._buf)[start:end]))
            self._run = (0, 0)
        parts = sorted(self._parts, key=lambda p: p[0])
        crc = 0
        for _, view in parts:
            crc = crc32c(view, crc)
        self.actual = crc
        self.ok = crc == (self.range.crc32c or 0) & 0xFFFFFFFF
        if self.ok:
            for pos, sink in self.range.sinks:
                _copy_parts(parts, pos, sink)
        self._parts = []
        del parts
        buf, self._buf = self._buf, None
        if buf is not None and self._pool is not None:
            self._pool.give(buf)


class LandingPool:
    """Buffers for :meth:`HeldRange.landing`, reused from range to range: fresh memory costs a
    page fault per 4 KiB on first write (as much CPU as copying it, measured). Keeps at most
    ``max_idle`` idle buffers; :meth:`clear` drops them. Thread-safe."""

    def __init__(self, max_idle: int):
        self.max_idle = max_idle
        self._idle: dict[int, list[bytearray]] = {}
        self._count = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bytearray:
        with self._lock:
            free = self._idle.get(n)
            if free:
                self._count -= 1
                return free.pop()
        return bytearray(n)

    def give(self, buf: bytearray) -> None:
        with self._lock:
            if self._count < self.max_idle:
                self._idle.setdefault(len(buf), []).append(buf)
                self._count += 1

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for bufs in self._idle.values() for b in bufs)

    def clear(self) -> None:
        with self._lock:
            self._idle.clear()
            self._count = 0


def _copy_parts(parts: list[tuple[int, memoryview]], pos: int, sink: memoryview) -> None:
    """Copy bytes ``[pos, pos + len(sink))`` of the range held as ``parts`` into ``sink`` (numpy
    copies release the GIL)."""
    end = pos + len(sink)
    dst = np.frombuffer(sink, dtype=np.uint8)
    for at, view in parts:
        lo, hi = max(at, pos), min(at + len(view), end)
        if lo < hi:
            dst[lo - pos : hi - pos] = np.frombuffer(
                view, dtype=np.uint8, count=hi - lo, offset=lo - at
            )


async def crc_of(view: memoryview) -> int:
    """crc32c of ``view``; large buffers are hashed off the event loop."""
    if len(view) >= _THREAD_CRC_BYTES:
        return await asyncio.to_thread(crc32c, view)
    return crc32c(view)


async def bad_crc_ranges(
    offsets: Sequence[int], crcs: Sequence[int | None], views: Sequence[memoryview]
) -> list[int]:
    """Indexes of the ranges whose expected crc32c (when given) does not match their view."""
    bad = []
    for i, expected in enumerate(crcs):
        if expected is not None and await crc_of(views[i]) != (expected & 0xFFFFFFFF):
            bad.append(i)
    return bad


def checksum_error(
    url: str, key: str, offset: int, length: int, expected: int | None, actual: int | None
) -> ChecksumError:
    """The ``ChecksumError`` for one failed range (names the object and byte range).
    ``actual`` None: the range never completed (its read delivered fewer bytes than asked)."""
    want = "none" if expected is None else f"{expected & 0xFFFFFFFF:08x}"
    got = "an incomplete range" if actual is None else f"{actual & 0xFFFFFFFF:08x}"
    return ChecksumError(
        f"crc32c mismatch in {str(url).rstrip('/')}/{key} bytes [{offset}, {offset + length}): "
        f"expected {want}, got {got}",
        key=key,
        offset=offset,
        length=length,
    )
