"""Plumbing of S3Store: the aiobotocore client with the cheap request settings, the
zero-copy request body and the streaming response reader.

The client is created on first use, in the running loop, with a connection pool of
``concurrency`` connections, botocore's own retries off (the store's choke point retries), payload
signing off (TLS or the crc32c header protect bodies; botocore would SHA-256 every body over http)
and checksums only where an operation requires them. DeleteObjects also carries ``Content-MD5``:
botocore sends only ``x-amz-checksum-crc32`` there, and servers that predate flexible checksums
(MinIO before 2025-01, the JuiceFS gateway) answer 400 MissingContentMD5 without it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import io
import os
import re
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar
from urllib.parse import urlparse

import aiohttp.payload
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from cloudckpt.errors import ConfigError
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.redact import install_redaction
from cloudckpt.storage.urls import parse_s3_url  # noqa: F401 - re-exported

T = TypeVar("T")

#: Bytes handed to the socket per write: bounds the transport's own copy of a body.
SEND_CHUNK = 256 * 1024


def crc32c_b64(crc: int) -> str:
    """The ``x-amz-checksum-crc32c`` value: base64 of the big-endian crc32c."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def resolve_endpoint(options: StorageOptions) -> str | None:
    """The endpoint URL from the options, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``."""
    return endpoint_source(options)[0]


def endpoint_source(options: StorageOptions) -> tuple[str | None, str]:
    """(endpoint URL or None, where it was configured): ``StorageOptions.endpoint_url``,
    ``AWS_ENDPOINT_URL_S3``, ``AWS_ENDPOINT_URL``, or ``""`` when none is (botocore then uses a
    profile's ``endpoint_url`` or AWS S3)."""
    if options.endpoint_url:
        return options.endpoint_url, "StorageOptions.endpoint_url"
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        if os.environ.get(name):
            return os.environ[name], name
    return None, ""


def is_aws_endpoint(endpoint: str | None) -> bool:
    """Whether ``endpoint`` is one of AWS S3's own."""
    return _is_aws(endpoint)


def _is_aws(endpoint: str | None) -> bool:
    host = urlparse(endpoint).hostname or "" if endpoint else ""
    return host.endswith((".amazonaws.com", ".amazonaws.com.cn"))


def _config(options: StorageOptions, style: str) -> AioConfig:
    retry = options.retry
    s3 = {"payload_signing_enabled": False}
    if style != "auto":
        s3["addressing_style"] = style
    return AioConfig(
        max_pool_connections=options.concurrency,
        connect_timeout=min(retry.connect_timeout, retry.attempt_timeout),
        read_timeout=min(retry.read_timeout, retry.attempt_timeout),  # silence per read
        retries={"total_max_attempts": 1, "mode": "standard"},
        s3=s3,
        signature_version="s3v4",
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


async def open_client(options: StorageOptions, stack: contextlib.AsyncExitStack):
    """Create the aiobotocore S3 client for ``options`` inside ``stack`` (closed with it).
    Returns ``(client, access key id)``: the id of the credentials in use (not a secret; for
    messages), None if it cannot be told.

    Raises ``ConfigError`` when no credentials can be found at all.
    """
    install_redaction()  # botocore's DEBUG records would otherwise show session tokens
    session = AioSession(profile=options.profile) if options.profile else AioSession()
    endpoint = resolve_endpoint(options)
    access_key_id = options.access_key_id
    if access_key_id is None:
        credentials = await session.get_credentials()
        if credentials is None:
            raise ConfigError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)")
        with contextlib.suppress(Exception):  # refreshing may fail here: the request will say
            access_key_id = (await credentials.get_frozen_credentials()).access_key
    region = options.region or session.get_config_variable("region")
    if region is None and endpoint is not None:
        region = "us-east-1"
    style = options.addressing_style
    if style == "auto" and endpoint is not None and not _is_aws(endpoint):
        style = "path"
    kwargs = dict(region_name=region, endpoint_url=endpoint, verify=options.verify_tls,
                  aws_access_key_id=options.access_key_id,
                  aws_secret_access_key=options.secret_access_key,
                  aws_session_token=options.session_token)
    client = await stack.enter_async_context(
        session.create_client("s3", config=_config(options, style), **kwargs))
    if style == "auto" and not _is_aws(client.meta.endpoint_url):
        # An endpoint from a profile: custom servers want path-style addressing.
        await client.close()
        client = await stack.enter_async_context(
            session.create_client("s3", config=_config(options, "path"), **kwargs))
    client.meta.events.register("before-call.s3.DeleteObjects", add_content_md5)
    return client, access_key_id


