"""A stand-in for the EC2 instance metadata service (IMDSv2 only), on 127.0.0.1, for the spot
notice poller (``cloudckpt.runs.spot``) in tests and examples. The real service is never contacted.

- ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (400 without it) and
  answers a new token (the TTL asked for is recorded in ``ttls``).
- ``GET /latest/meta-data/spot/instance-action`` needs a token it issued (401 otherwise, as an
  instance that requires IMDSv2 answers), then 404 until a notice is posted and 200 with the
  notice's JSON after. Other paths: 404.
- ``post_notice()`` posts the notice; ``notice_after=n`` posts it at the n-th valid GET.
- ``token_uses=n``: a token is refused (401) after n GETs, as an expired one.
- ``script``: what the next GETs meet, one entry each, before anything else; ``put_script``:
  the same for the next token PUTs. An entry is an HTTP status to answer (500, 503, ...) or one
  of the answers of ``HOSTILE`` (the behaviours a broken or hostile endpoint may have):
  ``"ok"`` (answered as usual), ``"drop"`` (closed without an answer), ``"reset"`` (a 200 whose
  body is cut by a TCP reset), ``"drip"`` (a 200 head dripped a byte per 50 ms, never ending),
  ``"interim"`` (``100 Continue`` answers, one per 50 ms, forever), ``"stall"`` (nothing, the
  connection held open), ``"huge"`` (a 200 whose body never ends: bytes sent as fast as they
  are read, counted in ``sent_bytes``), ``"garbage"`` (an answer that is not HTTP),
  ``"nested"`` (a 200 whose body is 100 000 ``[``: deeper than any JSON parser's stack),
  ``"badtoken"`` (a 200 whose body holds a line break and a header), ``"redirect"`` (a 302 to
  ``redirect_to``). The endless ones end when the client goes away or at :meth:`stop`.
- ``count(method, status)`` counts what was answered (status -1: a dropped connection; the
  name of a hostile answer for the others).
- ``tls=TLSFiles`` (``cloudckpt.testing.servers.tlsca``) serves HTTPS with that certificate.

Usage::

    with FakeMetadataServer(notice_after=3) as imds:
        poller = SpotNoticePoller(callback, options=SpotNoticeOptions(endpoint=imds.endpoint))
"""

from __future__ import annotations

import http.server
import json
import socket
import ssl
import struct
import threading

__all__ = ["FakeMetadataServer", "DEFAULT_NOTICE", "HOSTILE"]

TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_NOTICE = {"action": "terminate", "time": "2026-11-30T19:30:00Z"}
HOSTILE = (
    "ok",
    "drop",
    "reset",
    "drip",
    "interim",
    "stall",
    "huge",
    "garbage",
    "nested",
    "badtoken",
    "redirect",
)
_TICK_S = 0.05


class FakeMetadataServer:
    """IMDSv2 on 127.0.0.1 with a free port; a context manager (serves in a daemon thread)."""

    def __init__(
        self,
        *,
        notice_after: int | None = None,
        token_uses: int | None = None,
        script=(),
        put_script=(),
        notice_body: str | None = None,
        redirect_to: str | None = None,
        tls=None,
    ):
        for step in (*script, *put_script):
            if not isinstance(step, int) and step not in HOSTILE:
                raise ValueError(
                    f"unknown script entry {step!r}: an HTTP status or one of {HOSTILE}"
                )
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.notice_after = notice_after
        self.token_uses = token_uses
        self.script = list(script)
        self.put_script = list(put_script)
        self.redirect_to = redirect_to
        self.sent_bytes = 0
        self.notice_body = notice_body if notice_body is not None else json.dumps(DEFAULT_NOTICE)
        self.notice_posted = False
        self.tokens: dict[str, int] = {}  # token -> GETs made with it
        self.log: list[tuple[str, int]] = []  # (method, status; -1 for a dropped connection)
        self.ttls: list[str] = []
        self.valid_gets = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        scheme = "http"
        if tls is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(tls.cert_file, tls.key_file)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.endpoint = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, daemon=True, name="fake-imds"
        )

    def post_notice(self) -> None:
        """From now on the spot notice GET answers 200 with the notice."""
        with self.lock:
            self.notice_posted = True

    def count(self, method: str, status: int | None = None) -> int:
        """Requests of ``method`` answered (with ``status``, when given)."""
        with self.lock:
            return sum(1 for m, s in self.log if m == method and (status is None or s == status))

    def start(self) -> FakeMetadataServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> FakeMetadataServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()

    # -- request handling (under the lock) ------------------------------------------------------

    def _issue_token(self, ttl: str) -> str:
        with self.lock:
            self.ttls.append(ttl)
            token = f"token-{len(self.tokens)}"
            self.tokens[token] = 0
            return token

    def _notice_status(self, token: str | None) -> int:
        with self.lock:
            uses = self.tokens.get(token) if token is not None else None
            if token is None or uses is None:
                return 401
            if self.token_uses is not None and uses >= self.token_uses:
                return 401
            self.tokens[token] = uses + 1
            self.valid_gets += 1
            if self.notice_after is not None and self.valid_gets >= self.notice_after:
                self.notice_posted = True
            return 200 if self.notice_posted else 404


