"""``S3ObjectWriter``: one object written as a stream (``S3Store.open_writer``), holding a few
parts in memory whatever the object's size. Requests go through ``S3Writer`` (so through
``S3Connection.call``: slots, retries, deadlines, as every request).

Contract (beyond ``cloudckpt.storage.base.ObjectWriter``):

- Memory. Written bytes are copied into part buffers of ``part_size`` bytes
  (``options.choose_part_size(size_hint)``: the store's ``part_size``, else 16 MiB, raised so that
  ``size_hint`` fits in S3's 10,000 parts; without a hint a stream longer than 10,000 parts
  fails with ``ConfigError``). A full buffer is sent as a part once more bytes arrive, at most
  ``options.concurrency`` parts of a stream in flight, each holding its size of the store's
  byte budget (``max_buffer_bytes``, shared with reads) until the server has it; a ``write``
  waits while there is no room (the wait for the budget counts against the retry deadline).
  A buffer back from the server is kept for a later part, so a stream allocates at most one
  buffer more than it ever had in flight: at most about ``part_size x (concurrency + 1)``
  whatever the object's size (less where ``max_buffer_bytes`` lets fewer parts fly), released at
  ``commit`` / ``abort``. Only parts in flight count against the budget: an idle stream (its
  buffer being filled, the kept ones) never makes the store's reads wait.
- A stream that ends within its first buffer (one part; a buffer of ``size_hint`` bytes when
  that is smaller) is one ``S3Writer.put``: a PutObject (``create``: with ``If-None-Match: *``,
  or the fallback protocol on servers that ignore it), exactly as ``store.put``.
- A longer stream is a multipart upload, started when its first part is sent. ``overwrite``:
  completed plainly. ``create``: the key is claimed first (``S3Writer.claim``, the multipart
  claim protocol of :mod:`cloudckpt.storage.s3.write`; ``ObjectExists`` from that ``write``
  when the key exists), and the claim is held for as long as the stream streams: a concurrent
  stream or fallback create of the key backs off meanwhile and gets ``ObjectExists`` once this
  one completes (or ``RetriesExhausted`` if the stream outlasts its retry deadline). The commit
  checks once more that the key does not exist, then completes with ``If-None-Match: *``; a
  412 there is told from a lost answer to our own completion by the object's token, else
  ``ObjectExists`` (the upload aborted). A native create put (one PutObject) of the same key does
  not look at claims: the check before the completion and the header on it refuse the stream
  then (on a server that ignores the header on CompleteMultipartUpload only, such as Ceph RGW
  16, a put landing between those two requests would be written over).
- Claims older than ``STALE_UPLOAD_S`` (15 minutes) are taken for crashed creators: a create
  stream that takes longer than that from its first part to its commit can be joined by a
  second creator, and then only the header on the completion keeps one of them out.
- Failure. Any failure or cancellation of ``write`` or ``commit`` cancels the parts in flight and
  aborts the multipart upload once they have stopped (in the background, so it happens even
  when the caller is cancelled; the store's ``close`` waits for it). ``abort`` does the same
  and waits for it.
"""

from __future__ import annotations

import asyncio
import secrets

import numpy as np

from cloudckpt.errors import ConfigError
from cloudckpt.storage.base import Body, ObjectInfo, WriterState, as_views
from cloudckpt.storage.options import MAX_PARTS, choose_part_size
from cloudckpt.storage.s3.shapes import CompletedPart
from cloudckpt.storage.s3.write import S3Writer


def _buffer(nbytes: int) -> memoryview:
    """Uninitialised memory (pages become resident only as they are written)."""
    return np.empty(nbytes, dtype=np.uint8).data


