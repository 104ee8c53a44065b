"""``S3Store``: the ``ObjectStore`` protocol on S3-compatible servers (aiobotocore).

Split by responsibility, with imports pointing one way (``store`` -> ``stream`` -> ``write`` ->
``uploads``; ``uploads`` / ``read`` -> ``conn`` -> ``retry``, ``errors``, ``client``; all of
``cloudckpt.storage.s3``):
- ``conn.S3Connection``: one per ``open_store`` call, shared by ``child()`` stores: client,
  the request choke point (``request`` / ``call``: slots, retries, deadline, logging, error
  translation), the byte budget, the counters; ``shapes``: the typed boundary to aiobotocore;
- ``uploads.S3Uploads``: single puts, multipart steps, aborts, HEADs, the upload listing;
- ``write.S3Writer``: puts and the conditional create with its claim protocol;
- ``stream.S3ObjectWriter``: streams (``open_writer``), built on ``S3Writer``;
- ``read.S3Reader``: head, get, ranged reads (coalescing, verification);
- here: keys (anchor, child prefix, prefix spreading), listings, deletes, and the composition.
"""

from __future__ import annotations

import base64
import builtins
import logging
import re
from collections.abc import AsyncIterator, Iterable, Sequence

from botocore.exceptions import ClientError

from cloudckpt.errors import ConfigError, ObjectNotFound, StorageError
from cloudckpt.http_numbers import http_int
from cloudckpt.storage.base import (
    Body,
    CommonPrefix,
    ObjectInfo,
    PutMode,
    ReadRange,
    StoreStats,
    UploadInfo,
    WholeChecksum,
    as_views,
    check_key,
    check_prefix,
    run_all,
)
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.s3.conn import S3Connection
from cloudckpt.storage.s3.errors import (
    TransientServerError,
    cause_code,
    is_not_implemented,
    is_retriable,
)
from cloudckpt.storage.s3.read import S3Reader, object_info
from cloudckpt.storage.s3.shapes import S3Answer, S3Params
from cloudckpt.storage.s3.stream import S3ObjectWriter
from cloudckpt.storage.s3.write import S3Writer
from cloudckpt.storage.spreading import merge_sorted
from cloudckpt.storage.urls import parse_s3_url

logger = logging.getLogger("cloudckpt.storage")

DELETE_BATCH = 1000
_MD5_ETAG = re.compile(r'"?([0-9a-fA-F]{32})"?')
#: Error codes of a server that will not take a DeleteObjects request (besides 501).
BATCH_DELETE_REFUSALS = frozenset({"NotImplemented", "MissingContentMD5"})


