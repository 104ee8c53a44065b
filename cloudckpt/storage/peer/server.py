"""``PeerServer``: this node's local tier directory, served to the other nodes of one job.

Contract:

- ``GET /o/<key>`` (optionally ``Range: bytes=a-b``, one range), ``HEAD /o/<key>`` and
  ``PUT /o/<key>`` (create mode: ``409`` when the key exists; the body must announce its
  ``Content-Length``, at most ``max_object_bytes``). Keys are checked like every store key and
  resolved by a :class:`~cloudckpt.storage.local.store.LocalStore` on the directory (no link
  leading out of it is followed). Answers: 200/206/201, 400 (bad key or range), 403 (no or
  wrong token), 404, 409, 413 (too large), 416 (range past the end), 500.
- Every request carries ``X-Cloudckpt-Token``: the job's secret, compared in constant time. The
  service binds one address (the node's address on the job's backend network).
- Nothing received is trusted later either: a reader verifies every range against the
  manifest's crcs (a PUT is stored as sent; a damaged replica fails its checksum when read).
- The service runs on the event loop it is started on (cloudckpt's background loop); a request
  body is read in bounded pieces into a temporary file of the store, published on success only.
"""

from __future__ import annotations

import hmac

from aiohttp import web

from cloudckpt.errors import (
    AccessDenied,
    ConfigError,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    StorageError,
)
from cloudckpt.http_numbers import http_int
from cloudckpt.storage.base import ReadRange, check_key
from cloudckpt.storage.local.store import LocalStore

TOKEN_HEADER = "X-Cloudckpt-Token"
MAX_OBJECT_BYTES = 1 << 34  # 16 GiB: larger than any data object cloudckpt writes (~128 MiB)
_PIECE = 4 << 20


class PeerServer:
    """The service of one tier directory (see the module's contract)."""

    def __init__(
        self,
        root: str,
        *,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        max_object_bytes: int = MAX_OBJECT_BYTES,
    ):
        if not token:
            raise ConfigError("a peer service needs a non-empty token")
        self.store = LocalStore(root)
        self.token = token.encode()
        self.host = host
        self.port = port
        self.max_object_bytes = max_object_bytes
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> PeerServer:
        app = web.Application(client_max_size=1 << 20)
        app.router.add_route("*", "/o/{key:.+}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=64)
        await site.start()
        server = getattr(site, "_server", None)
        sockets = getattr(server, "sockets", None) or ()
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self.store.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        given = request.headers.get(TOKEN_HEADER, "").encode()
        if not hmac.compare_digest(given, self.token):
            return web.Response(status=403, text="wrong or missing token")
        try:
            key = check_key(request.match_info["key"])
            if request.method == "GET":
                return await self._get(request, key)
            if request.method == "HEAD":
                info = await self.store.head(key)
                return web.Response(status=200, headers={"Content-Length": str(info.size)})
            if request.method == "PUT":
                return await self._put(request, key)
            return web.Response(status=405)
        except (ConfigError, InvalidRange) as exc:
            status = 416 if isinstance(exc, InvalidRange) else 400
            return web.Response(status=status, text=str(exc)[:200])
        except ObjectNotFound:
            return web.Response(status=404)
        except AccessDenied:
            return web.Response(status=403, text="outside the tier")
        except ObjectExists:
            return web.Response(status=409)
        except StorageError as exc:
            return web.Response(status=500, text=str(exc)[:200])

    async def _get(self, request: web.Request, key: str) -> web.Response:
        size = (await self.store.head(key)).size
        wanted = request.headers.get("Range")
        if wanted is None:
            body = await self.store.get(key)
            return web.Response(status=200, body=body)
        start, end = _one_range(wanted)
        if end >= size or start > end:
            raise InvalidRange(f"range {start}-{end} of a {size}-byte object")
        (view,) = await self.store.read_ranges(key, [ReadRange(start, end - start + 1)])
        return web.Response(
            status=206, body=view, headers={"Content-Range": f"bytes {start}-{end}/{size}"}
        )

    async def _put(self, request: web.Request, key: str) -> web.Response:
        length = request.content_length
        if length is None:
            return web.Response(status=411)
        if length > self.max_object_bytes:
            return web.Response(status=413)
        writer = self.store.open_writer(key, mode="create", size_hint=length)
        got = 0
        async with writer:
            while got < length:
                piece = await request.content.read(min(_PIECE, length - got))
                if not piece:
                    await writer.abort()
                    return web.Response(status=400, text="body shorter than its length")
                got += len(piece)
                await writer.write(piece)
            await writer.commit()
        return web.Response(status=201)


def _one_range(value: str) -> tuple[int, int]:
    """``bytes=a-b`` -> ``(a, b)``; anything else (several ranges, suffixes) is refused."""
    unit, _, spec = value.partition("=")
    first, dash, last = spec.partition("-")
    if unit.strip() != "bytes" or not dash or "," in spec:
        raise ConfigError(f"unsupported Range {value[:60]!r}")
    start, end = http_int(first), http_int(last)
    if start is None or end is None:
        raise ConfigError(f"unsupported Range {value[:60]!r}")
    return start, end