class S3ObjectWriter(WriterState):
    """See the module docstring. Made by ``S3Store.open_writer``: ``key`` is the store-relative
    key, ``phys`` the key in the bucket."""

    def __init__(
        self, writer: S3Writer, key: str, phys: str, *, create: bool, size_hint: int | None = None
    ):
        super().__init__(key, writer.where, size_hint)
        self._w = writer
        self._conn = writer.conn
        self._phys = phys
        self._create = create
        self.part_size = choose_part_size(size_hint or 0, self._conn.options.part_size)
        self._first = (
            self.part_size if size_hint is None else max(1, min(size_hint, self.part_size))
        )
        self._token = secrets.token_hex(12)
        self._buf: memoryview | None = None
        self._fill = 0
        self._spare: list[memoryview] = []  # part buffers back from the server, for reuse
        self._upload_id: str | None = None
        self._parts = 0  # parts handed to an upload task
        self._entries: dict[int, CompletedPart] = {}  # part number -> its completion entry
        self._tasks: list[asyncio.Task[None]] = []
        self._room = asyncio.Semaphore(self._conn.options.concurrency)
        self._error: BaseException | None = None
        self._aborting: asyncio.Task[None] | None = None

    # --- the stream -----------------------------------------------------------------------------

    async def write(self, body: Body) -> None:
        self.check_open("write")
        views = as_views(body)
        try:
            for v in views:
                pos = 0
                while pos < len(v):
                    buf = self._buf
                    if buf is None:
                        buf = self._buf = self._new_buffer()
                    elif self._fill == len(buf):
                        await self._make_room(buf)
                        continue
                    n = min(len(v) - pos, len(buf) - self._fill)
                    buf[self._fill : self._fill + n] = v[pos : pos + n]
                    self._fill += n
                    pos += n
                    self.size += n
        except BaseException as exc:
            await self._fail(exc)
            raise

    async def commit(self) -> ObjectInfo:
        self.check_open("commit")
        try:
            if self._parts == 0:
                buf = self._buf
                views = [buf[: self._fill]] if self._fill and buf is not None else []
                info = await self._w.put(self.key, self._phys, views, self._create)
            elif self._upload_id is None:  # parts were sent, so the upload exists
                raise AssertionError("a multipart stream without an upload id")
            else:
                if self._fill:
                    await self._send_part()
                await asyncio.gather(*self._tasks)
                self._raise_part_error()
                parts = [self._entries[i] for i in range(1, self._parts + 1)]
                info = await self._w.complete(
                    self.key,
                    self._phys,
                    self._upload_id,
                    parts,
                    self.size,
                    self._create,
                    self._token,
                )
        except BaseException as exc:
            await self._fail(exc)
            raise
        self.state = "committed"
        self._buf = None
        self._spare.clear()
        return info

    async def abort(self) -> None:
        if self.state == "committed":
            return
        self._abort_now()
        if self._aborting is not None:
            await asyncio.shield(self._aborting)

    # --- parts ----------------------------------------------------------------------------------

    def _new_buffer(self) -> memoryview:
        if self._parts == 0:
            return _buffer(self._first)
        return self._spare.pop() if self._spare else _buffer(self.part_size)

    async def _make_room(self, buf: memoryview) -> None:
        """The buffer ``buf`` is full and more bytes come: grow a first buffer sized by the hint,
        else send the buffer as a part."""
        if len(buf) < self.part_size:
            bigger = _buffer(self.part_size)
            bigger[: self._fill] = buf[: self._fill]
            self._buf = bigger
            return
        await self._send_part()

    async def _send_part(self) -> None:
        """Hand the buffer to an upload task once there is room (at most ``concurrency`` parts
        in flight, each within the byte budget)."""
        if self._parts >= MAX_PARTS:
            raise ConfigError(
                f"write {self.where}/{self.key}: the stream is longer than "
                f"{MAX_PARTS} parts of {self.part_size} bytes; give open_writer a "
                "size_hint or the store a larger part_size"
            )
        if self._upload_id is None:
            self._upload_id = await self._start()
        upload_id = self._upload_id
        await self._room.acquire()
        try:
            self._raise_part_error()
            self.check_open("write")
            conn = self._conn
            held = await conn.reserve(
                self._fill,
                op="upload_part",
                key=self.key,
                where=self.where,
                deadline=conn.deadline(),
            )
        except BaseException:
            self._room.release()
            raise
        self._parts += 1
        buf, fill, self._buf, self._fill = self._buf, self._fill, None, 0
        if buf is None:  # only a filled buffer is sent
            raise AssertionError("a part without a buffer")
        self._tasks = [t for t in self._tasks if not t.done()]
        part = self._upload(upload_id, self._parts, buf, fill, held)
        self._tasks.append(asyncio.ensure_future(part))

    async def _start(self) -> str:
        """Start the multipart upload; in create mode, claim the key first."""
        if not self._create:
            return await self._w.create_upload(self.key, self._phys, self._token)
        strategy = await self._w.create_strategy(self._phys)
        return await self._w.claim(
            self.key, self._phys, self._token, required=strategy == "fallback"
        )

    async def _upload(
        self, upload_id: str, number: int, buf: memoryview, fill: int, held: int
    ) -> None:
        """Send ``buf[:fill]`` as part ``number``; then the buffer serves a later part, so a
        stream allocates at most one buffer more than it ever had in flight, however late the
        garbage collector frees the request objects that saw it."""
        try:
            self._entries[number] = await self._w.upload_part(
                self.key, self._phys, upload_id, number, [buf[:fill]]
            )
            if len(buf) == self.part_size and self.state == "open":
                self._spare.append(buf)
        except Exception as exc:  # noqa: BLE001 - raised by the stream's next call
            if self._error is None:
                self._error = exc
        finally:
            self._conn.budget.release(held)
            self._room.release()

    def _raise_part_error(self) -> None:
        if self._error is not None:
            raise self._error

    # --- failure --------------------------------------------------------------------------------

    def _abort_now(self) -> None:
        """Stop the stream: cancel the parts in flight, then abort the upload in the
        background (idempotent)."""
        if self.state == "aborted":
            return
        self.state = "aborted"
        self._buf = None
        self._spare.clear()
        for task in self._tasks:
            task.cancel()
        if self._upload_id is not None:
            self._aborting = self._w.abort_later(
                self.key, self._phys, self._upload_id, after=self._tasks
            )

    async def _fail(self, exc: BaseException) -> None:
        """After a failed ``write`` / ``commit``: abort, and wait for the abort unless the
        caller is being cancelled (then it finishes in the background)."""
        self._abort_now()
        if self._aborting is not None and not isinstance(exc, asyncio.CancelledError):
            await asyncio.shield(self._aborting)
