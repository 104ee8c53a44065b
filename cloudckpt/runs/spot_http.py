"""One HTTP/1.1 exchange bounded in time and bytes, for the spot notice poller (stdlib only).

The instance metadata service is a plain local HTTP server, but whatever answers at its address
(a container's proxy, a broken or hostile stand-in) must never hold the poller up: urllib's
``timeout`` bounds each socket operation, not the request, so an answer dripped a byte at a
time never ends. :func:`exchange` gives every request one total deadline instead.

Contract of :func:`exchange`:

- ``Deadline(seconds, stopped)``: the request ends, with :class:`RequestFailed` kind
  ``"timed out"``, once ``seconds`` have passed since the deadline was made, whatever the
  endpoint does (name resolution included); it ends with :class:`Stopped` within
  ``STOP_SLICE_S`` of ``stopped`` being set.
- One request, ``Connection: close``, never a proxy, never a redirect followed. At most
  ``MAX_HEAD_BYTES`` of status lines and headers (1xx interim answers are skipped, within that
  budget) and ``max_body`` bytes of body are read; the body of an answer whose status is not
  200 is not read.
- Returns ``Answer(status, body, complete)``: ``complete`` is false when the body of a 200 was
  cut short (the deadline, a reset, the size limit); what arrived is in ``body``.
- Anything else raises :class:`RequestFailed` with a ``kind``: ``"unreachable"`` (resolution or
  connection failed), ``"timed out"``, ``"connection dropped"`` (closed or reset before the
  headers ended), ``"not HTTP"`` (an answer that does not parse, or too large a head),
  ``"TLS"`` (the handshake or the certificate).
"""

from __future__ import annotations

import errno
import ipaddress
import os
import re
import selectors
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass

from cloudckpt.http_numbers import http_int

__all__ = [
    "Answer",
    "Deadline",
    "RequestFailed",
    "Stopped",
    "exchange",
    "MAX_HEAD_BYTES",
    "STOP_SLICE_S",
]

MAX_HEAD_BYTES = 16384
STOP_SLICE_S = 0.05  # how often a request waiting on the network looks at ``stopped``
_STATUS_LINE = re.compile(rb"HTTP/1\.[01] ([0-9]{3})(?: [^\r\n]*)?")
_CHUNK_SIZE = re.compile(rb"[0-9A-Fa-f]{1,8}")


class RequestFailed(Exception):
    """The exchange gave no answer; ``kind`` names the failure for the poller's log."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class Stopped(Exception):
    """``stopped`` was set while the request waited."""


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    complete: bool


class Deadline:
    """``seconds`` from now, or until ``stopped`` (a ``threading.Event``) is set."""

    def __init__(self, seconds: float, stopped: threading.Event):
        self.seconds = seconds
        self.stopped = stopped
        self.end = time.monotonic() + seconds

    def next_wait(self, what: str) -> float:
        """How long the next wait may last (at most ``STOP_SLICE_S``); raises when it is over."""
        if self.stopped.is_set():
            raise Stopped()
        left = self.end - time.monotonic()
        if left <= 0:
            raise RequestFailed(
                "timed out", f"{what}: no complete answer within the {self.seconds:g} s deadline"
            )
        return min(left, STOP_SLICE_S)


def exchange(
    endpoint: str,
    method: str,
    path: str,
    headers: dict[str, str],
    *,
    deadline: Deadline,
    max_body: int,
) -> Answer:
    """Send one request to ``endpoint`` (``http(s)://host[:port]``) and read its answer."""
    parts = urllib.parse.urlsplit(endpoint)
    https = parts.scheme == "https"
    host, port = parts.hostname, parts.port or (443 if https else 80)
    what = f"{method} {endpoint}{path}"
    if not host:  # the poller checks its endpoint first: a caller's mistake
        raise ValueError(f"{what}: the endpoint names no host")
    sock = _connect(host, port, deadline, what)
    try:
        if https:
            sock = _tls(sock, host, deadline, what)
        netloc = f"[{host}]" if ":" in host else host
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {netloc}:{port}",
            "Connection: close",
            "Accept-Encoding: identity",
            "Content-Length: 0",
            *(f"{k}: {v}" for k, v in headers.items()),
        ]
        _send(sock, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"), deadline, what)
        return _read_answer(sock, deadline, what, max_body)
    finally:
        sock.close()


# -- the steps of one exchange ---------------------------------------------------------------------


def _wait(sock, events: int, deadline: Deadline, what: str) -> None:
    with selectors.DefaultSelector() as selector:  # not select(): fds past 1024 are common
        selector.register(sock, events)
        while not selector.select(deadline.next_wait(what)):
            pass


def _resolve(host: str, port: int, deadline: Deadline, what: str) -> list:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    found: list = []  # getaddrinfo has no timeout: it runs in a daemon thread we may abandon
    done = threading.Event()

    def look_up():
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)
        finally:
            done.set()

    threading.Thread(target=look_up, name="cloudckpt-spot-resolve", daemon=True).start()
    while not done.wait(deadline.next_wait(what)):
        pass
    if isinstance(found[0], OSError):
        raise RequestFailed("unreachable", f"{what}: cannot resolve {host!r}: {found[0]}")
    return found[0]


def _connect(host: str, port: int, deadline: Deadline, what: str) -> socket.socket:
    failure: OSError | None = None
    for family, kind, proto, _, address in _resolve(host, port, deadline, what):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                _wait(sock, selectors.EVENT_WRITE, deadline, what)
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if code == 0:
                return sock
            failure = OSError(code, os.strerror(code))
        except BaseException:
            sock.close()
            raise
        sock.close()
    raise RequestFailed("unreachable", f"{what}: {failure}")


