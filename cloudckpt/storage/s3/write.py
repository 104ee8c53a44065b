"""Writes of S3Store (``S3Writer``): single puts, multipart uploads, conditional create and its
fallback. Every request goes through ``S3Connection.call``. Streams (``S3Store.open_writer``,
:mod:`cloudckpt.storage.s3.stream`) are built from the same pieces.

Conditional create (``mode="create"``):
- ``native``: a put is one PutObject with ``If-None-Match: *``, whatever the body's size (never
  multipart; bodies over 5 GiB, S3's single-PUT limit, are refused with ``ConfigError``: a
  manifest is far smaller). The server answers 412 when the key exists and lets exactly one of
  concurrent creates win. Verified under a race on SeaweedFS 4.48 and moto 5.2 (tests race two
  stores over HTTP); documented by AWS S3 since 2024-08. The header on CompleteMultipartUpload
  alone is not relied on: Ceph RGW 16 ignores it there (a second create overwrote the first)
  and on moto and LocalStack two racing completes both succeed, while the single PutObject
  held on every server that honoured the header at all. A create *stream* longer than one part
  cannot be one PutObject: it takes the claim below first, then completes with the header
  (what SeaweedFS and AWS honour; the claim covers the servers that do not).
- ``fallback``, for servers that accept the header and ignore it (older MinIO / SeaweedFS
  releases and other S3 gateways or emulators; ``conditional_create="auto"``, the default, finds
  out with a probe object once per store and logs a warning when it falls back): a
  claim protocol over multipart uploads, needing only strongly consistent ListMultipartUploads
  and HeadObject (without ListMultipartUploads, 501, no create can be exclusive: it fails with
  a ``StorageError`` that says so). Each creator (1) stops with ObjectExists if the key exists,
  (2) starts a multipart upload of the key, (3) lists the key's unfinished uploads: if it sees
  any other (not stale) it aborts its own, backs off and starts over, (4) checks again that the
  key does not exist, (5) uploads and completes (with ``If-None-Match: *``). Two creators
  cannot both pass (3): the later one to start its upload sees the earlier one's upload, unless
  that one already completed, which (4) sees. Contention costs retries (bounded by the retry
  deadline), never a second winner. Uploads initiated more than ``STALE_UPLOAD_S`` (15
  minutes) before ours (server clock) are taken for crashed creators and ignored: a creator
  slower than that between (2) and (5) (a stream holds its claim for as long as it streams)
  could lose its exclusivity where the server also ignores the header on
  CompleteMultipartUpload.

A create that ends in 412 (or a completion retry in NoSuchUpload) checks the object's
``x-amz-meta-cloudckpt-put`` token to tell its own success whose answer was lost (our retry, or
aiohttp's silent re-send of a PUT on a reset connection) from someone else's object: one HEAD,
only on that path.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from collections.abc import Sequence

from cloudckpt.checksum import crc32c
from cloudckpt.errors import (
    AccessDenied,
    ConfigError,
    ObjectExists,
    ObjectNotFound,
    RetriesExhausted,
    StorageError,
)
from cloudckpt.storage.base import ObjectInfo, UploadInfo, run_all, slice_views
from cloudckpt.storage.options import MAX_PUT_SIZE, choose_part_size
from cloudckpt.storage.s3.client import crc32c_b64
from cloudckpt.storage.s3.conn import S3Connection
from cloudckpt.storage.s3.errors import is_not_implemented
from cloudckpt.storage.s3.shapes import CompletedPart, S3Answer, S3Params

logger = logging.getLogger("cloudckpt.storage")

TOKEN_META = "cloudckpt-put"
#: Unfinished uploads older than this (relative to ours, server clock) do not block a create.
STALE_UPLOAD_S = 900.0
_THREAD_CRC_BYTES = 4 * 1024 * 1024


async def _crc(views: Sequence[memoryview]) -> int:
    def run() -> int:
        value = 0
        for v in views:
            value = crc32c(v, value)
        return value

    if sum(len(v) for v in views) >= _THREAD_CRC_BYTES:
        return await asyncio.to_thread(run)
    return run()


class S3Writer:
    """The writes of one store: ``where`` is its URL (for messages). Methods take the
    store-relative ``key`` (messages, stats) and the physical key ``phys`` in the bucket."""

    def __init__(self, conn: S3Connection, where: str):
        self.conn = conn
        self.where = where

    async def put(
        self, key: str, phys: str, views: Sequence[memoryview], create: bool
    ) -> ObjectInfo:
        """Store ``views`` (concatenated) at ``phys``; see the module docstring for ``create``."""
        size = sum(len(v) for v in views)
        token = secrets.token_hex(12)
        if create:
            if size > MAX_PUT_SIZE:
                raise ConfigError(
                    f"create {self.where}/{key}: {size} bytes is more than one "
                    f"PutObject takes ({MAX_PUT_SIZE} bytes); create-mode objects "
                    "must be smaller"
                )
            if await self.create_strategy(phys) == "fallback":
                return await self._fallback_create(key, phys, views, size, token)
            return await self._single_put(key, phys, views, size, True, token)
        if size <= self.conn.options.multipart_threshold:
            return await self._single_put(key, phys, views, size, False, token)
        return await self._multipart_put(key, phys, views, size, token)

    async def list_uploads(self, prefix: str, *, strip: int) -> list[UploadInfo]:
        """Unfinished multipart uploads whose physical key starts with ``prefix`` (keys returned
        with their first ``strip`` characters removed)."""
        conn = self.conn
        found: list[UploadInfo] = []
        params: S3Params = {"Prefix": prefix}
        while True:
            page = await conn.request(
                "list_multipart_uploads", op="list_uploads", key=None, where=self.where, **params
            )
            for u in page.get("Uploads", []) or []:
                started = u.get("Initiated")
                found.append(
                    UploadInfo(
                        key=u["Key"][strip:],
                        upload_id=u["UploadId"],
                        initiated=started.timestamp() if started else None,
                    )
                )
            if not page.get("IsTruncated"):
                return found
            params = {
                "Prefix": prefix,
                "KeyMarker": page.get("NextKeyMarker", ""),
                "UploadIdMarker": page.get("NextUploadIdMarker", ""),
            }
            if not params["KeyMarker"] and not params["UploadIdMarker"]:
                return found

    async def abort(self, key: str, phys: str, upload_id: str) -> None:
        """Abort one multipart upload; an upload already gone is fine."""
        try:
            await self.conn.request(
                "abort_multipart_upload",
                op="abort_multipart",
                key=key,
                where=self.where,
                Key=phys,
                UploadId=upload_id,
            )
        except ObjectNotFound:
            pass

    # --- single and multipart puts --------------------------------------------------------------

    async def _single_put(
        self,
        key: str,
        phys: str,
        views: Sequence[memoryview],
        size: int,
        create: bool,
        token: str,
    ) -> ObjectInfo:
        conn = self.conn
        crc = await _crc(views) if conn.options.transport_checksums else None
        kw: S3Params = {"Key": phys}
        if crc is not None:
            kw["ChecksumCRC32C"] = crc32c_b64(crc)
        if create:
            kw["IfNoneMatch"] = "*"
            kw["Metadata"] = {TOKEN_META: token}
        try:
            resp = await conn.request(
                "put_object", op="put", key=key, where=self.where, body=views, **kw
            )
            return ObjectInfo(key=key, size=size, etag=resp.get("ETag"))
        except ObjectExists:
            # An earlier attempt (ours, or aiohttp's silent re-send of an idempotent PUT on a
            # reset connection) may have stored it and lost the answer.
            info = await self._own_object(key, phys, token, size)
            if info is not None:
                return info
            raise

    async def create_upload(self, key: str, phys: str, token: str) -> str:
        conn = self.conn
        kw: S3Params = {"Key": phys, "Metadata": {TOKEN_META: token}}
        if conn.options.transport_checksums:
            kw["ChecksumAlgorithm"] = "CRC32C"
        resp = await conn.request(
            "create_multipart_upload", op="create_multipart", key=key, where=self.where, **kw
        )
        return resp["UploadId"]

    async def upload_part(
        self, key: str, phys: str, upload_id: str, number: int, views: Sequence[memoryview]
    ) -> CompletedPart:
        """Upload ``views`` (concatenated) as part ``number`` (1-based); returns its entry of the
        CompleteMultipartUpload part list."""
        conn = self.conn
        crc = await _crc(views) if conn.options.transport_checksums else None
        kw: S3Params = {"Key": phys, "UploadId": upload_id, "PartNumber": number}
        if crc is not None:
            kw["ChecksumCRC32C"] = crc32c_b64(crc)
        resp = await conn.request(
            "upload_part", op="upload_part", key=key, where=self.where, body=views, **kw
        )
        entry: CompletedPart = {"PartNumber": number, "ETag": resp["ETag"]}
        if crc is not None:
            entry["ChecksumCRC32C"] = crc32c_b64(crc)
        return entry

    async def _upload_parts(
        self, key: str, phys: str, upload_id: str, views: Sequence[memoryview], size: int
    ) -> list[CompletedPart]:
        """Upload every part of a body held in memory (at most ``concurrency`` at a time);
        returns the CompleteMultipartUpload part list."""
        conn = self.conn
        part = choose_part_size(size, conn.options.part_size)
        count = max(1, -(-size // part))
        parts: list[CompletedPart | None] = [None] * count
        next_part = 0

        async def worker() -> None:
            nonlocal next_part
            while next_part < count:
                i, next_part = next_part, next_part + 1
                pviews = slice_views(views, i * part, min(size, (i + 1) * part))
                parts[i] = await self.upload_part(key, phys, upload_id, i + 1, pviews)

        await run_all(worker() for _ in range(min(conn.options.concurrency, count)))
        return [p for p in parts if p is not None]  # every part, once all workers ran

    async def complete(
        self,
        key: str,
        phys: str,
        upload_id: str,
        parts: list[CompletedPart],
        size: int,
        create: bool,
        token: str,
    ) -> ObjectInfo:
        tries = 0

        def started(n: int) -> None:
            nonlocal tries
            tries = n

        kw: S3Params = {"Key": phys, "UploadId": upload_id, "MultipartUpload": {"Parts": parts}}
        if create:
            kw["IfNoneMatch"] = "*"
        try:
            resp = await self.conn.request(
                "complete_multipart_upload",
                op="complete_multipart",
                key=key,
                where=self.where,
                on_attempt=started,
                **kw,
            )
            return ObjectInfo(key=key, size=size, etag=resp.get("ETag"))
        except (ObjectExists, ObjectNotFound):
            if tries > 1 or create:  # an earlier attempt may have completed it
                info = await self._own_object(key, phys, token, size)
                if info is not None:
                    return info
            raise

    async def _multipart_put(
        self, key: str, phys: str, views: Sequence[memoryview], size: int, token: str
    ) -> ObjectInfo:
        """An overwrite-mode multipart upload (create mode never goes multipart: module
        docstring)."""
        upload_id = await self.create_upload(key, phys, token)
        return await self._finish_upload(key, phys, upload_id, views, size, False, token)

    async def _finish_upload(
        self,
        key: str,
        phys: str,
        upload_id: str,
        views: Sequence[memoryview],
        size: int,
        create: bool,
        token: str,
    ) -> ObjectInfo:
        """Upload a body held in memory as the parts of ``upload_id`` and complete it; abort
        the upload on any failure."""
        try:
            parts = await self._upload_parts(key, phys, upload_id, views, size)
            return await self.complete(key, phys, upload_id, parts, size, create, token)
        except BaseException:
            self.abort_later(key, phys, upload_id)
            raise

    def abort_later(
        self, key: str, phys: str, upload_id: str, *, after: Sequence[asyncio.Task[None]] = ()
    ) -> asyncio.Task[None]:
        """Abort an upload after a failure, once the tasks ``after`` (its part uploads) have
        stopped, even if the caller is being cancelled (best effort: a failure is logged).
        Returns the background task (``close`` of the connection waits for it too)."""

        async def run() -> None:
            if after:
                await asyncio.gather(*after, return_exceptions=True)
            try:
                await self.abort(key, phys, upload_id)
            except Exception as exc:  # noqa: BLE001 - best effort, logged
                logger.warning(
                    "could not abort multipart upload of %s/%s: %s", self.where, key, exc
                )

        task = asyncio.ensure_future(run())
        self.conn.in_background(task)
        return task

    async def head(self, key: str, phys: str) -> S3Answer | None:
        """The HeadObject answer for ``phys``, or None when there is no such object."""
        try:
            return await self.conn.request(
                "head_object", op="head", key=key, where=self.where, Key=phys
            )
        except ObjectNotFound:
            return None

    async def _own_object(self, key: str, phys: str, token: str, size: int) -> ObjectInfo | None:
        """The object at ``phys`` if it is the one this put wrote (its token matches), else
        None."""
        resp = await self.head(key, phys)
        if resp is None or (resp.get("Metadata") or {}).get(TOKEN_META) != token:
            return None
        return ObjectInfo(key=key, size=int(resp.get("ContentLength", size)), etag=resp.get("ETag"))

    # --- conditional create ---------------------------------------------------------------------

    async def create_strategy(self, phys: str) -> str:
        """``native`` or ``fallback``: fixed by the options, or probed once per connection (next
        to ``phys``, where the caller is allowed to write)."""
        conn = self.conn
        if conn.create_strategy is not None:
            return conn.create_strategy
        async with conn.create_lock:
            if conn.create_strategy is None:
                try:
                    conn.create_strategy = await self._probe_conditional_put(phys)
                except AccessDenied:
                    # No right to write a probe at the root: try the header; not remembered.
                    return "native"
                if conn.create_strategy == "fallback":
                    logger.warning(
                        "%s ignores If-None-Match on PutObject; create-mode puts use "
                        "the multipart claim protocol",
                        self.where,
                    )
        return conn.create_strategy

    async def _probe_conditional_put(self, phys: str) -> str:
        """Put a probe object twice with If-None-Match: * and see whether the second one
        fails."""
        conn = self.conn
        probe = f"{phys[: phys.rfind('/') + 1]}.cloudckpt-probe-{secrets.token_hex(8)}"

        where = f"s3://{conn.bucket}/{conn.anchor}"
        put: S3Params = {"Key": probe, "Body": b"probe", "IfNoneMatch": "*"}
        try:
            try:
                # A refusal here can only be our own first write, re-sent after a lost answer.
                await conn.request("put_object", op="probe", key=None, where=where, **put)
                await conn.request("put_object", op="probe", key=None, where=where, **put)
                strategy = "fallback"
            except ObjectExists:
                strategy = "native"
        finally:
            try:
                await conn.request("delete_object", op="delete", key=None, where=where, Key=probe)
            except Exception as exc:  # noqa: BLE001 - a stray probe object is harmless
                logger.warning("could not delete probe object %s: %s", probe, exc)
        return strategy

    async def _fallback_create(
        self, key: str, phys: str, views: Sequence[memoryview], size: int, token: str
    ) -> ObjectInfo:
        """The multipart claim protocol (module docstring) for a body held in memory."""
        upload_id = await self.claim(key, phys, token)
        return await self._finish_upload(key, phys, upload_id, views, size, True, token)

    async def claim(self, key: str, phys: str, token: str, *, required: bool = True) -> str:
        """Steps (1)-(4) of the claim protocol (module docstring): returns the id of a multipart
        upload of ``phys`` that no other non-stale creator's upload preceded, the key not
        existing (``ObjectExists`` otherwise). Contention is retried with backoff until the
        retry deadline (then ``RetriesExhausted``). The caller owns the upload: it completes it
        with ``If-None-Match: *`` or aborts it. ``required=False`` (a server known to honour
        the header): where ListMultipartUploads is not implemented, the upload is returned
        without the rival check instead of failing."""
        retry = self.conn.options.retry
        loop = asyncio.get_running_loop()
        deadline = loop.time() + retry.deadline
        rounds = 0
        while True:
            rounds += 1
            await self.refuse_existing(key, phys)
            if self.conn.lists_uploads is False and required:
                raise self._no_exclusive_create(key)
            upload_id = await self.create_upload(key, phys, token)
            try:
                rivals = await self._rivals(key, phys, upload_id, required)
                if not rivals:
                    await self.refuse_existing(key, phys)
                    return upload_id
            except BaseException:
                self.abort_later(key, phys, upload_id)
                raise
            await self.abort(key, phys, upload_id)
            delay = random.uniform(0.0, min(retry.max_delay, retry.base_delay * 2**rounds))
            if loop.time() + delay >= deadline:
                raise RetriesExhausted(
                    f"create {self.where}/{key}: concurrent creates kept colliding",
                    key=key,
                    operation="put",
                    attempts=rounds,
                )
            logger.info(
                "create %s/%s: %d concurrent creators, retrying in %.2fs",
                self.where,
                key,
                len(rivals),
                delay,
            )
            await asyncio.sleep(delay)

    async def _rivals(
        self, key: str, phys: str, upload_id: str, required: bool
    ) -> list[UploadInfo]:
        """The other unfinished, non-stale uploads of ``phys`` (step 3)."""
        if self.conn.lists_uploads is False:
            return []
        try:
            listed = await self.list_uploads(phys, strip=0)
        except StorageError as exc:
            if not is_not_implemented(exc):
                raise
            self.conn.lists_uploads = False
            if required:
                raise self._no_exclusive_create(key) from exc
            return []
        uploads = [u for u in listed if u.key == phys]
        mine = next((u.initiated for u in uploads if u.upload_id == upload_id), None)
        return [
            u
            for u in uploads
            if u.upload_id != upload_id
            and not (
                mine is not None and u.initiated is not None and mine - u.initiated > STALE_UPLOAD_S
            )
        ]

    async def refuse_existing(self, key: str, phys: str) -> None:
        """``ObjectExists`` if ``phys`` exists (one HEAD)."""
        if await self.head(key, phys) is not None:
            raise ObjectExists(
                f"create {self.where}/{key}: the object already exists", key=key, operation="put"
            )

    def _no_exclusive_create(self, key: str) -> StorageError:
        return StorageError(
            f"create {self.where}/{key}: the server ignores If-None-Match and does not implement "
            "ListMultipartUploads, so no create can be exclusive; use a server that supports "
            "either",
            key=key,
            operation="put",
        )
