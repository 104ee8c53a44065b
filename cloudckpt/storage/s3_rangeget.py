"""Ranged GETs over cloudckpt's own HTTP/1.1 reader, which lands response bodies in place.

aiohttp hands a body out as ``bytes`` chunks of at most 256 KiB, each copied out of the socket
buffer by its parser, with flow-control and timer bookkeeping per chunk: on the 2-core box that
was about half of a load's client CPU (1 GiB in 32 MiB GETs from SeaweedFS, crc32c per 4 MiB
block, copied into destinations: 0.8-1.15 CPU s through aiohttp, 0.44-0.53 through this
reader; docs/decisions.md). Here ``recv_into`` writes the socket's bytes where they go: an
``out`` view as given, a range with sinks into the buffer the range owns
(``HeldRange.landing``: verified, then copied into the sinks), bytes between coalesced ranges
into a scratch buffer.

Contract (:class:`RangeGetter`):
- :meth:`RangeGetter.fetch` is one attempt of one ranged GET, run inside
  ``S3Connection.call`` (request slot, retries, attempt cap and deadline are the caller's). The
  request is a GetObject URL presigned by the store's aiobotocore client (endpoint rules,
  addressing style, region, credentials and session token exactly as botocore signs them; the
  signature covers the host, the ``Range`` header is unsigned, as S3 allows).
- Only an answer this reader fully understands is read here: 206 for exactly the bytes asked
  (200 where they are the whole object) with a Content-Length, without Transfer-Encoding or
  Content-Encoding (``s3_answers.check_answer``). A 429 or 5xx raises the botocore
  ``ClientError`` its body parses to (retried like any). A status line or Content-Length that
  is not HTTP's (ASCII digits), or an answer about other bytes than asked, raises
  ``s3_answers.BadAnswer`` (retried), past the object's end ``InvalidRange``. Anything else
  (403, 404, 416, a redirect, a chunked body...) raises :class:`UseBotocore`: the caller sends
  the request the usual way, whose answer is authoritative, and calls :meth:`disable` when that
  one succeeds (the server disagrees with presigned requests or frames bodies otherwise).
- Transport failures raise what ``s3_errors.classify`` retries: ``ConnectTimeoutError`` and
  ``ReadTimeoutError`` (stalls: no connection, or ``read_timeout`` seconds without a byte),
  ``EndpointConnectionError``, ``TruncatedBody``; an untrusted TLS certificate raises botocore's
  ``SSLError``. Messages name the endpoint, never the URL (it holds the signature and any
  session token); nothing here logs.
- ``cursor.pos`` is where delivery stopped: every byte before it reached its ranges, none after,
  so a retry resumes there. Cancelled or failed, the connection is aborted before ``fetch``
  returns: no byte lands afterwards.
- Connections are kept alive and reused (at most ``concurrency`` idle); a reused connection that
  the server closed meanwhile is replaced once, silently (as aiohttp does); one with bytes
  waiting (sent after its last answer) is dropped, never reused.
- :meth:`usable` says whether requests would reach the server as aiobotocore's do: http, or
  https on Python >= 3.11 (buffered reads over TLS) with the client's CA settings; no proxy, no
  client certificate. ``StorageOptions(direct_range_reads=False)`` turns the reader off.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import sys
import time
from urllib.parse import urlsplit

from botocore.exceptions import (
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)

from cloudckpt.storage.aws_config import ssl_context
from cloudckpt.storage.ranges import HeldRange, LandingPool
from cloudckpt.storage.s3_answers import BadAnswer, bytes_waiting, check_answer, http_int
from cloudckpt.storage.s3_errors import RETRIABLE_STATUS, TruncatedBody

#: Lifetime of a presigned URL: it is used at once; this only has to outlast clock skew.
URL_EXPIRES_S = 900
_HEAD_START = 16 * 1024
_HEAD_MAX = 64 * 1024
_ERROR_BODY_MAX = 64 * 1024
_SCRATCH = 256 * 1024
#: Idle landing buffers are dropped this long after the last ranged GET finished.
_IDLE_CLEAR_S = 2.0


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


class _Conn(asyncio.BufferedProtocol):
    """One keep-alive HTTP/1.1 connection, one exchange at a time."""

    def __init__(self):
        self.transport = None
        self.exchange: _Exchange | None = None
        self.broken = False
        self.used = False
        self._spare = bytearray(4096)

    def connection_made(self, transport) -> None:
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

    def connection_lost(self, exc) -> None:
        self.broken = True
        if self.exchange is not None:
            self.exchange.fail(exc)


class _Exchange:
    """One request's answer: the head into a small buffer, the body where it goes."""

    def __init__(self, future, cursor: Cursor, end: int, members, pool: LandingPool,
                 scratch: memoryview, stats, service_model, where: str = ""):
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
        self.segments: list = []
        self.seg = 0
        self.at = 0
        self.view: memoryview | None = None
        self.reusable = False
        self.answered = False  # any byte of the answer arrived
        self.progress_at = time.monotonic()

    # -- the protocol's side ---------------------------------------------------------------------

    def buffer(self) -> memoryview | None:
        if self.error_body is not None:
            return memoryview(self.error_body)[len(self.error_body) - self.error_need:]
        if not self.segments:
            if self.hlen == len(self.head):
                if len(self.head) >= _HEAD_MAX:
                    raise UseBotocore(0, "a head over 64 KiB")  # not one we read
                self.head.extend(bytes(len(self.head)))
            return memoryview(self.head)[self.hlen:]
        a, b, kind, target, off, _ = self.segments[self.seg]
        at = self.at
        if kind == "o":
            view = target[at - off:b - off]
        elif kind == "h":
            view = target.landing(at - off, b - at, self.pool)
        else:
            view = self.scratch[:min(len(self.scratch), b - at)]
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
            self.future.set_exception(TruncatedBody(
                f"GET {self.where or 'bytes'} [{self.start}, {self.end}): the connection "
                + (f"ended at byte {self.cursor.pos}" if self.answered
                   else "closed before an answer")))
        else:
            self.future.set_exception(exc)

    # -- the answer ------------------------------------------------------------------------------

    def _answer(self, end: int) -> None:
        lines = bytes(self.head[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        status = http_int(rest[:3]) if rest[3:4] in ("", " ") else None
        if not version.startswith("HTTP/1.") or status is None:
            raise BadAnswer(f"GET {self.where}: asked bytes [{self.start}, {self.end}); the "
                            f"answer's status line {lines[0][:40]!r} is not HTTP/1.x's")
        self.status = status
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            self.headers[name] = f"{self.headers[name]}, {value.strip()}" \
                if name in self.headers else value.strip()
        spill = memoryview(self.head)[end + 4:self.hlen]
        h = self.headers
        keep = version == "HTTP/1.1" and "close" not in h.get("connection", "").lower()
        body = self.status in (200, 206)  # else an error, whose kind is its status
        if "content-length" not in h or "transfer-encoding" in h:  # its end is unknown
            raise UseBotocore(self.status, "a chunked body" if body else "")
        if h.get("content-encoding", "identity").lower() not in ("", "identity"):
            raise UseBotocore(self.status, "an encoded body" if body else "")
        length = http_int(h["content-length"])
        if length is None:
            raise BadAnswer(f"GET {self.where}: asked bytes [{self.start}, {self.end}); the "
                            f"answer's Content-Length {h['content-length'][:40]!r} is not a "
                            "number")
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
        check_answer(self.status, h.get("content-range"), length, self.start, self.end,
                     where=self.where)
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
            {"status_code": self.status, "headers": dict(self.headers), "body": body}, shape)
        return ClientError(parsed, "GetObject")

    def _finish_error(self) -> None:
        body = bytes(self.error_body or b"")
        if self.status in RETRIABLE_STATUS:
            self.future.set_exception(self._error(body))
        else:
            self.future.set_exception(UseBotocore(self.status))

    # -- the body --------------------------------------------------------------------------------

    def _plan(self) -> list:
        """Segments ``(a, b, kind, target, target offset, copies)`` of ``[start, end)``: kind
        ``o`` lands in an ``out`` view, ``h`` in a HeldRange's buffer, ``s`` in scratch (not
        needed). ``copies``: other ranges covering the segment, filled from what landed."""
        start, end = self.start, self.end
        cuts = {start, end}
        for off, stop, _ in self.members:
            cuts.update(x for x in (off, stop) if start < x < end)
        bounds = sorted(cuts)
        segments = []
        for a, b in zip(bounds, bounds[1:]):
            cover = [(off, t) for off, stop, t in self.members if off <= a and b <= stop]
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
        for c_off, c_target in copies:  # before the landed range may complete and recycle
            src = self.view[:n]
            if isinstance(c_target, HeldRange):
                c_target.landing(at - c_off, n, self.pool)[:] = src
                c_target.landed(at - c_off, n)
            else:
                c_target[at - c_off:at - c_off + n] = src
        if kind == "h":
            target.landed(at - off, n)
        self.at = at = at + n
        self.stats.bytes_received += n
        if at > self.cursor.pos:
            self.cursor.pos = at
        if at >= b:
            self.seg += 1
            if at >= self.end:
                self.future.set_result(None)


class RangeGetter:
    """The direct ranged-GET reader of one S3 connection (module docstring)."""

    def __init__(self, options, stats):
        self.options = options
        self.stats = stats
        self.disabled = False
        self.fetches = 0  #: requests sent by this reader (attempts, not counting re-sends)
        self.pool = LandingPool(options.concurrency)  # one range per request in flight
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._idle: dict[tuple, list[_Conn]] = {}
        self._idle_count = 0
        self._checked_client = None
        self._usable = False
        self._ssl: ssl.SSLContext | None = None
        self._endpoint = ""
        self._inflight = 0
        self._clear_timer: asyncio.TimerHandle | None = None

    def disable(self) -> None:
        self.disabled = True

    async def usable(self, client) -> bool:
        """Whether :meth:`fetch` may serve ``client``'s ranged GETs (module docstring)."""
        if self.disabled or not self.options.direct_range_reads:
            return False
        if client is not self._checked_client:
            self._checked_client, self._usable = client, False
            self._usable = await self._check(client)
        return self._usable

    async def _check(self, client) -> bool:
        url = client.meta.endpoint_url
        scheme = urlsplit(url).scheme
        self._endpoint = url
        session = getattr(getattr(client, "_endpoint", None), "http_session", None)
        proxies = getattr(session, "_proxy_config", None)
        if session is None or proxies is None or getattr(session, "_cert_file", None):
            return False
        if proxies.proxy_url_for(url):
            return False
        if scheme == "http":
            return True
        if scheme != "https" or sys.version_info < (3, 11) or not hasattr(session, "_verify"):
            return False
        self._ssl = await asyncio.to_thread(ssl_context, getattr(session, "_verify"))
        return True

    async def fetch(self, client, bucket: str, phys: str, cursor: Cursor, end: int,
                    members, read_timeout: float, connect_timeout: float,
                    where: str = "") -> None:
        """GET bytes ``[cursor.pos, end)`` of ``phys`` into the Scatter ``members`` (module
        docstring); ``where`` names the object in messages."""
        self.fetches += 1
        url = await client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": phys}, ExpiresIn=URL_EXPIRES_S)
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._inflight += 1
        try:
            for fresh in (False, True):
                request = (f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                           f"Range: bytes={cursor.pos}-{end - 1}\r\nAccept-Encoding: identity\r\n"
                           "User-Agent: cloudckpt\r\n\r\n").encode("ascii")
                conn = await self._connection(parts, fresh, connect_timeout)
                reused = conn.used
                conn.used = True
                ex = _Exchange(asyncio.get_running_loop().create_future(), cursor, end, members,
                               self.pool, self._scratch, self.stats, client.meta.service_model,
                               where)
                conn.exchange = ex
                try:
                    conn.transport.write(request)
                    await self._answer(ex, read_timeout)
                except TruncatedBody:
                    conn.transport.abort()
                    if reused and not ex.answered and not fresh:
                        continue  # the server closed the idle connection: once more, anew
                    raise
                except BaseException:
                    conn.transport.abort()
                    raise
                finally:
                    conn.exchange = None
                self._release(parts, conn, ex.reusable and not conn.broken)
                return
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._schedule_clear()

    async def _answer(self, ex: _Exchange, read_timeout: float) -> None:
        """Wait for the exchange; ``read_timeout`` seconds without a byte is a stall."""
        while True:
            wait = ex.progress_at + read_timeout - time.monotonic()
            if wait <= 0:
                raise ReadTimeoutError(endpoint_url=self._endpoint)
            done, _ = await asyncio.wait((ex.future,), timeout=wait)
            if done:
                return ex.future.result()

    async def _connection(self, parts, fresh: bool, connect_timeout: float) -> _Conn:
        key = (parts.scheme, parts.hostname, parts.port)
        idle = self._idle.get(key)
        while idle and not fresh:
            conn = idle.pop()
            self._idle_count -= 1
            if not (conn.broken or conn.transport.is_closing() or bytes_waiting(conn.transport)):
                return conn  # (bytes waiting: sent after the last answer, never the next one)
            conn.transport.abort()
        port = parts.port or (443 if parts.scheme == "https" else 80)
        tls = self._ssl if parts.scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                _Conn, parts.hostname, port, ssl=tls,
                server_hostname=parts.hostname if tls is not None else None), connect_timeout)
        except asyncio.TimeoutError:
            raise ConnectTimeoutError(endpoint_url=self._endpoint) from None
        except ssl.SSLError as exc:
            raise SSLError(endpoint_url=self._endpoint, error=exc) from exc
        except OSError as exc:
            raise EndpointConnectionError(endpoint_url=self._endpoint, error=exc) from exc
        return conn

    def _release(self, parts, conn: _Conn, reusable: bool) -> None:
        # ``reusable``: the answer ended where its Content-Length said, nothing after it
        if not reusable or self._idle_count >= self.options.concurrency:
            conn.transport.close()
            return
        self._idle.setdefault((parts.scheme, parts.hostname, parts.port), []).append(conn)
        self._idle_count += 1

    def _schedule_clear(self) -> None:
        if self._clear_timer is not None:
            self._clear_timer.cancel()
        self._clear_timer = asyncio.get_running_loop().call_later(_IDLE_CLEAR_S, self._clear)

    def _clear(self) -> None:
        self._clear_timer = None
        if not self._inflight:
            self.pool.clear()

    def close(self) -> None:
        """Close every idle connection and drop the buffers."""
        if self._clear_timer is not None:
            self._clear_timer.cancel()
            self._clear_timer = None
        for conns in self._idle.values():
            for conn in conns:
                conn.transport.close()
        self._idle.clear()
        self._idle_count = 0
        self.pool.clear()
