"""The upload steps of an S3 store (``S3Uploads``, the base of ``s3_write.S3Writer``): single
puts, multipart uploads part by part (``create_upload``, ``upload_part``, ``complete``), aborts
(also in the background after a failure), HEADs and the upload listing. Every request is one
``S3Connection.request`` (slots, retries, deadline, logging, error translation).

A put or an upload carries the token ``x-amz-meta-cloudckpt-put`` (:data:`TOKEN_META`): after a
412 or a completion retry's NoSuchUpload, :meth:`S3Uploads._own_object` tells our own success
whose answer was lost from someone else's object (one HEAD, only on that path).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from cloudckpt.checksum import crc32c
from cloudckpt.errors import ObjectExists, ObjectNotFound
from cloudckpt.storage.base import ObjectInfo, UploadInfo, run_all, slice_views
from cloudckpt.storage.options import choose_part_size
from cloudckpt.storage.s3.client import crc32c_b64
from cloudckpt.storage.s3.conn import S3Connection
from cloudckpt.storage.s3.shapes import CompletedPart, S3Answer, S3Params

logger = logging.getLogger("cloudckpt.storage")

TOKEN_META = "cloudckpt-put"
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


class S3Uploads:
    """The upload steps of one store: ``where`` is its URL (for messages). Methods take the
    store-relative ``key`` (messages, stats) and the physical key ``phys`` in the bucket."""

    def __init__(self, conn: S3Connection, where: str):
        self.conn = conn
        self.where = where

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
            # a claimed upload (a put or a stream): one more HEAD once the parts are up: a
            # server whose completion is not atomic (moto drops the upload from its listing
            # before the object appears) can let a later creator pass the claim inside that
            # window; this HEAD sees the earlier creator's object by then
            await self.refuse_existing(key, phys)
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

    async def refuse_existing(self, key: str, phys: str) -> None:
        """``ObjectExists`` if ``phys`` exists (one HEAD)."""
        if await self.head(key, phys) is not None:
            raise ObjectExists(
                f"create {self.where}/{key}: the object already exists", key=key, operation="put"
            )

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
