"""Plumbing of S3Store: the aiobotocore client with the cheap request settings, the
zero-copy request body and the streaming response reader.

The client is created on first use, in the running loop, with a connection pool of
``concurrency`` connections, botocore's own retries off (the store's choke point retries), payload
signing off (TLS or the crc32c header protect bodies; botocore would SHA-256 every body over http)
and checksums only where an operation requires them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import os
import re
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlparse

import aiohttp.payload
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from cloudckpt.errors import ConfigError
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.redact import install_redaction
from cloudckpt.storage.urls import parse_s3_url  # noqa: F401 - re-exported

#: Bytes handed to the socket per write: bounds the transport's own copy of a body.
SEND_CHUNK = 256 * 1024


def crc32c_b64(crc: int) -> str:
    """The ``x-amz-checksum-crc32c`` value: base64 of the big-endian crc32c."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def resolve_endpoint(options: StorageOptions) -> str | None:
    """The endpoint URL from the options, else ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``."""
    return (options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL") or None)


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
        connect_timeout=min(10.0, retry.attempt_timeout),
        read_timeout=retry.attempt_timeout,
        retries={"total_max_attempts": 1, "mode": "standard"},
        s3=s3,
        signature_version="s3v4",
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )


async def open_client(options: StorageOptions, stack: contextlib.AsyncExitStack):
    """Create the aiobotocore S3 client for ``options`` inside ``stack`` (closed with it).

    Raises ``ConfigError`` when no credentials can be found at all.
    """
    install_redaction()  # botocore's DEBUG records would otherwise show session tokens
    session = AioSession(profile=options.profile) if options.profile else AioSession()
    endpoint = resolve_endpoint(options)
    if options.access_key_id is None and await session.get_credentials() is None:
        raise ConfigError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)")
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
    return client


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
        remaining = self._size if content_length is None else min(content_length, self._size)
        for v in self._views:
            for start in range(0, len(v), SEND_CHUNK):
                if remaining <= 0:
                    return
                piece = v[start:start + min(SEND_CHUNK, remaining)]
                await writer.write(piece)
                remaining -= len(piece)


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
