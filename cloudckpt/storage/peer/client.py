"""``PeerStore``: the part of an ``ObjectStore`` a tiered load and a replication need, on another
node's :class:`~cloudckpt.storage.peer.server.PeerServer`.

Every answer is untrusted bytes: statuses other than the contract's, a length other than the
one asked for, a body longer than announced (or than ``max_bytes``), a malformed head, a peer
that does not answer within ``timeout`` -> :class:`~cloudckpt.errors.PeerError` (bounded time
and memory: a body is read up to the expected length plus one byte, never more). Ranged reads
run :func:`~cloudckpt.storage.verified.read_verified`: a range with a crc32c that fails it
(twice) raises ``ChecksumError``; its sinks are never written.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import aiohttp

from cloudckpt.errors import ObjectExists, ObjectNotFound, ObjectTooLarge, PeerError
from cloudckpt.http_numbers import http_int
from cloudckpt.storage.base import (
    Body,
    ObjectInfo,
    PutMode,
    ReadRange,
    StoreStats,
    as_views,
    check_key,
)
from cloudckpt.storage.peer.server import TOKEN_HEADER
from cloudckpt.storage.ranges import HeldRange
from cloudckpt.storage.verified import read_verified

_CONCURRENCY = 4  # requests in flight per peer (more lose packets at a shaped link)


class PeerStore:
    """Reads (``get``, ``head``, ``read_ranges``) and create-mode ``put`` on a peer's tier."""

    remote = True
    local_root = None

    def __init__(self, url: str, *, token: str, prefix: str = "", timeout: float = 30.0):
        self.url = url.rstrip("/")
        self.prefix = prefix
        self.stats = StoreStats()
        self._token = token
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self.session: aiohttp.ClientSession | None = None
        self._limit = asyncio.Semaphore(_CONCURRENCY)
        self.root = self

    def __repr__(self) -> str:
        return f"PeerStore({self.url!r}, prefix={self.prefix!r})"

    def child(self, prefix: str) -> PeerStore:
        """The same peer with keys below ``prefix`` (sharing connections and stats)."""
        child = PeerStore.__new__(PeerStore)
        child.__dict__.update(self.__dict__)
        child.prefix = self.prefix + prefix
        child.root = self.root
        return child

    def _client(self) -> aiohttp.ClientSession:
        root = self.root
        if root.session is None or root.session.closed:
            root.session = aiohttp.ClientSession(
                timeout=self._timeout, headers={TOKEN_HEADER: self._token}, auto_decompress=False
            )
        return root.session

    async def close(self) -> None:
        """Close the connections (a child's close does nothing)."""
        if self.root is self and self.session is not None:
            session, self.session = self.session, None
            await session.close()

    async def _request(
        self,
        method: str,
        key: str,
        *,
        headers: dict[str, str] | None = None,
        data: bytes | None = None,
        expect: int | None = None,
    ) -> tuple[int, dict[str, str], bytes]:
        """One request; ``expect``: the body's exact length (``None``: no body wanted)."""
        path = f"{self.url}/o/{check_key(self.prefix + key)}"
        self.stats.count(method.lower())
        try:
            async with (
                self._limit,
                self._client().request(
                    method, path, headers=headers, data=data, allow_redirects=False
                ) as resp,
            ):
                body = b""
                if expect is not None:  # never more than asked for plus one byte
                    try:
                        body = await resp.content.readexactly(expect)
                    except asyncio.IncompleteReadError as short:
                        body = short.partial
                    else:
                        if await resp.content.read(1):
                            body += b"?"  # longer than asked: refused below
                self.stats.bytes_received += len(body)
                return resp.status, dict(resp.headers), body
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
            raise PeerError(f"{method} {path}: the peer did not answer ({exc!r})"[:300]) from exc

    def _refuse(self, method: str, key: str, status: int) -> Exception:
        if status == 404:
            return ObjectNotFound(f"{self.url}/{key}: not in the peer's tier")
        if status == 409:
            return ObjectExists(f"{self.url}/{key} exists in the peer's tier")
        return PeerError(f"{method} {self.url}/{key}: the peer answered {status}")

    async def head(self, key: str) -> ObjectInfo:
        status, headers, _ = await self._request("HEAD", key)
        if status != 200:
            raise self._refuse("HEAD", key, status)
        size = http_int(headers.get("Content-Length"))
        if size is None:
            raise PeerError(f"HEAD {self.url}/{key}: no valid Content-Length")
        return ObjectInfo(key=key, size=size)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        size = (await self.head(key)).size
        if max_bytes is not None and size > max_bytes:
            raise ObjectTooLarge(f"{self.url}/{key} is {size} bytes, over {max_bytes}")
        if size == 0:
            return b""
        return await self._range(key, 0, size)

    async def _range(self, key: str, offset: int, length: int) -> bytes:
        header = {"Range": f"bytes={offset}-{offset + length - 1}"}
        status, _, body = await self._request("GET", key, headers=header, expect=length)
        if status != 206:
            raise self._refuse("GET", key, status)
        if len(body) != length:
            raise PeerError(
                f"GET {self.url}/{key}: {len(body) if len(body) <= length else 'more'} bytes "
                f"for a range of {length}"
            )
        return body

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        async def fetch(
            offsets: Sequence[int],
            lengths: Sequence[int],
            targets: Sequence[memoryview | HeldRange],
            *,
            reread: bool,
        ) -> None:
            async def one(offset: int, length: int, target: memoryview | HeldRange) -> None:
                if length:
                    body = await self._range(key, offset, length)
                    target[0:length] = body

            await asyncio.gather(*(one(o, n, t) for o, n, t in zip(offsets, lengths, targets)))

        return await read_verified(key, ranges, fetch, where=self.url)

    async def put(self, key: str, body: Body, *, mode: PutMode = "overwrite") -> ObjectInfo:
        if mode != "create":
            raise PeerError("a peer's tier takes new objects only (mode='create')")
        data = b"".join(bytes(v) for v in as_views(body))
        self.stats.bytes_sent += len(data)
        status, _, _ = await self._request("PUT", key, data=data)
        if status != 201:
            raise self._refuse("PUT", key, status)
        return ObjectInfo(key=key, size=len(data))