def add_content_md5(params, **kwargs) -> None:
    """botocore ``before-call`` handler: set ``Content-MD5`` (base64 MD5 of the body) on a
    request that has a body and none yet. Registered for DeleteObjects, whose body is a small
    XML document; the header is signed with the rest (signing happens later)."""
    body = params.get("body")
    headers = params.setdefault("headers", {})
    if isinstance(body, (bytes, bytearray)) and not any(
            k.lower() == "content-md5" for k in headers):
        digest = hashlib.md5(body, usedforsecurity=False).digest()
        headers["Content-MD5"] = base64.b64encode(digest).decode("ascii")


class BodyPayload(aiohttp.payload.Payload):
    """A request body over caller buffers: written to the socket in slices, never copied whole.

    Also a minimal file-like object (``read``/``seek``/``tell``/``len``) so botocore accepts it as
    a blob. One instance per attempt.
    """

    _autoclose = True

    def __init__(self, views: Sequence[memoryview]):
        super().__init__(views, content_type="application/octet-stream")
        self._views = list(views)
        self._size = sum(len(v) for v in self._views)
        self._pos = 0
        self.progress_at = time.monotonic()  #: when the socket last took bytes (or creation)
        self.sent = False  #: the whole body was handed to the socket

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("binary body")

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, min(self._size, base + pos))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Copying fallback for code paths that insist on reading the body (not used by S3Store)."""
        stop = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        out = bytearray()
        offset = 0
        for v in self._views:
            end = offset + len(v)
            if end > self._pos and offset < stop:
                out += v[max(self._pos - offset, 0):min(stop, end) - offset]
            offset = end
        self._pos = stop
        return bytes(out)

    async def write(self, writer) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer, content_length: int | None) -> None:
        self.sent = False
        self.progress_at = time.monotonic()
        remaining = self._size if content_length is None else min(content_length, self._size)
        for v in self._views:
            for start in range(0, len(v), SEND_CHUNK):
                if remaining <= 0:
                    break
                piece = v[start:start + min(SEND_CHUNK, remaining)]
                await writer.write(piece)
                self.progress_at = time.monotonic()
                remaining -= len(piece)
        self.sent = True


class SendStall(TimeoutError):
    """The endpoint took no byte of a request body for the read timeout (retried, a stall)."""


async def send_with_body(request: Awaitable[T], body, silence: float) -> T:
    """Await ``request``, which sends ``body`` (a :class:`BodyPayload`, or bytes). While the body
    is not fully sent, ``silence`` seconds without the socket taking a byte of it (a server that
    never answers ``100 Continue``, or stops reading) cancel the request and raise
    :class:`SendStall`. Once it is sent, the client's read timeout watches the answer."""
    task = asyncio.ensure_future(request)
    if not isinstance(body, BodyPayload):
        return await task
    try:
        while True:
            wait = body.progress_at + silence - time.monotonic()
            if body.sent:
                return await task
            if wait <= 0:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise SendStall(f"the endpoint took no byte of the request body for {silence:g} s")
            await asyncio.wait({task}, timeout=wait)
            if task.done():
                return task.result()
    except BaseException:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        raise


async def iter_body(body) -> AsyncIterator[bytes]:
    """Chunks of an aiobotocore streaming body as the socket delivers them (no re-buffering)."""
    raw = getattr(body, "raw_stream", None)
    content = getattr(raw, "content", None)
    if content is not None and hasattr(content, "readany"):
        while True:
            chunk = await content.readany()
            if not chunk:
                return
            yield chunk
    else:  # another HTTP backend
        while True:
            chunk = await body.read(1 << 20)
            if not chunk:
                return
            yield chunk


_CONTENT_RANGE_RE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``bytes a-b/total`` -> (a, b + 1, total or None); None when absent or unparsable."""
    if not value:
        return None
    m = _CONTENT_RANGE_RE.match(value.strip())
    if not m:
        return None
    total = None if m.group(3) == "*" else int(m.group(3))
    return int(m.group(1)), int(m.group(2)) + 1, total