def _handler(fake: FakeMetadataServer):
    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _answer(self, status: int, body: str = "") -> None:
            self._record(status)  # before the answer: the client may count right after it
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _record(self, status) -> None:
            with fake.lock:
                fake.log.append((self.command, status))

        def _hostile(self, step) -> bool:
            """Play ``step`` (a script entry); whether the request is answered by it."""
            if step is None or step == "ok":
                return False
            if isinstance(step, int):
                self._answer(step)
                return True
            self._record(-1 if step == "drop" else step)
            self.close_connection = True
            try:
                _PLAYS[step](self, fake)
            except OSError:  # the client went away: what these answers are for
                pass
            return True

        def do_PUT(self):
            with fake.lock:
                step = fake.put_script.pop(0) if fake.put_script else None
            if self._hostile(step):
                return
            if self.path != TOKEN_PATH or not self.headers.get(TOKEN_TTL_HEADER):
                return self._answer(400)
            self._answer(200, fake._issue_token(self.headers[TOKEN_TTL_HEADER]))

        def do_GET(self):
            with fake.lock:
                step = fake.script.pop(0) if fake.script else None
            if self._hostile(step):
                return
            if self.path != NOTICE_PATH:
                return self._answer(404)
            status = fake._notice_status(self.headers.get(TOKEN_HEADER))
            self._answer(status, fake.notice_body if status == 200 else "")

    return Handler


def _drop(handler, fake):
    handler.connection.shutdown(socket.SHUT_RDWR)


def _reset(handler, fake):
    handler.wfile.write(b'HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n{"action": "term')
    handler.wfile.flush()
    handler.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    handler.connection.close()  # linger 0: the close sends a RST


def _endless(handler, fake, first: bytes, each: bytes):
    handler.wfile.write(first)
    handler.wfile.flush()
    while not fake.closing.wait(_TICK_S):
        handler.wfile.write(each)
        handler.wfile.flush()


def _drip(handler, fake):
    _endless(handler, fake, b"HTTP/1.1 200 OK\r\nX-Drip: ", b"x")


def _interim(handler, fake):
    _endless(handler, fake, b"", b"HTTP/1.1 100 Continue\r\n\r\n")


def _stall(handler, fake):
    fake.closing.wait(120)


def _huge(handler, fake):
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1099511627776\r\n\r\n")
    block = b"0" * 65536
    while not fake.closing.is_set():
        handler.wfile.write(block)
        with fake.lock:
            fake.sent_bytes += len(block)


def _garbage(handler, fake):
    handler.wfile.write(b"SSH-2.0-OpenSSH_9.6\r\n\x00\xff\xfe binary \r\n\r\n")


def _nested(handler, fake):
    body = b"[" * 100_000
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def _badtoken(handler, fake):
    body = b"token-x\r\nX-Injected: 1"
    handler.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)


def _redirect(handler, fake):
    handler.wfile.write(
        f"HTTP/1.1 302 Found\r\nLocation: {fake.redirect_to}{handler.path}\r\n"
        f"Content-Length: 0\r\n\r\n".encode()
    )


_PLAYS = {
    "drop": _drop,
    "reset": _reset,
    "drip": _drip,
    "interim": _interim,
    "stall": _stall,
    "huge": _huge,
    "garbage": _garbage,
    "nested": _nested,
    "badtoken": _badtoken,
    "redirect": _redirect,
}
