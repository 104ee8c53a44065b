"""A fault-injecting HTTP proxy for S3 tests: aiohttp on 127.0.0.1 in front of a real endpoint
(the local SeaweedFS), on its own event loop in a background thread.

It forwards every request with its Host header, so SigV4 signatures still verify upstream, and
injects faults on a schedule, at a rate, or on every request:

- ``"503"`` / ``"500"``: answers 503 SlowDown / 500 InternalError (S3 XML body), unforwarded.
- ``"reset"``: aborts the connection as soon as the request head arrives (not forwarded).
- ``"delay"``: waits ``delay_s`` seconds, then forwards normally.
- ``"truncate"``: forwards, then sends half of the response body (with the full Content-Length)
  and aborts; a response without a body is lost entirely (the server did the work, the client
  sees a reset: an ambiguous outcome).
- ``"flip"``: forwards, and flips one bit of the response body's middle byte (a transfer that
  damaged the bytes; never picked at random: name it in ``kinds`` or ``schedule``).

``ignore_conditional_writes=True`` (needs ``credentials``) strips ``If-None-Match``/``If-Match``
and re-signs requests, as a server that ignores conditional writes; ``"complete"`` does so on
CompleteMultipartUpload only (as Ceph RGW 16, which honours the header on PutObject).

Servers that lack a request form: ``refuse=[("POST", "delete", 501, "NotImplemented")]`` answers
every request with that method and that query parameter (here DeleteObjects) with that status and
S3 error code, unforwarded; ``require_content_md5=True`` answers a DeleteObjects without
``Content-MD5`` with 400 MissingContentMD5 (as MinIO before 2025-01 and the JuiceFS gateway do).
``record=True`` keeps ``(method, path?query, headers)`` of every request in ``requests``.

Usage::
    with FaultProxy(info.endpoint_url, rate=0.2) as proxy:
        store = open_store(url, StorageOptions(endpoint_url=proxy.endpoint_url, ...))
        ...
        proxy.configure(fail_all=True)
        proxy.counters  # {"requests": n, "forwarded": n, "503": n, ...}
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterable, Sequence
from typing import Literal

import aiohttp
from aiohttp import web
from yarl import URL

__all__ = ["FAULT_KINDS", "FaultProxy"]

FAULT_KINDS = ("503", "500", "reset", "delay", "truncate", "flip")
_FAILING_KINDS = ("503", "500", "reset", "truncate")
_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "expect",
    }
)
_ERROR_XML = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
    "<Message>{message}</Message><RequestId>faultproxy</RequestId></Error>"
)


class LoopThreadServer:
    """A test server served by an event loop of its own in a daemon thread, on 127.0.0.1.
    Subclasses define ``async _serve()`` (start listening, set ``self.port``) and ``async
    _shutdown()`` (close what ``_serve`` opened); ``start()`` / ``stop()`` are idempotent."""

    _thread_name = "cloudckpt-test-server"
    port: int | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None

    async def _serve(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    @property
    def endpoint_url(self) -> str:
        if self.port is None:
            raise RuntimeError(f"the {type(self).__name__} is not running")
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> str:
        """Start serving; returns ``endpoint_url``. Idempotent."""
        if self._thread is not None:
            return self.endpoint_url
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve())
            except BaseException as exc:  # noqa: BLE001 - reported to start()
                failure.append(exc)
                ready.set()
                return
            ready.set()
            loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name=self._thread_name, daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            self._thread = None
            raise RuntimeError(f"{type(self).__name__} failed to start") from failure[0]
        return self.endpoint_url

    def stop(self) -> None:
        """Stop serving and join the thread. Idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        thread.join(30)
        self.port = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class FaultProxy(LoopThreadServer):
    """See the module docstring. Every option can be changed at runtime with ``configure``."""

    _thread_name = "cloudckpt-faultproxy"

    def __init__(
        self,
        upstream: str,
        *,
        rate: float = 0.0,
        kinds: Iterable[str] = _FAILING_KINDS,
        fail_all: bool = False,
        delay_s: float = 0.5,
        schedule: Sequence[str | None] = (),
        methods: Iterable[str] | None = None,
        seed: int | None = None,
        ignore_conditional_writes: bool | str = False,
        credentials: tuple[str, str, str] | None = None,
        refuse: Iterable[tuple[str, str, int, str]] = (),
        require_content_md5: bool = False,
        record: bool = False,
    ):
        self.upstream = upstream.rstrip("/")
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._counters: dict[str, int] = {}
        self._inflight = 0
        self.credentials = credentials  # (access key, secret key, region), for re-signing
        self._requests: list[tuple[str, str, dict[str, str]]] = []
        self.configure(
            rate=rate,
            kinds=kinds,
            fail_all=fail_all,
            delay_s=delay_s,
            schedule=schedule,
            methods=methods,
            ignore_conditional_writes=ignore_conditional_writes,
            refuse=refuse,
            require_content_md5=require_content_md5,
            record=record,
        )
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port: int | None = None

    # --- control (any thread) -------------------------------------------------------------------

    def configure(
        self,
        *,
        rate: float | None = None,
        kinds: Iterable[str] | None = None,
        fail_all: bool | None = None,
        delay_s: float | None = None,
        schedule: Sequence[str | None] | None = None,
        methods: Iterable[str] | None | Literal[False] = False,
        ignore_conditional_writes: bool | str | None = None,
        refuse: Iterable[tuple[str, str, int, str]] | None = None,
        require_content_md5: bool | None = None,
        record: bool | None = None,
    ) -> None:
        """Change the fault plan. ``schedule`` lists the faults (or None) of the next requests,
        whatever their method, before ``fail_all`` / ``rate`` apply again; ``methods`` limits
        those two to the given HTTP methods (None: all)."""
        with self._lock:
            if rate is not None:
                if not 0.0 <= rate <= 1.0:
                    raise ValueError("rate must be within [0, 1]")
                self.rate = rate
            if kinds is not None:
                kinds = tuple(kinds)
                bad = set(kinds) - set(FAULT_KINDS)
                if bad or not kinds:
                    raise ValueError(f"unknown fault kinds {sorted(bad)}")
                self.kinds = kinds
            if fail_all is not None:
                self.fail_all = fail_all
            if delay_s is not None:
                self.delay_s = delay_s
            if schedule is not None:
                self._schedule = list(schedule)
            if methods is not False:
                self.methods = None if methods is None else {m.upper() for m in methods}
            if ignore_conditional_writes is not None:
                if ignore_conditional_writes not in (True, False, "complete"):
                    raise ValueError("ignore_conditional_writes: True, False or 'complete'")
                if ignore_conditional_writes and self.credentials is None:
                    raise ValueError("ignore_conditional_writes needs credentials to re-sign")
                self.ignore_conditional_writes = ignore_conditional_writes
            if refuse is not None:
                self.refuse = {(m.upper(), q): (int(status), code) for m, q, status, code in refuse}
            if require_content_md5 is not None:
                self.require_content_md5 = require_content_md5
            if record is not None:
                self.record = record

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot: ``requests``, ``forwarded``, one entry per injected fault kind,
        ``injected`` (all failing faults), ``refused`` (answered by a ``refuse`` rule or for a
        missing Content-MD5, not counted in ``requests``), ``resigned`` and ``max_inflight``
        (most requests handled at once)."""
        with self._lock:
            return dict(self._counters)

    def reset_counters(self) -> None:
        with self._lock:
            self._counters.clear()
            self._requests.clear()

    @property
    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """With ``record=True``: ``(method, path?query, headers)`` of each request received, in
        order (headers as sent by the client, before any re-signing)."""
        with self._lock:
            return list(self._requests)

    # --- serving (proxy thread) -------------------------------------------------------------------

    async def _serve(self) -> None:
        app = web.Application(client_max_size=1 << 40)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256),
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_read=300),
            trust_env=False,
        )

    async def _shutdown(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] = self._counters.get(name, 0) + 1

    def _pick_fault(self, method: str) -> str | None:
        with self._lock:
            self._counters["requests"] = self._counters.get("requests", 0) + 1
            if self._schedule:
                return self._schedule.pop(0)
            if self.methods is not None and method not in self.methods:
                return None
            if self.fail_all:
                failing = [k for k in self.kinds if k != "delay"] or list(_FAILING_KINDS)
                return self._rng.choice(failing)
            if self.rate and self._rng.random() < self.rate:
                return self._rng.choice(self.kinds)
            return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        with self._lock:
            self._inflight += 1
            self._counters["max_inflight"] = max(
                self._counters.get("max_inflight", 0), self._inflight
            )
        try:
            return await self._handle_one(request)
        finally:
            with self._lock:
                self._inflight -= 1

    def _refusal(self, request: web.Request) -> tuple[int, str] | None:
        with self._lock:
            if self.record:
                self._requests.append((request.method, request.path_qs, dict(request.headers)))
            for (method, param), answer in self.refuse.items():
                if request.method == method and param in request.query:
                    return answer
            if (
                self.require_content_md5
                and request.method == "POST"
                and "delete" in request.query
                and "Content-MD5" not in request.headers
            ):
                return 400, "MissingContentMD5"
        return None

    async def _handle_one(self, request: web.Request) -> web.StreamResponse:
        refusal = self._refusal(request)
        if refusal is not None:
            status, code = refusal
            self._count("refused")
            while await request.content.readany():
                pass
            return web.Response(
                status=status,
                content_type="application/xml",
                text=_ERROR_XML.format(code=code, message="refused by the proxy"),
            )
        fault = self._pick_fault(request.method)
        if fault is not None:
            self._count(fault)
            if fault != "delay":
                self._count("injected")
        if fault == "reset":
            return _reset(request)
        if fault in ("503", "500"):
            while await request.content.readany():
                pass
            code, status = ("SlowDown", 503) if fault == "503" else ("InternalError", 500)
            return web.Response(
                status=status,
                content_type="application/xml",
                text=_ERROR_XML.format(code=code, message="injected fault"),
            )
        if fault == "delay":
            await asyncio.sleep(self.delay_s)
        return await self._forward(request, truncate=fault == "truncate", flip=fault == "flip")

    def _upstream_headers(self, request: web.Request, url: str) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        ignore = self.ignore_conditional_writes
        if ignore == "complete":
            ignore = request.method == "POST" and "uploadId" in request.query
        if (
            ignore
            and request.method in ("PUT", "POST")
            and any(k.lower() in ("if-none-match", "if-match") for k in headers)
        ):
            headers = {
                k: v for k, v in headers.items() if k.lower() not in ("if-none-match", "if-match")
            }
            headers = _resign(request.method, url, headers, self.credentials)
            self._count("resigned")
        return headers

    async def _forward(
        self, request: web.Request, *, truncate: bool, flip: bool = False
    ) -> web.StreamResponse:
        assert self._session is not None
        target = self.upstream + request.raw_path
        headers = self._upstream_headers(request, f"http://{request.host}{request.raw_path}")
        has_body = request.body_exists
        async with self._session.request(
            request.method,
            URL(target, encoded=True),
            headers=headers,
            data=request.content if has_body else None,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "User-Agent", "Accept", "Accept-Encoding"),
        ) as upstream:
            self._count("forwarded")
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for k, v in upstream.headers.items():
                if k.lower() not in _HOP_HEADERS:
                    response.headers.add(k, v)
            length = upstream.content_length or 0
            if truncate and (request.method == "HEAD" or length == 0):
                await upstream.read()
                return _reset(request)
            await response.prepare(request)
            if request.method == "HEAD":
                await response.write_eof()
                return response
            limit = length // 2 if truncate else None
            flip_at = length // 2 if flip else -1
            sent = 0
            async for chunk in upstream.content.iter_chunked(1 << 16):
                if sent <= flip_at < sent + len(chunk):
                    flipped = bytearray(chunk)
                    flipped[flip_at - sent] ^= 0x01
                    chunk = bytes(flipped)
                if limit is not None and sent + len(chunk) >= limit:
                    await response.write(chunk[: limit - sent])
                    _reset(request)
                    return response
                await response.write(chunk)
                sent += len(chunk)
            await response.write_eof()
            return response


def _reset(request: web.Request) -> web.Response:
    """Abort the client connection (a TCP reset); the returned response is never sent."""
    transport = request.transport
    if transport is not None:
        transport.abort()
    return web.Response(status=599)


def _resign(
    method: str, url: str, headers: dict[str, str], credentials: tuple[str, str, str] | None
) -> dict[str, str]:
    """SigV4-sign a request again (unsigned payload) after its headers changed."""
    from botocore.auth import UNSIGNED_PAYLOAD, S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    assert credentials is not None
    access_key, secret_key, region = credentials

    class _UnsignedPayloadAuth(S3SigV4Auth):
        def payload(self, request):  # the body streams through; never hash it here
            return UNSIGNED_PAYLOAD

    drop = {"authorization", "x-amz-date", "x-amz-content-sha256", "x-amz-security-token"}
    req = AWSRequest(
        method=method, url=url, headers={k: v for k, v in headers.items() if k.lower() not in drop}
    )
    _UnsignedPayloadAuth(Credentials(access_key, secret_key), "s3", region).add_auth(req)
    return dict(req.headers.items())
