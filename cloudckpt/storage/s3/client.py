"""Plumbing of S3Store: the aiobotocore client with the cheap request settings, the
zero-copy request body and the streaming response reader.

Endpoint, region, addressing style, credentials and TLS trust are resolved as boto3 resolves them
(``aws_config``).

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
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, NamedTuple, TypeVar

import aiohttp.payload
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession
from aiohttp.abc import AbstractStreamWriter

from cloudckpt.errors import ConfigError
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.redact import install_redaction
from cloudckpt.storage.s3 import aws_config
from cloudckpt.storage.s3.shapes import S3Client, StreamingBody

log = logging.getLogger("cloudckpt.storage")

T = TypeVar("T")

#: Bytes handed to the socket per write: bounds the transport's own copy of a body.
SEND_CHUNK = 256 * 1024


def crc32c_b64(crc: int) -> str:
    """The ``x-amz-checksum-crc32c`` value: base64 of the big-endian crc32c."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def _config(options: StorageOptions, style: str | None) -> AioConfig:
    retry = options.retry
    s3: dict[str, bool | str] = {"payload_signing_enabled": False}
    if style is not None:  # None: the profile's, else botocore's default
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


class OpenedClient(NamedTuple):
    """What ``open_client`` made, and for messages how: ``access_key_id``, the id of the
    credentials in use (not a secret; None if it cannot be told); ``endpoint_source``, the
    setting that named ``client.meta.endpoint_url`` (``aws_config.endpoint_source``; ``""``:
    none did, botocore's default endpoint)."""

    client: S3Client
    access_key_id: str | None
    endpoint_source: str


async def open_client(options: StorageOptions, stack: contextlib.AsyncExitStack) -> OpenedClient:
    """Create the aiobotocore S3 client for ``options`` inside ``stack`` (closed with it).
    Returns an :class:`OpenedClient`: ``(client, access key id, endpoint source)``.

    Endpoint, region, addressing style, credentials and CA bundle are resolved as boto3 does
    (``aws_config``). Raises ``ConfigError`` when no credentials can be found at all, when the CA
    bundle to use is not a file, or when the endpoint URL is malformed.
    """
    install_redaction()  # botocore's DEBUG records would otherwise show session tokens
    session = AioSession(profile=options.profile) if options.profile else AioSession()
    access_key_id = options.access_key_id
    if access_key_id is None:
        credentials = await session.get_credentials()
        if credentials is None:
            raise ConfigError(
                "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)"
            )
        with contextlib.suppress(Exception):  # refreshing may fail here: the request will say
            access_key_id = (await credentials.get_frozen_credentials()).access_key
    aws_config.check_ca_bundle(options, session)
    kwargs = aws_config.client_kwargs(options, session)
    try:
        creator = session.create_client(
            "s3", config=_config(options, options.addressing_style), **kwargs
        )
        client = await stack.enter_async_context(creator)
    except ValueError as exc:
        if not str(exc).startswith("Invalid endpoint"):  # botocore's own errors: s3_errors
            raise
        raise ConfigError(
            f"bad S3 endpoint URL: {exc} (check StorageOptions.endpoint_url, "
            "AWS_ENDPOINT_URL[_S3] and endpoint_url in the AWS profile)"
        ) from exc
    if log.isEnabledFor(logging.DEBUG):
        log.debug("S3 client: %s", aws_config.describe(client))
    client.meta.events.register("before-call.s3.DeleteObjects", add_content_md5)
    url, source = aws_config.endpoint_source(options, session)
    if url != client.meta.endpoint_url:
        source = ""  # not named by any setting: botocore's default (AWS S3 for the region)
    return OpenedClient(client, access_key_id, source)


def add_content_md5(params: dict[str, Any], **kwargs: object) -> None:
    """botocore ``before-call`` handler: set ``Content-MD5`` (base64 MD5 of the body) on a
    request that has a body and none yet. Registered for DeleteObjects, whose body is a small
    XML document; the header is signed with the rest (signing happens later)."""
    body = params.get("body")
    headers = params.setdefault("headers", {})
    if isinstance(body, (bytes, bytearray)) and not any(
        k.lower() == "content-md5" for k in headers
    ):
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
        self._length = sum(len(v) for v in self._views)
        self._size = self._length  # aiohttp's Payload.size
        self._pos = 0
        self.progress_at = time.monotonic()  #: when the socket last took bytes (or creation)
        self.sent = False  #: the whole body was handed to the socket

    def __len__(self) -> int:
        return self._length

    def __bool__(self) -> bool:
        return self._length > 0

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("binary body")

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, min(self._length, base + pos))
        return self._pos

    def read(self, n: int = -1) -> bytes:
        """Copying fallback for code paths that insist on reading the body (not used by S3Store)."""
        stop = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        out = bytearray()
        offset = 0
        for v in self._views:
            end = offset + len(v)
            if end > self._pos and offset < stop:
                out += v[max(self._pos - offset, 0) : min(stop, end) - offset]
            offset = end
        self._pos = stop
        return bytes(out)

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(
        self, writer: AbstractStreamWriter, content_length: int | None
    ) -> None:
        self.sent = False
        self.progress_at = time.monotonic()
        remaining = self._length if content_length is None else min(content_length, self._length)
        for v in self._views:
            for start in range(0, len(v), SEND_CHUNK):
                if remaining <= 0:
                    break
                piece = v[start : start + min(SEND_CHUNK, remaining)]
                await writer.write(piece)
                self.progress_at = time.monotonic()
                remaining -= len(piece)
        self.sent = True


class SendStall(TimeoutError):
    """The endpoint took no byte of a request body for the read timeout (retried, a stall)."""


async def send_with_body(request: Awaitable[T], body: BodyPayload | bytes, silence: float) -> T:
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


async def iter_body(body: StreamingBody) -> AsyncIterator[bytes]:
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
