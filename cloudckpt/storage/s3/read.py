"""Reads of S3Store (``S3Reader``): head, whole-object gets and ranged reads (coalesced, split into
pieces fetched concurrently, resumed where a broken body stopped, verified by
``verified.read_verified``). Every request goes through ``S3Connection.call``; memory the store
allocates comes from its byte budget (``S3Connection.reserve``), under the operation's deadline.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Sequence

import aiohttp
from botocore.exceptions import ClientError

from cloudckpt.errors import ObjectTooLarge
from cloudckpt.http_numbers import http_int
from cloudckpt.storage.base import ObjectInfo, ReadRange, run_all
from cloudckpt.storage.ranges import HeldRange, Piece, Scatter, plan_pieces
from cloudckpt.storage.s3.answers import (
    BadAnswer,
    check_answer,
    drop_stale_connections,
    parse_content_range,
)
from cloudckpt.storage.s3.client import iter_body
from cloudckpt.storage.s3.conn import S3Connection
from cloudckpt.storage.s3.errors import TruncatedBody, error_code, is_bare_403
from cloudckpt.storage.s3.exchange import Cursor, UseBotocore
from cloudckpt.storage.s3.shapes import ListedObject, S3Answer, S3Client
from cloudckpt.storage.verified import read_verified

logger = logging.getLogger("cloudckpt.storage")

#: Largest single GET of a ranged read when ``part_size`` is not set (32 MiB GETs cost the client
#: ~15% less CPU per byte than 16 MiB ones against SeaweedFS here, at the same server cost).
READ_PIECE = 32 * 1024 * 1024


def object_info(key: str, size: int | None, resp: S3Answer | ListedObject) -> ObjectInfo:
    """The ``ObjectInfo`` of a HeadObject answer or a listing entry."""
    modified = resp.get("LastModified")
    return ObjectInfo(
        key=key,
        size=int(size or 0),
        etag=resp.get("ETag"),
        last_modified=modified.timestamp() if modified is not None else None,
    )


class S3Reader:
    """The reads of one store: ``where`` is its URL (for messages). Methods take the
    store-relative ``key`` (messages, stats) and the physical key ``phys`` in the bucket."""

    def __init__(self, conn: S3Connection, where: str):
        self.conn = conn
        self.where = where
        self.piece = conn.options.part_size or READ_PIECE

    async def head(self, key: str, phys: str) -> ObjectInfo:
        conn = self.conn

        async def attempt(n: int) -> ObjectInfo:
            await conn.client()  # made here, outside _parsed: its errors are not answers
            try:
                resp = await _parsed(conn.send("head_object", Key=phys), f"{self.where}/{key}")
            except ClientError as exc:
                if is_bare_403(exc):
                    raise await self._reason_of_403(phys, exc) from None
                raise
            return object_info(key, resp.get("ContentLength", 0), resp)

        return await conn.call("head", key, attempt, where=self.where)

    async def _reason_of_403(self, phys: str, refused: ClientError) -> ClientError:
        """A HEAD's 403 carries no error code (no body), so one GET of the object's first byte
        asks why: its 403 names the cause (``SignatureDoesNotMatch``, ``InvalidAccessKeyId``,
        ``AccessDenied``...). Returns that error, or ``refused`` when the GET says nothing
        more. Only on this failure path; the GET counts in ``stats`` as a ``get``."""
        self.conn.stats.count("get")
        try:
            resp = await self.conn.send("get_object", Key=phys, Range="bytes=0-0")
        except ClientError as exc:
            status = error_code(exc)[1]
            return exc if status == 403 and not is_bare_403(exc) else refused
        except Exception:  # noqa: BLE001 - the diagnosis is best effort; the HEAD's 403 stands
            return refused
        with contextlib.suppress(Exception):
            resp["Body"].close()
        return refused

    async def get(self, key: str, phys: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object. The first GET asks for one read piece (32 MiB or ``part_size``); a
        larger object's rest is fetched in concurrent ranged GETs into one buffer, then copied
        once into the returned ``bytes``: budgeted at twice its size (clipped to the budget).
        Memory comes from the byte budget before any request slot, so gets and ranged reads
        cannot deadlock; when the budget has no room for a large object at once, its first piece
        is dropped while waiting (and fetched again) rather than held outside the budget. Every
        wait and request counts against one deadline. For large objects, ``read_ranges`` into a
        caller buffer needs no store memory at all. With ``max_bytes``, an object larger than
        that raises ``ObjectTooLarge`` as soon as the first answer's headers give its size,
        before its body is read (and the first GET asks for at most ``max_bytes + 1``)."""
        conn = self.conn
        budget = conn.budget
        deadline = conn.deadline()
        first = self.piece
        if max_bytes is not None:
            first = max(1, min(first, max_bytes + 1))
        held = await conn.reserve(first, op="get", key=key, where=self.where, deadline=deadline)
        try:
            chunks, total = await self._get_first(key, phys, first, deadline, max_bytes)
            got = sum(len(c) for c in chunks)
            if got == total:
                return b"".join(chunks)
            # A large object: room for it and its copy, then the rest in parallel pieces.
            more = budget.try_acquire(budget.clip(2 * total) - held)
            if more is not None:
                held += more
            else:
                budget.release(held)
                held = 0
                chunks, got = [], 0
                held = await conn.reserve(
                    2 * total, op="get", key=key, where=self.where, deadline=deadline
                )
            buf = bytearray(total)
            view = memoryview(buf)
            pos = 0
            for c in chunks:
                view[pos : pos + len(c)] = c
                pos += len(c)
            del chunks
            await self._fetch_into(key, phys, [got], [total - got], [view[got:]], deadline=deadline)
            return bytes(buf)
        finally:
            budget.release(held)

    async def _get_first(
        self, key: str, phys: str, first: int, deadline: float, max_bytes: int | None = None
    ) -> tuple[list[bytes], int]:
        """The first ``first`` bytes of the object (as chunks) and its total size
        (``ObjectTooLarge``, the body unread, when that is over ``max_bytes``)."""
        conn = self.conn

        async def attempt(n: int) -> tuple[list[bytes], int]:
            client = await conn.client()
            drop_stale_connections(client)
            try:
                resp = await _parsed(
                    conn.send("get_object", Key=phys, Range=f"bytes=0-{first - 1}"),
                    f"{self.where}/{key}",
                )
            except ClientError as exc:
                if error_code(exc)[1] != 416:
                    raise
                # An empty object has no byte 0: ask for all of it.
                conn.stats.count("get")
                resp = await _parsed(conn.send("get_object", Key=phys), f"{self.where}/{key}")
            body = resp["Body"]
            done = False
            try:
                length, total = self._first_answer(key, resp, first)
                if max_bytes is not None and total > max_bytes:
                    raise ObjectTooLarge(
                        f"get {self.where}/{key}: {total} bytes, more than the {max_bytes} allowed",
                        key=key,
                        operation="get",
                        size=total,
                        limit=max_bytes,
                    )
                chunks: list[bytes] = []
                got = 0
                try:
                    async for chunk in iter_body(body):
                        chunks.append(chunk)
                        got += len(chunk)
                except aiohttp.ClientPayloadError as exc:
                    raise TruncatedBody(
                        f"GET {self.where}/{key}: the body of bytes [0, {length}) "
                        f"broke after {got} bytes ({exc})"
                    ) from exc
                conn.stats.bytes_received += got
                if got != length:
                    raise TruncatedBody(
                        f"GET {self.where}/{key}: the body of bytes [0, "
                        f"{length}) ended after {got} bytes"
                    )
                done = True
                return chunks, total
            finally:
                if not done:
                    body.close()

        return await conn.call("get", key, attempt, where=self.where, deadline=deadline)

    def _first_answer(self, key: str, resp: S3Answer, first: int) -> tuple[int, int]:
        """(body length, object size) of the answer to ``get``'s first GET (bytes
        ``[0, first)``, or the whole object): a 206 for bytes ``[0, min(first, size))``, or a
        200 with the whole object; ``BadAnswer`` (retried) for any other."""
        where = f"{self.where}/{key}"
        length = http_int(resp.get("ContentLength"))
        status = _status(resp)
        if status == 200 and length is not None:
            return length, length
        crange = parse_content_range(resp.get("ContentRange"))
        total = crange[2] if crange is not None else None
        if total is not None:
            check_answer(
                status, resp.get("ContentRange"), length, 0, min(first, total), where=where, key=key
            )
            # no Content-Length (a chunked body): the Content-Range checked says how long it is
            return (length if length is not None else min(first, total)), total
        raise BadAnswer(
            f"GET {where}: asked bytes [0, {first}); the answer is HTTP {status} "
            f"with Content-Range {resp.get('ContentRange')!r} and Content-Length "
            f"{resp.get('ContentLength')!r}"
        )

    async def read_ranges(
        self, key: str, phys: str, ranges: Sequence[ReadRange]
    ) -> list[memoryview]:
        """``ObjectStore.read_ranges``: buffers for ranges with neither ``out`` nor ``sinks``
        come from the byte budget; the budget wait and the first fetch share one deadline (a
        re-read after a failed verification is a new request with its own)."""
        deadline = self.conn.deadline()
        gap = self.conn.options.coalesce_gap

        async def fetch(
            offsets: Sequence[int],
            lengths: Sequence[int],
            targets: Sequence[memoryview | HeldRange],
            *,
            reread: bool,
        ) -> None:
            await self._fetch_into(
                key,
                phys,
                offsets,
                lengths,
                targets,
                gap=0 if reread else gap,
                deadline=None if reread else deadline,
            )

        @contextlib.asynccontextmanager
        async def hold(nbytes: int) -> AsyncIterator[None]:
            held = await self.conn.reserve(
                nbytes, op="get", key=key, where=self.where, deadline=deadline
            )
            try:
                yield
            finally:
                self.conn.budget.release(held)

        return await read_verified(key, ranges, fetch, where=self.where, hold=hold)

    async def _fetch_into(
        self,
        key: str,
        phys: str,
        offsets: Sequence[int],
        lengths: Sequence[int],
        views: Sequence[memoryview | HeldRange],
        *,
        gap: int = 0,
        deadline: float | None,
    ) -> None:
        """Fetch ranges into ``views``: coalesced (within ``gap``), split into pieces of at most
        one read piece, pieces concurrently. Takes no byte budget (callers hold it)."""
        pieces = plan_pieces(offsets, lengths, gap=gap, max_piece=self.piece)
        await run_all(
            self._fetch(key, phys, p, Scatter(p, offsets, lengths, views), deadline) for p in pieces
        )

    async def _fetch(
        self, key: str, phys: str, piece: Piece, scatter: Scatter, deadline: float | None
    ) -> None:
        """GET ``piece`` into the scatter's views; a retry resumes where the last attempt
        broke. Through the direct reader (``s3_rangeget``) where it serves this client, else
        (and for the answers it leaves to botocore) through aiobotocore."""
        cursor = Cursor(piece.start)
        conn = self.conn
        getter = conn.range_getter
        retry = conn.options.retry

        async def attempt(n: int) -> None:
            client = await conn.client()
            if not await getter.usable(client):
                return await self._fetch_botocore(client, key, phys, piece, scatter, cursor)
            try:
                return await getter.fetch(
                    client,
                    conn.bucket,
                    phys,
                    cursor,
                    piece.end,
                    scatter.members,
                    read_timeout=min(retry.read_timeout, retry.attempt_timeout),
                    connect_timeout=min(retry.connect_timeout, retry.attempt_timeout),
                    where=f"{self.where}/{key}",
                )
            except UseBotocore as answer:
                refused = answer.kind
            conn.stats.count("get")
            await self._fetch_botocore(client, key, phys, piece, scatter, cursor)
            # Botocore's request got through where ours was answered in a way this reader does
            # not read (a refused presigned URL, a chunked body): this server will answer so
            # again, so this store reads through aiobotocore from now on. Answers that lie or
            # are garbled never come here (BadAnswer, retried): they turn nothing off.
            if not getter.disabled:
                getter.disable()
                logger.warning(
                    "%s: a presigned ranged GET was answered with %s where a signed "
                    "one succeeded: ranged reads go through aiobotocore from now on "
                    "for this store (StorageOptions(direct_range_reads=False) skips "
                    "the direct reader from the start)",
                    self.where,
                    refused,
                )

        await conn.call("get", key, attempt, where=self.where, deadline=deadline)

    async def _fetch_botocore(
        self, client: S3Client, key: str, phys: str, piece: Piece, scatter: Scatter, cursor: Cursor
    ) -> None:
        """One attempt of ``_fetch`` through aiobotocore, from ``cursor.pos``."""
        conn = self.conn
        stats = conn.stats
        pos = cursor.pos
        drop_stale_connections(client)
        resp = await _parsed(
            conn.send("get_object", Key=phys, Range=f"bytes={pos}-{piece.end - 1}"),
            f"{self.where}/{key}",
        )
        body = resp["Body"]
        done = False
        try:
            # exactly the bytes asked, or a retriable BadAnswer (InvalidRange: past the end)
            body_len = http_int(resp.get("ContentLength"))
            check_answer(
                _status(resp),
                resp.get("ContentRange"),
                body_len,
                pos,
                piece.end,
                where=f"{self.where}/{key}",
                key=key,
            )
            at = pos
            try:
                async for chunk in iter_body(body):
                    n_bytes = len(chunk)
                    stats.bytes_received += n_bytes
                    hi = min(at + n_bytes, piece.end)
                    if at < hi:
                        scatter.feed(
                            chunk if hi == at + n_bytes else memoryview(chunk)[: hi - at], at
                        )
                        cursor.pos = hi
                    at += n_bytes
                    if at >= piece.end:
                        break
            except aiohttp.ClientPayloadError as exc:  # resumed from ``at`` by the next attempt
                raise TruncatedBody(
                    f"GET {self.where}/{key}: the body of bytes [{piece.start}, "
                    f"{piece.end}) broke at byte {at} ({exc})"
                ) from exc
            if at < piece.end:
                raise TruncatedBody(
                    f"GET {self.where}/{key}: the body ended at byte {at} of "
                    f"[{piece.start}, {piece.end})"
                )
            if at > piece.end:
                raise BadAnswer(
                    f"GET {self.where}/{key}: asked bytes [{pos}, {piece.end}); "
                    f"the body is longer than its Content-Length"
                )
            done = body_len is not None  # a chunked body's end is unseen: close it
        finally:
            if not done:
                body.close()


async def _parsed(request: Awaitable[S3Answer], where: str) -> S3Answer:
    """The answer of an aiobotocore ``request`` (a coroutine) about the object ``where``; a
    header botocore fails to parse (a Content-Length of Unicode digits makes its ``int()``
    raise ``ValueError``) is a :class:`BadAnswer`."""
    try:
        return await request
    except (ValueError, TypeError) as exc:
        raise BadAnswer(
            f"{where}: an answer botocore could not parse ({type(exc).__name__}: {str(exc)[:100]})"
        ) from exc


def _status(resp: S3Answer) -> int:
    """The HTTP status of an aiobotocore answer (0 when it does not say)."""
    return http_int((resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")) or 0
