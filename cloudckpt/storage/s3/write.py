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
  key does not exist, (5) uploads the parts, checks once more that the key does not exist
  (a completion that is not atomic, as moto's, can hide the earlier creator from (3) and (4)),
  and completes (with ``If-None-Match: *``). Two creators
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

from cloudckpt.errors import (
    AccessDenied,
    ConfigError,
    ObjectExists,
    RetriesExhausted,
    StorageError,
)
from cloudckpt.storage.base import ObjectInfo, UploadInfo
from cloudckpt.storage.options import MAX_PUT_SIZE
from cloudckpt.storage.s3.errors import is_not_implemented
from cloudckpt.storage.s3.shapes import S3Params
from cloudckpt.storage.s3.uploads import S3Uploads

logger = logging.getLogger("cloudckpt.storage")

#: Unfinished uploads older than this (relative to ours, server clock) do not block a create.
STALE_UPLOAD_S = 900.0


class S3Writer(S3Uploads):
    """The writes of one store (``S3Uploads``' steps, composed): ``put`` and the conditional
    create of the module docstring (its strategy probe and claim protocol)."""

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

    def _no_exclusive_create(self, key: str) -> StorageError:
        return StorageError(
            f"create {self.where}/{key}: the server ignores If-None-Match and does not implement "
            "ListMultipartUploads, so no create can be exclusive; use a server that supports "
            "either",
            key=key,
            operation="put",
        )