class S3Store:
    """An ``ObjectStore`` over ``s3://bucket/prefix``. See ``cloudckpt.storage.base.ObjectStore``
    for the contract of each method.

    Requests in flight are capped at ``options.concurrency``; bytes the store allocates for reads
    and stream parts in flight at ``options.max_buffer_bytes``. Objects are bound to the event
    loop they are first used on.
    """

    remote = True  #: capabilities: see ``ObjectStore``
    local_root = None

    def __init__(
        self,
        url: str,
        options: StorageOptions | None = None,
        *,
        _conn: S3Connection | None = None,
        _sub: str = "",
    ):
        bucket, anchor = parse_s3_url(url)
        if _conn is None:
            _conn = S3Connection(options or StorageOptions(), bucket, anchor)
        self._conn = _conn
        self._sub = _sub  # key prefix of this (child) store below the anchor: "" or ".../"
        root = f"{_conn.anchor}{_sub}".rstrip("/")
        self.url = f"s3://{_conn.bucket}/{root}" if root else f"s3://{_conn.bucket}"
        self.stats: StoreStats = _conn.stats
        self.options = _conn.options
        self._writer = S3Writer(_conn, self.url)
        self._reader = S3Reader(_conn, self.url)

    @property
    def connection(self) -> S3Connection:
        """What this store shares with its parent and children (client, limits, counters)."""
        return self._conn

    def __repr__(self) -> str:
        return f"S3Store({self.url!r})"

    # --- keys ---------------------------------------------------------------------------------

    def _phys(self, key: str) -> str:
        rel = self._sub + check_key(key)
        return self._conn.anchor + self._conn.spreader.dir_for(rel) + rel

    def _bases(self) -> list[str]:
        """Key prefixes under which this store's keys live (one per hashed dir)."""
        return [self._conn.anchor + d + self._sub for d in self._conn.spreader.all_dirs()]

    def child(self, prefix: str) -> S3Store:
        prefix = check_prefix(prefix).strip("/")
        if not prefix:
            return self
        return S3Store(
            f"s3://{self._conn.bucket}/{self._conn.anchor}",
            _conn=self._conn,
            _sub=f"{self._sub}{prefix}/",
        )

    async def close(self) -> None:
        if not self._sub:
            await self._conn.close()

    async def __aenter__(self) -> S3Store:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- writes ---------------------------------------------------------------------------------

    async def put(self, key: str, body: Body, *, mode: PutMode = "overwrite") -> ObjectInfo:
        if mode not in ("overwrite", "create"):
            raise ConfigError(f"bad put mode {mode!r}")
        views = as_views(body)
        return await self._writer.put(key, self._phys(key), views, mode == "create")

    def open_writer(
        self, key: str, *, mode: PutMode = "overwrite", size_hint: int | None = None
    ) -> S3ObjectWriter:
        """A stream writing ``key`` (``ObjectStore.open_writer``; memory and the create
        protocol: :mod:`cloudckpt.storage.s3.stream`)."""
        if mode not in ("overwrite", "create"):
            raise ConfigError(f"bad put mode {mode!r}")
        return S3ObjectWriter(
            self._writer, key, self._phys(key), create=mode == "create", size_hint=size_hint
        )

    async def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` with DeleteObjects batches of 1,000 (sent with ``Content-MD5``). A
        server that refuses the batch request (501 NotImplemented, or 400 MissingContentMD5
        from a proxy that drops the header) gets single DeleteObject requests instead, from
        then on for the whole connection (one WARNING)."""
        phys = list(dict.fromkeys(self._phys(k) for k in keys))
        batches = [phys[i : i + DELETE_BATCH] for i in range(0, len(phys), DELETE_BATCH)]
        await run_all(self._delete_batch(b) for b in batches)

    async def _delete_batch(self, batch: list[str]) -> None:
        conn = self._conn
        if conn.batch_delete is not False:
            try:
                await self._delete_objects(batch)
                return
            except StorageError as exc:
                code, status = cause_code(exc)
                if code not in BATCH_DELETE_REFUSALS and status != 501:
                    raise
                if conn.refuses_batch_delete():
                    logger.warning(
                        "%s refuses DeleteObjects (%s); deleting one object per "
                        "request from now on",
                        self.url,
                        f"{status} {code}".strip(),
                    )
        await self._delete_singly(batch)

    async def _delete_objects(self, batch: list[str]) -> None:
        pending = list(batch)

        async def attempt(n: int) -> None:
            nonlocal pending
            objects = [{"Key": k} for k in pending]
            resp = await self._conn.send(
                "delete_objects", Delete={"Objects": objects, "Quiet": True}
            )
            retry, fatal = [], None
            for err in resp.get("Errors", []) or []:
                code = err.get("Code", "")
                if code in ("NoSuchKey", "NotFound"):
                    continue
                if is_retriable(code):
                    retry.append(err["Key"])
                elif fatal is None:
                    fatal = err
            if fatal is not None:
                raise ClientError(
                    {
                        "Error": {
                            "Code": fatal.get("Code", ""),
                            "Message": f"{fatal.get('Key', '')}: {fatal.get('Message', '')}",
                        }
                    },
                    "DeleteObjects",
                )
            if retry:
                pending = retry
                raise TransientServerError(f"{len(retry)} keys not deleted yet")

        await self._conn.call("delete", None, attempt, where=self.url)

    async def _delete_singly(self, batch: list[str]) -> None:
        """DeleteObject for each key, ``concurrency`` at a time; a missing key is fine."""
        conn = self._conn
        todo = iter(batch)

        async def delete_one(phys: str) -> None:
            try:
                await conn.request(
                    "delete_object", op="delete_object", key=None, where=self.url, Key=phys
                )
            except ObjectNotFound:
                pass

        async def worker() -> None:
            for phys in todo:
                await delete_one(phys)

        await run_all(worker() for _ in range(min(conn.options.concurrency, len(batch))))

    # --- reads ----------------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo:
        return await self._reader.head(key, self._phys(key))

    async def whole_checksum(self, key: str) -> WholeChecksum | None:
        """``ObjectStore.whole_checksum``: one HeadObject with ``ChecksumMode=ENABLED``
        (counted as a ``head``; see :func:`whole_checksum_of`)."""
        resp = await self._conn.request(
            "head_object",
            op="head",
            key=key,
            where=self.url,
            Key=self._phys(key),
            ChecksumMode="ENABLED",
        )
        return whole_checksum_of(resp)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object (see ``S3Reader.get`` for how its memory is budgeted). With
        ``max_bytes``, an object larger than that raises ``ObjectTooLarge`` as soon as the first
        answer's headers give its size, before its body is read."""
        return await self._reader.get(key, self._phys(key), max_bytes=max_bytes)

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        return await self._reader.read_ranges(key, self._phys(key), ranges)

    # --- listings -------------------------------------------------------------------------------

    async def list(
        self, prefix: str = "", *, delimiter: str | None = None
    ) -> AsyncIterator[ObjectInfo | CommonPrefix]:
        check_prefix(prefix)
        if delimiter == "":
            raise ConfigError("delimiter must be None or non-empty")
        iters = [self._list_base(base, prefix, delimiter) for base in self._bases()]
        if len(iters) == 1:
            async for item in iters[0]:
                yield item
            return
        async for item in merge_sorted(iters, _sort_key):
            yield item

    async def _list_base(
        self, base: str, prefix: str, delimiter: str | None
    ) -> AsyncIterator[ObjectInfo | CommonPrefix]:
        token = None
        while True:
            kw: S3Params = {"Prefix": base + prefix, "MaxKeys": 1000}
            if delimiter:
                kw["Delimiter"] = delimiter
            if token:
                kw["ContinuationToken"] = token
            page = await self._conn.request(
                "list_objects_v2", op="list", key=prefix or None, where=self.url, **kw
            )
            items: builtins.list[ObjectInfo | CommonPrefix] = [
                object_info(o["Key"][len(base) :], o.get("Size", 0), o)
                for o in page.get("Contents", []) or []
            ]
            items += [
                CommonPrefix(p["Prefix"][len(base) :]) for p in page.get("CommonPrefixes", []) or []
            ]
            items.sort(key=_sort_key)
            for item in items:
                yield item
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return

    async def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Unfinished multipart uploads under ``prefix``. On a server that does not implement
        ListMultipartUploads (501) this is always empty (one WARNING per connection): such
        uploads cannot be found, so clean-up cannot abort them (the server's own expiry of
        unfinished uploads, where it has one, is then the only clean-up)."""
        check_prefix(prefix)
        conn = self._conn
        if conn.lists_uploads is False:
            return []
        found: builtins.list[UploadInfo] = []
        for base in self._bases():
            try:
                found += await self._writer.list_uploads(base + prefix, strip=len(base))
            except StorageError as exc:
                if not is_not_implemented(exc):
                    raise
                if conn.refuses_upload_listing():
                    logger.warning(
                        "%s does not implement ListMultipartUploads: unfinished "
                        "multipart uploads cannot be listed or aborted by cloudckpt",
                        self.url,
                    )
                return []
        found.sort(key=lambda u: (u.key, u.initiated or 0.0, u.upload_id))
        return found

    async def abort_upload(self, upload: UploadInfo) -> None:
        await self._writer.abort(upload.key, self._phys(upload.key), upload.upload_id)


def whole_checksum_of(resp: S3Answer) -> WholeChecksum | None:
    """The whole-object checksum a HeadObject answer gives: its ``ChecksumCRC32C`` unless that
    is a composite (``-N``) or not a full-object one, else an ETag that is an MD5 (32 hex digits:
    a single-part upload; not for SSE-KMS or SSE-C objects, whose ETags are not MD5s), else
    None."""
    size = http_int(resp.get("ContentLength")) or 0
    crc = resp.get("ChecksumCRC32C")
    if crc and "-" not in crc and resp.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
        try:
            raw = base64.b64decode(crc, validate=True)
        except ValueError:
            raw = b""
        if len(raw) == 4:
            return WholeChecksum(kind="crc32c", value=int.from_bytes(raw, "big"), size=size)
    etag = _MD5_ETAG.fullmatch(resp.get("ETag") or "")
    encrypted = str(resp.get("ServerSideEncryption", "")).startswith("aws:kms") or resp.get(
        "SSECustomerAlgorithm"
    )
    if etag and not encrypted:
        return WholeChecksum(kind="md5", value=bytes.fromhex(etag.group(1)), size=size)
    return None


def _sort_key(item: ObjectInfo | CommonPrefix) -> str:
    return item.key if isinstance(item, ObjectInfo) else item.prefix


__all__ = ["S3Store", "whole_checksum_of"]
