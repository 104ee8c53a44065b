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
import ssl
import sys
import time
from collections.abc import Sequence
from urllib.parse import SplitResult, urlsplit

from botocore.exceptions import (
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)

from cloudckpt.storage.base import StoreStats
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.ranges import LandingPool
from cloudckpt.storage.s3.answers import bytes_waiting
from cloudckpt.storage.s3.aws_config import ssl_context
from cloudckpt.storage.s3.errors import TruncatedBody
from cloudckpt.storage.s3.exchange import Connection, Cursor, Exchange, Target
from cloudckpt.storage.s3.shapes import S3Client

#: Lifetime of a presigned URL: it is used at once; this only has to outlast clock skew.
URL_EXPIRES_S = 900
_SCRATCH = 256 * 1024
#: Idle landing buffers are dropped this long after the last ranged GET finished.
_IDLE_CLEAR_S = 2.0


class RangeGetter:
    """The direct ranged-GET reader of one S3 connection (module docstring)."""

    def __init__(self, options: StorageOptions, stats: StoreStats):
        self.options = options
        self.stats = stats
        self.disabled = False
        self.fetches = 0  #: requests sent by this reader (attempts, not counting re-sends)
        self.pool = LandingPool(options.concurrency)  # one range per request in flight
        self._scratch = memoryview(bytearray(_SCRATCH))
        self._idle: dict[tuple[str, str | None, int | None], list[Connection]] = {}
        self._idle_count = 0
        self._checked_client: S3Client | None = None
        self._usable = False
        self._ssl: ssl.SSLContext | None = None
        self._endpoint = ""
        self._inflight = 0
        self._clear_timer: asyncio.TimerHandle | None = None

    def disable(self) -> None:
        self.disabled = True

    async def usable(self, client: S3Client) -> bool:
        """Whether :meth:`fetch` may serve ``client``'s ranged GETs (module docstring)."""
        if self.disabled or not self.options.direct_range_reads:
            return False
        if client is not self._checked_client:
            self._checked_client, self._usable = client, False
            self._usable = await self._check(client)
        return self._usable

    async def _check(self, client: S3Client) -> bool:
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
        self._ssl = await asyncio.to_thread(ssl_context, getattr(session, "_verify"))  # noqa: B009 (a private attribute of aiohttp, read where it exists)
        return True

    async def fetch(
        self,
        client: S3Client,
        bucket: str,
        phys: str,
        cursor: Cursor,
        end: int,
        members: Sequence[tuple[int, int, Target]],
        read_timeout: float,
        connect_timeout: float,
        where: str = "",
    ) -> None:
        """GET bytes ``[cursor.pos, end)`` of ``phys`` into the Scatter ``members`` (module
        docstring); ``where`` names the object in messages."""
        self.fetches += 1
        url = await client.generate_presigned_url(
            "get_object", Params={"Bucket": bucket, "Key": phys}, ExpiresIn=URL_EXPIRES_S
        )
        parts = urlsplit(url)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        self._inflight += 1
        try:
            for fresh in (False, True):
                request = (
                    f"GET {target} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                    f"Range: bytes={cursor.pos}-{end - 1}\r\nAccept-Encoding: identity\r\n"
                    "User-Agent: cloudckpt\r\n\r\n"
                ).encode("ascii")
                conn = await self._connection(parts, fresh, connect_timeout)
                reused = conn.used
                conn.used = True
                ex = Exchange(
                    asyncio.get_running_loop().create_future(),
                    cursor,
                    end,
                    members,
                    self.pool,
                    self._scratch,
                    self.stats,
                    client.meta.service_model,
                    where,
                )
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

    async def _answer(self, ex: Exchange, read_timeout: float) -> None:
        """Wait for the exchange; ``read_timeout`` seconds without a byte is a stall."""
        while True:
            wait = ex.progress_at + read_timeout - time.monotonic()
            if wait <= 0:
                raise ReadTimeoutError(endpoint_url=self._endpoint)
            done, _ = await asyncio.wait((ex.future,), timeout=wait)
            if done:
                ex.future.result()  # raises the exchange's error
                return

    async def _connection(
        self, parts: SplitResult, fresh: bool, connect_timeout: float
    ) -> Connection:
        key = (parts.scheme, parts.hostname, parts.port)
        idle = self._idle.get(key)
        while idle and not fresh:
            conn = idle.pop()
            self._idle_count -= 1
            if not (conn.broken or conn.transport.is_closing() or bytes_waiting(conn.transport)):
                return conn  # (bytes waiting: sent after the last answer, never the next one)
            conn.transport.abort()
        host = parts.hostname
        if not host:  # never for a presigned URL
            raise EndpointConnectionError(endpoint_url=self._endpoint, error="no host in the URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        tls = self._ssl if parts.scheme == "https" else None
        loop = asyncio.get_running_loop()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    Connection,
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls is not None else None,
                ),
                connect_timeout,
            )
        except asyncio.TimeoutError:
            raise ConnectTimeoutError(endpoint_url=self._endpoint) from None
        except ssl.SSLError as exc:
            raise SSLError(endpoint_url=self._endpoint, error=exc) from exc
        except OSError as exc:
            raise EndpointConnectionError(endpoint_url=self._endpoint, error=exc) from exc
        return conn

    def _release(self, parts: SplitResult, conn: Connection, reusable: bool) -> None:
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
