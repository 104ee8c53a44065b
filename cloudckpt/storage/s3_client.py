"""Plumbing of S3Store: URL parsing, the aiobotocore client with the cheap request settings, the
zero-copy request body and the streaming response reader.

Endpoint, region, addressing style, credentials and TLS trust are resolved as boto3 resolves them
(``aws_config``).

The client is created on first use, in the running loop, with a connection pool of
``concurrency`` connections, botocore's own retries off (the store's choke point retries), payload
signing off (TLS or the crc32c header protect bodies; botocore would SHA-256 every body over http)
and checksums only where an operation requires them.
"""

from __future__ import annotations

import base64
import contextlib
import io
import logging
import re
from collections.abc import AsyncIterator, Sequence
from urllib.parse import urlparse

import aiohttp.payload
from aiobotocore.config import AioConfig
from aiobotocore.session import AioSession

from cloudckpt.errors import ConfigError
from cloudckpt.storage import aws_config
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.redact import install_redaction

log = logging.getLogger("cloudckpt.storage")

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,254}$", re.IGNORECASE)

#: Bytes handed to the socket per write: bounds the transport's own copy of a body.
SEND_CHUNK = 256 * 1024


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix/")`` (prefix "" for the bucket)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ConfigError(f"not an s3:// URL: {url!r}")
    if parsed.query or parsed.fragment or "@" in parsed.netloc:
        raise ConfigError(f"s3 URLs take no query, fragment or credentials: {url!r}")
    bucket = parsed.netloc
    if not _BUCKET_RE.match(bucket):
        raise ConfigError(f"bad bucket name {bucket!r} in {url!r}")
    prefix = parsed.path.strip("/")
    if prefix:
        for part in prefix.split("/"):
            if part in ("", ".", ".."):
                raise ConfigError(f"bad path {parsed.path!r} in {url!r}")
        prefix += "/"
    return bucket, prefix


def crc32c_b64(crc: int) -> str:
    """The ``x-amz-checksum-crc32c`` value: base64 of the big-endian crc32c."""
    return base64.b64encode((crc & 0xFFFFFFFF).to_bytes(4, "big")).decode("ascii")


def _config(options: StorageOptions, style: str | None) -> AioConfig:
    retry = options.retry
    s3 = {"payload_signing_enabled": False}
    if style is not None:  # None: the profile's, else botocore's default
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

    Endpoint, region, addressing style, credentials and CA bundle are resolved as boto3 does
    (``aws_config``). Raises ``ConfigError`` when no credentials can be found at all, when the CA
    bundle to use is not a file, or when the endpoint URL is malformed.
    """
    install_redaction()  # botocore's DEBUG records would otherwise show session tokens
    session = AioSession(profile=options.profile) if options.profile else AioSession()
    if options.access_key_id is None and await session.get_credentials() is None:
        raise ConfigError(
            "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or StorageOptions(access_key_id=..., secret_access_key=...)")
    aws_config.check_ca_bundle(options, session)
    kwargs = aws_config.client_kwargs(options, session)
    try:
        creator = session.create_client(
            "s3", config=_config(options, options.addressing_style), **kwargs)
        client = await stack.enter_async_context(creator)
    except ValueError as exc:
        if not str(exc).startswith("Invalid endpoint"):  # botocore's own errors: s3_errors
            raise
        raise ConfigError(f"bad S3 endpoint URL: {exc} (check StorageOptions.endpoint_url, "
                          "AWS_ENDPOINT_URL[_S3] and endpoint_url in the AWS profile)") from exc
    if log.isEnabledFor(logging.DEBUG):
        log.debug("S3 client: %s", aws_config.describe(client))
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
