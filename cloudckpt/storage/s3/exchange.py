"""One ranged GET's exchange on a kept-alive HTTP/1.1 connection, for the direct reader
(``s3_rangeget.RangeGetter``, whose docstring holds the contract): :class:`Connection`, the
asyncio protocol, hands the socket's bytes to the :class:`Exchange` in flight, which reads the
answer's head into a small buffer, checks it (``s3_answers``) and gives ``recv_into`` the very
views the body lands in (``out`` views, ``HeldRange`` landing buffers, scratch for the bytes
between coalesced ranges). Bytes nobody asked for make the connection unusable.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Sequence
from typing import TypeAlias

from botocore.exceptions import ClientError

from cloudckpt.http_numbers import http_int
from cloudckpt.storage.base import StoreStats
from cloudckpt.storage.ranges import HeldRange, LandingPool
from cloudckpt.storage.s3.answers import BadAnswer, check_answer
from cloudckpt.storage.s3.errors import RETRIABLE_STATUS, TruncatedBody
from cloudckpt.storage.s3.shapes import ServiceModel

_HEAD_START = 16 * 1024
_HEAD_MAX = 64 * 1024
_ERROR_BODY_MAX = 64 * 1024

Target: TypeAlias = "memoryview | HeldRange"
#: ``(a, b, kind, target, target offset, copies)``: see :meth:`Exchange._plan`
Segment: TypeAlias = "tuple[int, int, str, Target | None, int, tuple[tuple[int, Target], ...]]"


class UseBotocore(Exception):
    """The answer is not one this reader reads: send the request through aiobotocore.
    ``kind`` names the kind of answer (``HTTP 403``, ``a chunked body``...) for the log."""

    def __init__(self, status: int, kind: str = ""):
        self.kind = kind or f"HTTP {status}"
        super().__init__(self.kind)
        self.status = status


class Cursor:
    """Where a ranged GET's delivery stands (absolute object position)."""

    __slots__ = ("pos",)

    def __init__(self, pos: int):
        self.pos = pos


