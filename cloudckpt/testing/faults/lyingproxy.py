"""An HTTP proxy that labels bytes wrongly, for tests: in front of a real S3 endpoint (the local
SeaweedFS), on its own event loop in a background thread. Where ``faultproxy.FaultProxy`` breaks
transfers (resets, 5xx, cut bodies), this one answers ranged GETs with well-formed lies, written
byte by byte (aiohttp's server would refuse to send most of them):

- ``"shift"``: the bytes asked, labelled (Content-Range) as starting one byte later;
- ``"short"``: one byte less than asked, labelled consistently;
- ``"long"``: one byte more than asked (a zero byte), labelled consistently (with the true
  total size: at the object's end the label says more bytes than the object has);
- ``"whole"``: ``200 OK`` with the whole object (the request is sent again without its Range
  header, re-signed with ``credentials`` when it carried an Authorization header);
- ``"total"``: the bytes asked, with a total size that ends before them (``bytes a-b/b``);
- ``"length-digits"``: a Content-Length that starts with ``²`` (byte 0xB2: a Unicode digit in
  latin-1, which ``str.isdigit`` accepts and ``int`` refuses);
- ``"status-digits"``: the status ``²06``;
- ``"late"``: the true answer, then ``late_s`` seconds later, on the same kept-alive
  connection, a second complete answer for the same range with every byte inverted (bytes a
  server sends after its answer, which the next request on the connection must never take).

A lie applies to ranged GETs answered 206 upstream (other requests and answers pass through),
of paths containing ``only`` where it is set: ``lie`` on every such GET, ``schedule`` (a list of
lies or None) on the next ones first.
``counters``: ``requests`` (every request), ``lied`` (answers changed). Each client connection
gets its own upstream session; request bodies are read whole (tests send small ones).

Usage::

    with LyingProxy(info.endpoint_url, lie="shift") as proxy:
        store = open_store(url, StorageOptions(endpoint_url=proxy.endpoint_url, ...))
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Sequence
from typing import Literal

import aiohttp
from yarl import URL

from cloudckpt.testing.faults.faultproxy import LoopThreadServer, _resign

__all__ = ["LIES", "LyingProxy"]

LIES = ("shift", "short", "long", "whole", "total", "length-digits", "status-digits", "late")
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "transfer-encoding",
        "content-length",
        "te",
        "trailers",
        "upgrade",
        "expect",
        "proxy-authorization",
        "proxy-authenticate",
    }
)
_RANGE_RE = re.compile(rb"bytes ([0-9]+)-([0-9]+)/([0-9]+)")


class LyingProxy(LoopThreadServer):
    """See the module docstring. ``configure`` changes the plan at runtime."""

    _thread_name = "cloudckpt-lyingproxy"

    def __init__(
        self,
        upstream: str,
        *,
        lie: str | None = None,
        schedule: Sequence[str | None] = (),
        late_s: float = 0.05,
        credentials: tuple[str, str, str] | None = None,
    ):
        self.upstream = upstream.rstrip("/")
        self.credentials = credentials  # (access key, secret key, region), for "whole"
        self.late_s = late_s
        self._lock = threading.Lock()
        self._counters: dict[str, int] = {}
        self.configure(lie=lie, schedule=schedule, only=None)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.port: int | None = None

    def configure(
        self,
        *,
        lie: str | None | Literal[False] = False,
        schedule: Sequence[str | None] | None = None,
        only: str | None | Literal[False] = False,
    ) -> None:
        """``lie``: told on every ranged GET (None: none); ``schedule``: the next ones first;
        ``only``: lie only about paths containing it (None: any)."""
        with self._lock:
            if only is not False:
                self.only = only
            if lie is not False:
                if lie is not None and lie not in LIES:
                    raise ValueError(f"unknown lie {lie!r}")
                self.lie = lie
            if schedule is not None:
                bad = [x for x in schedule if x is not None and x not in LIES]
                if bad:
                    raise ValueError(f"unknown lies {bad}")
                self._schedule = list(schedule)

    @property
    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + 1

    def _pick(self) -> str | None:
        with self._lock:
            return self._schedule.pop(0) if self._schedule else self.lie

    # --- lifetime (LoopThreadServer: start, stop, endpoint_url) ----------------------------------

    async def _serve(self) -> None:
        self._server = await asyncio.start_server(
            self._serve_connection, "127.0.0.1", 0, limit=1 << 20
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shutdown(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):  # each connection's loop then ends by itself
            writer.transport.abort()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        if tasks:
            await asyncio.wait(tasks, timeout=5)

    # --- serving (proxy thread) -------------------------------------------------------------------

    async def _serve_connection(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        session = aiohttp.ClientSession(
            auto_decompress=False, trust_env=False, timeout=aiohttp.ClientTimeout(total=120)
        )
        late: list[asyncio.Task] = []
        self._writers.add(writer)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                    return
                lines = head[:-4].decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    name, _, value = line.partition(":")
                    headers[name.strip()] = value.strip()
                size = int(
                    next((v for k, v in headers.items() if k.lower() == "content-length"), "0")
                )
                body = await reader.readexactly(size) if size else b""
                self._count("requests")
                answer, extra = await self._answer(session, method, target, headers, body)
                writer.write(answer)
                await writer.drain()
                if extra is not None:
                    late.append(asyncio.ensure_future(self._later(writer, extra)))
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            for task in late:
                task.cancel()
            await session.close()
            writer.close()

    async def _later(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        await asyncio.sleep(self.late_s)
        if not writer.is_closing():
            writer.write(data)

    async def _fetch(
        self, session, method: str, target: str, headers: dict, body: bytes
    ) -> tuple[int, str, list, bytes]:
        send = {k: v for k, v in headers.items() if k.lower() not in _HOP}
        async with session.request(
            method,
            URL(self.upstream + target, encoded=True),
            headers=send,
            data=body or None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as up:
            data = await up.read()
            return up.status, up.reason or "", list(up.raw_headers), data

    async def _answer(
        self, session, method: str, target: str, headers: dict, body: bytes
    ) -> tuple[bytes, bytes | None]:
        """The bytes to send back, and those to send ``late_s`` later (or None)."""
        status, reason, raw, data = await self._fetch(session, method, target, headers, body)
        ranged = (
            method == "GET"
            and any(k.lower() == "range" for k in headers)
            and (self.only is None or self.only in target)
        )
        lie = self._pick() if ranged and status == 206 else None
        crange = next((v for k, v in raw if k.lower() == b"content-range"), b"")
        m = _RANGE_RE.fullmatch(crange)
        if lie is None or m is None:
            return _render(status, reason, raw, data, method), None
        self._count("lied")
        a, b, total = (int(x) for x in m.groups())
        keep = [(k, v) for k, v in raw if k.lower() != b"content-range"]
        length: bytes | None = None
        late = None
        status_text = b"%d" % status
        if lie == "shift":
            a, b = a + 1, b + 1
        elif lie == "short":
            b, data = b - 1, data[:-1]
        elif lie == "long":
            b, data = b + 1, data + b"\0"
        elif lie == "total":
            total = b
        elif lie == "length-digits":
            length = b"\xb2%d" % len(data)
        elif lie == "status-digits":
            status_text = b"\xb2" + status_text[1:]
        elif lie == "whole":
            again = {k: v for k, v in headers.items() if k.lower() != "range"}
            if any(k.lower() == "authorization" for k in headers):
                again = _resign(
                    "GET", f"http://{headers.get('Host', '')}{target}", again, self.credentials
                )
            status, reason, raw, data = await self._fetch(session, "GET", target, again, b"")
            return _render(status, reason, raw, data, method), None
        ranged_head = keep + [(b"Content-Range", b"bytes %d-%d/%d" % (a, b, total))]
        if lie == "late":
            late = _render(206, reason, ranged_head, bytes(x ^ 0xFF for x in data), method)
        return _render(status_text, reason, ranged_head, data, method, length=length), late


def _render(
    status, reason: str, raw: list, data: bytes, method: str, *, length: bytes | None = None
) -> bytes:
    """An HTTP/1.1 answer: status line, the headers but hop-by-hop ones, Content-Length."""
    status = status if isinstance(status, bytes) else b"%d" % status
    out = [b"HTTP/1.1 " + status + b" " + reason.encode("latin-1")]
    out += [k + b": " + v for k, v in raw if k.decode("latin-1").lower() not in _HOP]
    if method == "HEAD":  # the length of the body a GET would have
        length = next((v for k, v in raw if k.lower() == b"content-length"), b"0")
    out.append(b"Content-Length: " + (length if length is not None else b"%d" % len(data)))
    return b"\r\n".join(out) + b"\r\n\r\n" + (b"" if method == "HEAD" else data)