def _tls(sock: socket.socket, host: str, deadline: Deadline, what: str) -> ssl.SSLSocket:
    tls = ssl.create_default_context().wrap_socket(
        sock, server_hostname=host, do_handshake_on_connect=False
    )
    while True:
        try:
            tls.do_handshake()
            return tls
        except ssl.SSLWantReadError:
            _wait(tls, selectors.EVENT_READ, deadline, what)
        except ssl.SSLWantWriteError:
            _wait(tls, selectors.EVENT_WRITE, deadline, what)
        except (ssl.SSLError, ssl.CertificateError) as exc:
            tls.close()
            raise RequestFailed("TLS", f"{what}: {exc}") from exc
        except OSError as exc:
            tls.close()
            raise RequestFailed("connection dropped", f"{what}: {exc}") from exc


def _send(sock, data: bytes, deadline: Deadline, what: str) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view) :]
        except (BlockingIOError, ssl.SSLWantWriteError):
            _wait(sock, selectors.EVENT_WRITE, deadline, what)
        except ssl.SSLWantReadError:
            _wait(sock, selectors.EVENT_READ, deadline, what)
        except OSError as exc:
            raise RequestFailed("connection dropped", f"{what}: sending: {exc}") from exc


def _recv(sock, size: int, deadline: Deadline, what: str) -> bytes:
    """Up to ``size`` bytes, ``b""`` at the end; a reset raises ``ConnectionError``."""
    while True:
        try:
            return sock.recv(size)
        except (BlockingIOError, ssl.SSLWantReadError):
            _wait(sock, selectors.EVENT_READ, deadline, what)
        except ssl.SSLWantWriteError:
            _wait(sock, selectors.EVENT_WRITE, deadline, what)


def _read_answer(sock, deadline: Deadline, what: str, max_body: int) -> Answer:
    data, skipped = bytearray(), 0
    while True:  # the head: status line and headers, past any 1xx interim answer
        end = data.find(b"\r\n\r\n")
        if end < 0 or skipped + end > MAX_HEAD_BYTES:
            if skipped + len(data) > MAX_HEAD_BYTES:
                raise RequestFailed(
                    "not HTTP", f"{what}: no end of headers in {MAX_HEAD_BYTES} bytes"
                )
            try:
                chunk = _recv(sock, 4096, deadline, what)
            except OSError as exc:
                raise RequestFailed("connection dropped", f"{what}: {exc}") from exc
            if not chunk:
                raise RequestFailed(
                    "connection dropped", f"{what}: the connection closed before a complete answer"
                )
            data += chunk
            continue
        status, fields = _parse_head(bytes(data[:end]), what)
        del data[: end + 4]
        if 100 <= status < 200:
            skipped += end + 4
            continue
        break
    if status != 200:
        return Answer(status, b"", True)
    return _read_body(sock, data, fields, deadline, what, max_body)


def _parse_head(head: bytes, what: str) -> tuple[int, dict[str, str]]:
    lines = head.split(b"\r\n")
    match = _STATUS_LINE.fullmatch(lines[0])
    if match is None:
        raise RequestFailed(
            "not HTTP",
            f"{what}: the answer does not start with an HTTP status line: {bytes(lines[0][:80])!r}",
        )
    fields: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, raw = line.partition(b":")
        if not colon or not name.strip() or name != name.strip():
            raise RequestFailed("not HTTP", f"{what}: a malformed header line: {line[:80]!r}")
        key, value = name.decode("latin-1").lower(), raw.strip().decode("latin-1")
        if key in fields and fields[key] != value:
            if key in ("content-length", "transfer-encoding"):
                raise RequestFailed("not HTTP", f"{what}: two different {key} headers")
            value = fields[key] + ", " + value
        fields[key] = value
    return int(match.group(1)), fields


def _read_body(
    sock, data: bytearray, fields: dict[str, str], deadline: Deadline, what: str, max_body: int
) -> Answer:
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    length = None
    if not chunked and "content-length" in fields:
        length = http_int(fields["content-length"])
        if length is None:
            raise RequestFailed(
                "not HTTP",
                f"{what}: Content-Length {fields['content-length'][:40]!r} is not a number",
            )
    # the raw bytes kept are bounded: the body limit plus the chunk framing's share of it
    raw_limit = (
        max_body + 1024 if chunked else min(max_body, length if length is not None else max_body)
    )
    while True:
        body, done = (
            _dechunk(data)
            if chunked
            else (bytes(data[:raw_limit]), length is not None and len(data) >= length)
        )
        if done or len(data) >= raw_limit:
            return Answer(200, body[:max_body], done and len(body) <= max_body)
        try:
            chunk = _recv(sock, min(65536, raw_limit - len(data)), deadline, what)
        except RequestFailed as exc:
            if exc.kind != "timed out":
                raise
            return Answer(200, body[:max_body], False)
        except OSError:
            return Answer(200, body[:max_body], False)
        if not chunk:
            return Answer(200, body[:max_body], not chunked and length is None)
        data += chunk


def _dechunk(raw: bytearray) -> tuple[bytes, bool]:
    """The body a chunked encoding carries so far, and whether its last chunk has arrived."""
    out, at = bytearray(), 0
    while True:
        eol = raw.find(b"\r\n", at)
        if eol < 0:
            return bytes(out), False
        size_text = bytes(raw[at:eol]).split(b";")[0].strip()
        if not _CHUNK_SIZE.fullmatch(size_text):
            return bytes(out), False  # framing garbage: what came before it is the body
        size = int(size_text, 16)
        if size == 0:
            return bytes(out), True
        start = eol + 2
        out += raw[start : start + size]
        if len(raw) < start + size + 2:
            return bytes(out), False
        at = start + size + 2