class Connection(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection, one exchange at a time."""

    transport: asyncio.WriteTransport  #: set by connection_made, before any other call

    def __init__(self) -> None:
        self.exchange: Exchange | None = None
        self.broken = False
        self.used = False
        self._spare = bytearray(4096)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if not isinstance(transport, asyncio.WriteTransport):  # a stream connection's always is
            raise TypeError(f"not a stream transport: {transport!r}")
        self.transport = transport
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def get_buffer(self, sizehint: int) -> memoryview:
        ex = self.exchange
        view = None
        if ex is not None and not ex.future.done():
            try:
                view = ex.buffer()
            except BaseException as exc:  # never let asyncio log a "fatal error"
                ex.fail(exc)
                self.transport.abort()
        if view is None or not len(view):
            self.broken = True  # bytes nobody asked for: the connection is unusable
            return memoryview(self._spare)
        return view

    def buffer_updated(self, nbytes: int) -> None:
        ex = self.exchange
        if ex is None or ex.future.done():
            self.broken = True
            self.transport.abort()
            return
        try:
            ex.updated(nbytes)
        except BaseException as exc:  # never let asyncio log a "fatal error": fail the exchange
            self.broken = True
            ex.fail(exc)
            self.transport.abort()

    def eof_received(self) -> bool:
        self.broken = True
        if self.exchange is not None:
            self.exchange.fail(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.broken = True
        if self.exchange is not None:
            self.exchange.fail(exc)


class Exchange:
    """One request's answer: the head into a small buffer, the body where it goes."""

    def __init__(
        self,
        future: asyncio.Future[None],
        cursor: Cursor,
        end: int,
        members: Sequence[tuple[int, int, Target]],
        pool: LandingPool,
        scratch: memoryview,
        stats: StoreStats,
        service_model: ServiceModel,
        where: str = "",
    ):
        self.future = future
        self.where = where
        self.service_model = service_model
        self.cursor = cursor
        self.start = cursor.pos
        self.end = end
        self.members = members
        self.pool = pool
        self.scratch = scratch
        self.stats = stats
        self.head = bytearray(_HEAD_START)
        self.hlen = 0
        self.status = 0
        self.headers: dict[str, str] = {}
        self.error_body: bytearray | None = None
        self.error_need = 0
        self.segments: list[Segment] = []
        self.seg = 0
        self.at = 0
        self.view: memoryview | None = None
        self.reusable = False
        self.answered = False  # any byte of the answer arrived
        self.progress_at = time.monotonic()

    # -- the protocol's side ---------------------------------------------------------------------

    def buffer(self) -> memoryview:
        if self.error_body is not None:
            return memoryview(self.error_body)[len(self.error_body) - self.error_need :]
        if not self.segments:
            if self.hlen == len(self.head):
                if len(self.head) >= _HEAD_MAX:
                    raise UseBotocore(0, "a head over 64 KiB")  # not one we read
                self.head.extend(bytes(len(self.head)))
            return memoryview(self.head)[self.hlen :]
        a, b, kind, target, off, _ = self.segments[self.seg]
        at = self.at
        if isinstance(target, HeldRange):  # kind "h"
            view = target.landing(at - off, b - at, self.pool)
        elif target is not None:  # kind "o"
            view = target[at - off : b - off]
        else:
            view = self.scratch[: min(len(self.scratch), b - at)]
        self.view = view
        return view

    def updated(self, n: int) -> None:
        self.answered = True
        self.progress_at = time.monotonic()
        if self.error_body is not None:
            self.error_need -= n
            if self.error_need <= 0:
                self._finish_error()
        elif self.segments:
            self._delivered(n)
        else:
            self.hlen += n
            end = self.head.find(b"\r\n\r\n", max(0, self.hlen - n - 3), self.hlen)
            if end >= 0:
                self._answer(end)

    def fail(self, exc: BaseException | None) -> None:
        if self.future.done():
            return
        if isinstance(exc, UseBotocore | ClientError | BadAnswer):
            self.future.set_exception(exc)
        elif exc is None or isinstance(exc, (ConnectionError, OSError)):
            self.future.set_exception(
                TruncatedBody(
                    f"GET {self.where or 'bytes'} [{self.start}, {self.end}): the connection "
                    + (
                        f"ended at byte {self.cursor.pos}"
                        if self.answered
                        else "closed before an answer"
                    )
                )
            )
        else:
            self.future.set_exception(exc)

    # -- the answer ------------------------------------------------------------------------------

    def _answer(self, end: int) -> None:
        lines = bytes(self.head[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status = http_int(rest[:3]) if rest[3:4] in ("", " ") else None
        if not version.startswith("HTTP/1.") or status is None:
            raise BadAnswer(
                f"GET {self.where}: asked bytes [{self.start}, {self.end}); the "
                f"answer's status line {lines[0][:40]!r} is not HTTP/1.x's"
            )
        self.status = status
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            self.headers[name] = (
                f"{self.headers[name]}, {value.strip()}" if name in self.headers else value.strip()
            )
        spill = memoryview(self.head)[end + 4 : self.hlen]
        h = self.headers
        keep = version == "HTTP/1.1" and "close" not in h.get("connection", "").lower()
        body = self.status in (200, 206)  # else an error, whose kind is its status
        if "content-length" not in h or "transfer-encoding" in h:  # its end is unknown
            raise UseBotocore(self.status, "a chunked body" if body else "")
        if h.get("content-encoding", "identity").lower() not in ("", "identity"):
            raise UseBotocore(self.status, "an encoded body" if body else "")
        length = http_int(h["content-length"])
        if length is None:
            raise BadAnswer(
                f"GET {self.where}: asked bytes [{self.start}, {self.end}); the "
                f"answer's Content-Length {h['content-length'][:40]!r} is not a "
                "number"
            )
        if self.status not in (200, 206):
            if length > _ERROR_BODY_MAX:  # not an S3 error document: leave the body unread
                if self.status in RETRIABLE_STATUS:
                    raise self._error(b"")
                raise UseBotocore(self.status)
            self.reusable = keep
            self.error_body = bytearray(length)
            self.error_need = length
            self._take(spill)
            if self.error_need <= 0 and not self.future.done():
                self._finish_error()
            return
        # exactly the bytes asked, or a retriable BadAnswer (InvalidRange: past the end)
        check_answer(
            self.status, h.get("content-range"), length, self.start, self.end, where=self.where
        )
        self.reusable = keep
        self.at = self.start
        self.segments = self._plan()
        self._take(spill)

    def _take(self, spill: memoryview) -> None:
        """Bytes of the answer that arrived with its head: as if received into the buffer."""
        while len(spill) and not self.future.done():
            view = self.buffer()
            n = min(len(view), len(spill))
            if not n:
                break
            view[:n] = spill[:n]
            spill = spill[n:]
            self.updated(n)
        if len(spill):
            self.reusable = False  # bytes past the answer: not a connection to reuse

    def _error(self, body: bytes) -> ClientError:
        """The ``ClientError`` botocore would raise for this answer."""
        from botocore.parsers import create_parser

        shape = self.service_model.operation_model("GetObject").output_shape
        parsed = create_parser("rest-xml").parse(
            {"status_code": self.status, "headers": dict(self.headers), "body": body}, shape
        )
        return ClientError(parsed, "GetObject")

    def _finish_error(self) -> None:
        body = bytes(self.error_body or b"")
        if self.status in RETRIABLE_STATUS:
            self.future.set_exception(self._error(body))
        else:
            self.future.set_exception(UseBotocore(self.status))

    # -- the body --------------------------------------------------------------------------------

    def _plan(self) -> list[Segment]:
        """Segments ``(a, b, kind, target, target offset, copies)`` of ``[start, end)``: kind
        ``o`` lands in an ``out`` view, ``h`` in a HeldRange's buffer, ``s`` in scratch (not
        needed). ``copies``: other ranges covering the segment, filled from what landed."""
        start, end = self.start, self.end
        members = self.members
        cuts = {start, end}
        for off, stop, _ in members:
            cuts.update(x for x in (off, stop) if start < x < end)
        bounds = sorted(cuts)
        # a sweep over the cuts (members sorted by their start), not a scan of every member
        # for every segment: a GET coalesces hundreds of ranges. A member covers [a, b) when
        # it starts at or before a and ends after a (its end is a cut, or at or past ``end``)
        by_start = sorted(range(len(members)), key=lambda i: members[i][0])
        active: list[int] = []
        nxt = 0
        segments: list[Segment] = []
        for a, b in zip(bounds, bounds[1:]):
            while nxt < len(by_start) and members[by_start[nxt]][0] <= a:
                active.append(by_start[nxt])
                nxt += 1
            active = [i for i in active if members[i][1] > a]
            cover = [(members[i][0], members[i][2]) for i in sorted(active)]  # members' order
            cover.sort(key=lambda c: isinstance(c[1], HeldRange))  # an out view first
            if not cover:
                segments.append((a, b, "s", None, a, ()))
                continue
            off, target = cover[0]
            kind = "h" if isinstance(target, HeldRange) else "o"
            segments.append((a, b, kind, target, off, tuple(cover[1:])))
        return segments

    def _delivered(self, n: int) -> None:
        a, b, kind, target, off, copies = self.segments[self.seg]
        at = self.at
        landed = self.view
        for c_off, c_target in copies:  # before the landed range may complete and recycle
            src = landed[:n] if landed is not None else memoryview(b"")
            if isinstance(c_target, HeldRange):
                c_target.landing(at - c_off, n, self.pool)[:] = src
                c_target.landed(at - c_off, n)
            else:
                c_target[at - c_off : at - c_off + n] = src
        if isinstance(target, HeldRange):  # kind "h"
            target.landed(at - off, n)
        self.at = at = at + n
        self.stats.bytes_received += n
        if at > self.cursor.pos:
            self.cursor.pos = at
        if at >= b:
            self.seg += 1
            if at >= self.end:
                self.future.set_result(None)
