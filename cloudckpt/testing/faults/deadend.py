"""Endpoints that fail the way broken networks do, on 127.0.0.1, for tests of timeouts and
messages:

- :func:`closed_port`: a port nothing listens on (connections are refused at once).
- :class:`SilentServer`: accepts every connection, reads what it is sent, and never answers (a
  hung server or proxy). ``accepted`` counts connections.
- :class:`TrickleServer`: answers every request with ``200`` and a fixed body sent in small
  pieces with pauses between them (a slow link that keeps moving).

Only :class:`TrickleServer` speaks (minimal) HTTP.
"""

from __future__ import annotations

import socket
import threading


def closed_port() -> int:
    """A port on 127.0.0.1 that was just free: bound, then closed without listening."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class SilentServer:
    """A TCP server on 127.0.0.1 that accepts and never answers. Use as a context manager;
    ``endpoint_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-server", daemon=True)

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
                self.accepted += 1
                conn.setblocking(False)
                self._conns.append(conn)
            except TimeoutError:
                pass
            except OSError:
                return
            for c in self._conns:  # drain what clients send so their writes never block
                try:
                    while c.recv(65536):
                        pass
                except (BlockingIOError, OSError):
                    pass

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        for conn in self._conns:
            conn.close()
        self._sock.close()


class TrickleServer:
    """An HTTP/1.1 server on 127.0.0.1 answering every request with ``200 OK`` and ``body``, sent
    ``chunk`` bytes at a time with ``pause`` seconds between pieces. Use as a context manager;
    ``endpoint_url`` is ``http://127.0.0.1:PORT``."""

    def __init__(self, body: bytes, *, chunk: int, pause: float) -> None:
        self.body, self.chunk, self.pause = body, chunk, pause
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self.endpoint_url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="trickle-server", daemon=True)

    def __enter__(self) -> TrickleServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()

    def _serve(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    data = conn.recv(65536)
                    if not data:
                        return
                    head += data
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\n"
                    b"Connection: close\r\n"
                    b"Content-Length: " + str(len(self.body)).encode() + b"\r\n\r\n"
                )
                for start in range(0, len(self.body), self.chunk):
                    if self._stop.wait(self.pause):
                        return
                    conn.sendall(self.body[start : start + self.chunk])
            except OSError:
                return
