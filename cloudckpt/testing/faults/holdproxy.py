"""A FaultProxy that holds chosen requests until the test releases them: the windows of a race
made deterministic (no sleeps).

Kinds of request it can hold:

- ``"complete"``: CompleteMultipartUpload. While one is held its upload is also left out of
  every ListMultipartUploads answer (``hidden`` counts the uploads left out): a server whose
  completion is not atomic, as moto's (the upload leaves the listing before the object
  appears; ``../shared/notes/s3-servers.md``), frozen inside that window.
- ``"part"``: UploadPart.

``hold(*kinds)``: requests of these kinds that arrive from now on wait (kinds not named are no
longer held when they arrive; those already waiting keep waiting). ``release(kind)``: every
waiting request of that kind goes on, and the kind is no longer held. ``held(kind)``: how many
wait now. ``wait_held(kind, n)``: block (any thread) until at least ``n`` wait, bounded.

Usage::
    with HoldingProxy(info.endpoint_url, credentials=...) as proxy:
        proxy.hold("complete")
        ...            # a creator's completion now waits, its upload hidden from listings
        proxy.release("complete")
"""

from __future__ import annotations

import asyncio
import re
import threading

from aiohttp import web
from yarl import URL

from cloudckpt.testing.faults.faultproxy import _HOP_HEADERS, FaultProxy

__all__ = ["HOLD_KINDS", "HoldingProxy"]

HOLD_KINDS = ("complete", "part")
_UPLOAD_RE = re.compile(rb"<Upload>.*?</Upload>", re.DOTALL)


def _kind(request: web.Request) -> str | None:
    query = request.query
    if request.method == "POST" and "uploadId" in query:
        return "complete"
    if request.method == "PUT" and "uploadId" in query and "partNumber" in query:
        return "part"
    return None


class HoldingProxy(FaultProxy):
    """See the module docstring; every FaultProxy option works as well."""

    _thread_name = "cloudckpt-holdproxy"

    def __init__(self, upstream: str, **kwargs):
        super().__init__(upstream, **kwargs)
        self._cond = threading.Condition()
        self._holding: set[str] = set()
        self._waiting: dict[str, int] = dict.fromkeys(HOLD_KINDS, 0)
        self._gates: dict[str, asyncio.Event] = {}
        self._hidden: set[str] = set()

    # --- control (any thread) -------------------------------------------------------------------

    def hold(self, *kinds: str) -> None:
        bad = set(kinds) - set(HOLD_KINDS)
        if bad:
            raise ValueError(f"unknown hold kinds {sorted(bad)}; choose from {HOLD_KINDS}")
        with self._cond:
            self._holding = set(kinds)

    def release(self, kind: str) -> None:
        with self._cond:
            self._holding.discard(kind)
            gate = self._gates.pop(kind, None)
        if gate is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(gate.set)

    def held(self, kind: str) -> int:
        with self._cond:
            return self._waiting[kind]

    def wait_held(self, kind: str, n: int = 1, timeout: float = 30.0) -> None:
        """Until at least ``n`` requests of ``kind`` wait; ``TimeoutError`` after ``timeout``."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._waiting[kind] >= n, timeout):
                raise TimeoutError(f"{self._waiting[kind]} {kind} requests held, wanted {n}")

    # --- serving (proxy thread) -------------------------------------------------------------------

    async def _forward(
        self, request: web.Request, *, truncate: bool, flip: bool = False
    ) -> web.StreamResponse:
        kind = _kind(request)
        upload_id = request.query.get("uploadId", "")
        with self._cond:
            gate = None
            if kind is not None and kind in self._holding:
                gate = self._gates.setdefault(kind, asyncio.Event())
                self._waiting[kind] += 1
                if kind == "complete":
                    self._hidden.add(upload_id)
                self._cond.notify_all()
        if gate is not None:
            try:
                await gate.wait()
            finally:
                with self._cond:
                    self._waiting[kind] -= 1  # type: ignore[index]
        try:
            if request.method == "GET" and "uploads" in request.query and self._hidden:
                return await self._forward_listing(request)
            return await super()._forward(request, truncate=truncate, flip=flip)
        finally:
            if gate is not None and kind == "complete":
                with self._cond:
                    self._hidden.discard(upload_id)

    async def _forward_listing(self, request: web.Request) -> web.Response:
        """A ListMultipartUploads answer without the uploads whose completion is held."""
        assert self._session is not None
        headers = self._upstream_headers(request, f"http://{request.host}{request.raw_path}")
        async with self._session.get(
            URL(self.upstream + request.raw_path, encoded=True),
            headers=headers,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            self._count("forwarded")
            body = await upstream.read()
            with self._cond:
                hidden = {u.encode() for u in self._hidden}

            def keep(m: re.Match[bytes]) -> bytes:
                if any(b"<UploadId>" + u + b"</UploadId>" in m.group(0) for u in hidden):
                    self._count("hidden")
                    return b""
                return m.group(0)

            body = _UPLOAD_RE.sub(keep, body)
            response = web.Response(status=upstream.status, body=body)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_HEADERS and k.lower() != "content-length":
                    response.headers[k] = v
            return response
