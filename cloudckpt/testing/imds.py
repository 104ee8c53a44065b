"""A stand-in for the EC2 instance metadata service (IMDSv2 only), on 127.0.0.1, for the spot
notice poller (``cloudckpt.spot``) in tests and examples. The real service is never contacted.

- ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds`` (400 without it) and
  answers a new token (the TTL asked for is recorded in ``ttls``).
- ``GET /latest/meta-data/spot/instance-action`` needs a token it issued (401 otherwise, as an
  instance that requires IMDSv2 answers), then 404 until a notice is posted and 200 with the
  notice's JSON after. Other paths: 404.
- ``post_notice()`` posts the notice; ``notice_after=n`` posts it at the n-th valid GET.
- ``token_uses=n``: a token is refused (401) after n GETs, as an expired one.
- ``script``: what the next GETs meet, one entry each, before anything else: ``"drop"`` (the
  connection is closed without an answer) or an HTTP status to answer (500, 503, ...).
- ``count(method, status)`` counts what was answered (status -1: a dropped connection).

Usage::

    with FakeMetadataServer(notice_after=3) as imds:
        poller = SpotNoticePoller(callback, options=SpotNoticeOptions(endpoint=imds.endpoint))
"""

from __future__ import annotations

import http.server
import json
import socket
import threading

__all__ = ["FakeMetadataServer", "DEFAULT_NOTICE"]

TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
DEFAULT_NOTICE = {"action": "terminate", "time": "2026-11-30T19:30:00Z"}


class FakeMetadataServer:
    """IMDSv2 on 127.0.0.1 with a free port; a context manager (serves in a daemon thread)."""

    def __init__(self, *, notice_after: int | None = None, token_uses: int | None = None,
                 script=(), notice_body: str | None = None):
        self.lock = threading.Lock()
        self.notice_after = notice_after
        self.token_uses = token_uses
        self.script = list(script)
        self.notice_body = notice_body if notice_body is not None else json.dumps(DEFAULT_NOTICE)
        self.notice_posted = False
        self.tokens: dict[str, int] = {}  # token -> GETs made with it
        self.log: list[tuple[str, int]] = []  # (method, status; -1 for a dropped connection)
        self.ttls: list[str] = []
        self.valid_gets = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="fake-imds")

    def post_notice(self) -> None:
        """From now on the spot notice GET answers 200 with the notice."""
        with self.lock:
            self.notice_posted = True

    def count(self, method: str, status: int | None = None) -> int:
        """Requests of ``method`` answered (with ``status``, when given)."""
        with self.lock:
            return sum(1 for m, s in self.log if m == method and (status is None or s == status))

    def start(self) -> "FakeMetadataServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeMetadataServer":
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
            if uses is None or (self.token_uses is not None and uses >= self.token_uses):
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
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            with fake.lock:
                fake.log.append((self.command, status))

        def do_PUT(self):
            if self.path != TOKEN_PATH or not self.headers.get(TOKEN_TTL_HEADER):
                return self._answer(400)
            self._answer(200, fake._issue_token(self.headers[TOKEN_TTL_HEADER]))

        def do_GET(self):
            with fake.lock:
                step = fake.script.pop(0) if fake.script else None
            if step == "drop":
                with fake.lock:
                    fake.log.append(("GET", -1))
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if step is not None:
                return self._answer(int(step))
            if self.path != NOTICE_PATH:
                return self._answer(404)
            status = fake._notice_status(self.headers.get(TOKEN_HEADER))
            self._answer(status, fake.notice_body if status == 200 else "")

    return Handler
