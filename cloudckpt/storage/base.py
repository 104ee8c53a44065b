"""The ``ObjectStore`` protocol and the small value types every backend shares.

Contracts common to all backends:
- Keys are relative to the store's root URL, ``/``-separated, with no empty, ``.`` or ``..``
  component and no leading ``/``; a bad key raises ``ConfigError`` before any request.
- Bodies are any C-contiguous buffer (bytes, bytearray, memoryview, numpy array, ...) or a sequence
  of them (concatenated). They are read in place, never copied into one big buffer.
- Every error is a ``cloudckpt.errors`` class; see ``cloudckpt.storage.errors_map`` for S3.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, TypeVar, runtime_checkable

from cloudckpt.checksum import Buffer
from cloudckpt.errors import ConfigError, StorageError

if TYPE_CHECKING:
    from typing_extensions import Self

T = TypeVar("T")

PutMode = Literal["overwrite", "create"]
#: Any C-contiguous buffer, or a sequence of them (concatenated).
Body: TypeAlias = "Buffer | Sequence[Buffer]"


@dataclass(frozen=True)
class ObjectInfo:
    """One stored object: key relative to the store root, size in bytes, etag, mtime (epoch s)."""

    key: str
    size: int
    etag: str | None = None
    last_modified: float | None = None


@dataclass(frozen=True)
class WholeChecksum:
    """A checksum the store holds of a whole object's bytes (``ObjectStore.whole_checksum``):
    ``kind`` ``"crc32c"`` (``value`` an int: S3's full-object ``x-amz-checksum-crc32c``) or
    ``"md5"`` (``value`` 16 bytes: the ETag of an unencrypted single-part upload); ``size`` the
    object's size when the store answered."""

    kind: Literal["crc32c", "md5"]
    value: int | bytes
    size: int


@dataclass(frozen=True)
class CommonPrefix:
    """A group of keys rolled up by a listing delimiter (relative to the store root)."""

    prefix: str


@dataclass(frozen=True)
class UploadInfo:
    """An unfinished upload (S3 multipart upload, or a LocalStore temporary file)."""

    key: str
    upload_id: str
    initiated: float | None = None


@dataclass(frozen=True)
class ReadRange:
    """``length`` bytes at ``offset`` of one object. ``out`` (exactly ``length`` bytes, writable)
    receives them if given; ``crc32c`` is verified when given.

    ``sinks`` (instead of ``out``; needs ``crc32c``): ``(position, view)`` pairs; bytes
    ``[position, position + len(view))`` of the range are copied into ``view`` only after the
    whole range has been verified. A sink of a range that fails verification keeps its previous
    contents, so sinks may be a caller's final destination (a tensor's memory) while ``out`` is
    written as bytes arrive, before verification.
    """

    offset: int
    length: int
    out: memoryview | None = None
    crc32c: int | None = None
    sinks: tuple[tuple[int, memoryview], ...] = ()


@dataclass
class StoreStats:
    """Counters of a store (shared by its children). ``requests`` counts every request sent,
    retries included, per operation name; ``retries`` counts attempts after the first."""

    requests: dict[str, int] = field(default_factory=dict)
    bytes_sent: int = 0
    bytes_received: int = 0
    retries: int = 0

    def count(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())

    def reset(self) -> None:
        self.requests.clear()
        self.bytes_sent = self.bytes_received = self.retries = 0


@runtime_checkable
class ObjectWriter(Protocol):
    """One object written as a stream (:meth:`ObjectStore.open_writer`), with memory bounded by
    the store, not by the object's size. One call at a time.

    - ``write(body)``: appends ``body`` (a buffer or a sequence of buffers, as for ``put``);
      the bytes are taken (copied or written out) before it returns, so the caller may reuse
      its buffers at once. It may wait for room (parts in flight) and may already send them.
    - ``commit()``: publishes everything written under the key, at once: before it returns
      nothing is visible there (readers see the previous object, or none). In ``create`` mode
      ``ObjectExists`` (from ``commit``, or from a ``write`` once the stream is long enough to
      be sent in parts) when the key exists, which is left untouched; exactly one of several
      concurrent creates of a key, streams and puts alike, wins (S3's limits: see
      ``cloudckpt.storage.s3.stream``). Returns the object's ``ObjectInfo`` (size and etag).
    - ``abort()``: drops what was written (idempotent; nothing to do after ``commit``). Any
      failure of ``write`` or ``commit``, cancellation included, aborts the stream itself;
      later calls raise ``StorageError``. An abort that cannot reach the store leaves an
      unfinished upload, which ``list_uploads`` / ``abort_upload`` find.
    - ``async with store.open_writer(key) as w:`` aborts on leaving unless committed.
    - ``size``: bytes written so far.
    """

    key: str
    size: int

    async def write(self, body: Body) -> None: ...

    async def commit(self) -> ObjectInfo: ...

    async def abort(self) -> None: ...

    async def __aenter__(self) -> ObjectWriter: ...

    async def __aexit__(self, *exc: object) -> None: ...


class WriterState:
    """The life cycle the backends' ``ObjectWriter``s share: ``open`` -> ``committed`` or
    ``aborted``; ``async with`` aborts unless committed. Subclasses define ``abort``."""

    def __init__(self, key: str, where: str, size_hint: int | None):
        if size_hint is not None and (type(size_hint) is not int or size_hint < 0):
            raise ConfigError(f"size_hint must be None or an integer >= 0, got {size_hint!r}")
        self.key = key
        self.where = where
        self.size = 0
        self.state = "open"

    def check_open(self, op: str) -> None:
        """``StorageError`` unless the stream is still open."""
        if self.state != "open":
            raise StorageError(
                f"{op} {self.where}/{self.key}: the stream is {self.state}",
                key=self.key,
                operation=op,
            )

    async def abort(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self.state != "committed":
            await self.abort()


@runtime_checkable
class ObjectStore(Protocol):
    """An async object store rooted at ``url``. Bound to the event loop it is first used on.

    Besides ``url`` and ``stats``, a store states what it is, so that layers above storage ask
    it instead of parsing its URL or testing its type (capabilities are fixed for a store's life
    and the same for its children):

    - ``remote``: its requests cross a network and cost per request (S3): a region that several
      ranks need is better fetched by one and broadcast (the default of ``LoadOptions.broadcast``).
      False where reads are cheap local I/O (``LocalStore``).
    - ``local_root``: the directory of this machine's filesystem that holds the objects, as files
      named by their keys (``LocalStore``); None when the objects are not files here (S3).
    """

    url: str
    stats: StoreStats

    @property
    def remote(self) -> bool: ...

    @property
    def local_root(self) -> str | None: ...

    async def put(self, key: str, body: Body, *, mode: PutMode = "overwrite") -> ObjectInfo:
        """Store ``body`` under ``key``. ``create`` raises ``ObjectExists`` if the key exists
        (exactly one of several concurrent creates wins). Large bodies go multipart."""

    def open_writer(
        self, key: str, *, mode: PutMode = "overwrite", size_hint: int | None = None
    ) -> ObjectWriter:
        """A stream that writes ``key`` (see ``ObjectWriter``); nothing is sent before the first
        ``write`` or ``commit``. Memory: a LocalStore stream writes each ``write`` to a
        temporary file (no buffer of its own); an S3Store stream holds about ``part x
        (concurrency + 1)`` (``cloudckpt.storage.s3.stream``). ``size_hint``: the expected size
        (S3 picks its part size from it; a LocalStore reserves the space); a hint, not a limit.
        ``mode`` as for ``put``; a bad key or mode raises ``ConfigError`` here."""

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole object (``ObjectNotFound`` if missing). For large objects prefer
        ``read_ranges`` with destination buffers. With ``max_bytes``, an object larger than
        that raises ``ObjectTooLarge`` before its body is read."""

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        """One view per range, in order (the range's ``out`` when given, an empty view for a range
        with ``sinks``). Close ranges are coalesced, others fetched concurrently; a range with
        ``crc32c`` is verified and a mismatch raises ``ChecksumError``; a range past the end
        raises ``InvalidRange``. Sinks are written only with verified bytes."""

    async def head(self, key: str) -> ObjectInfo:
        """Size and etag of ``key`` (``ObjectNotFound`` if missing)."""

    async def whole_checksum(self, key: str) -> WholeChecksum | None:
        """The checksum the store holds of all of ``key``'s bytes, None when it holds none
        (``ObjectNotFound`` if missing): S3's full-object CRC32C when the object was stored
        with one, else the MD5 of an unencrypted single-part upload (its ETag); never a
        multipart or composite value, never one computed by reading the object. A LocalStore
        holds none."""

    def list(
        self, prefix: str = "", *, delimiter: str | None = None
    ) -> AsyncIterator[ObjectInfo | CommonPrefix]:
        """Keys (relative to the root) starting with ``prefix``, in lexicographic order; with a
        delimiter, keys containing it after the prefix are rolled up into ``CommonPrefix``."""

    async def delete(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (batched); missing keys are fine."""

    async def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        """Unfinished uploads whose key starts with ``prefix``."""

    async def abort_upload(self, upload: UploadInfo) -> None:
        """Abort (remove) an unfinished upload; an already gone upload is fine."""

    async def close(self) -> None:
        """Release connections and threads (idempotent). A child's close does nothing."""

    def child(self, prefix: str) -> ObjectStore:
        """A store rooted at ``prefix`` under this one, sharing connections, limits and stats."""


# --- helpers shared by the backends --------------------------------------------------------------


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid relative object key, else raise ``ConfigError``."""
    if not isinstance(key, str) or not key:
        raise ConfigError(f"invalid object key {key!r}: must be a non-empty string")
    if key.startswith("/") or "\\" in key or "\x00" in key:
        raise ConfigError(f"invalid object key {key!r}")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise ConfigError(f"invalid object key {key!r}: empty, '.' or '..' component")
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing / child prefix: like a key, but empty and a trailing ``/`` are fine."""
    if prefix == "":
        return prefix
    check_key(prefix.removesuffix("/"))
    return prefix


def as_views(body: Body) -> list[memoryview]:
    """The body as a list of flat byte views (no copy). Raises ``ConfigError`` for non-buffers or
    non-contiguous buffers."""
    parts: Sequence[object] = body if isinstance(body, (list, tuple)) else [body]
    views = []
    for part in parts:
        try:
            # any buffer (numpy's stubs give arrays no __buffer__ before Python 3.12); anything
            # else raises TypeError here
            mv = part if isinstance(part, memoryview) else memoryview(part)  # type: ignore[arg-type]
        except TypeError as exc:
            raise ConfigError(f"body of type {type(part).__name__} is not a buffer") from exc
        if not mv.c_contiguous:
            raise ConfigError("body buffers must be C-contiguous")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if len(mv):
            views.append(mv)
    return views


def slice_views(views: Sequence[memoryview], start: int, stop: int) -> list[memoryview]:
    """Views covering bytes ``[start, stop)`` of the concatenation of ``views`` (no copy)."""
    out: list[memoryview] = []
    pos = 0
    for mv in views:
        end = pos + len(mv)
        if end > start and pos < stop:
            out.append(mv[max(start - pos, 0) : min(stop, end) - pos])
        if end >= stop:
            break
        pos = end
    return out


def check_ranges(ranges: Sequence[ReadRange]) -> list[memoryview | None]:
    """Validate ranges; return each range's ``out`` as a flat writable byte view (or None)."""
    outs: list[memoryview | None] = []
    for r in ranges:
        if r.offset < 0 or r.length < 0:
            raise ConfigError(f"bad read range offset={r.offset} length={r.length}")
        if r.sinks:
            if r.out is not None or r.crc32c is None:
                raise ConfigError("ReadRange.sinks need crc32c and exclude out")
            for pos, view in r.sinks:
                if (
                    not isinstance(view, memoryview)
                    or view.readonly
                    or view.format != "B"
                    or view.ndim != 1
                    or pos < 0
                    or pos + len(view) > r.length
                ):
                    raise ConfigError(
                        "a ReadRange sink must be a writable flat byte view inside the range"
                    )
        if r.out is None:
            outs.append(None)
            continue
        mv = r.out if isinstance(r.out, memoryview) else memoryview(r.out)
        if mv.readonly or not mv.c_contiguous:
            raise ConfigError("ReadRange.out must be a writable C-contiguous buffer")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if len(mv) != r.length:
            raise ConfigError(f"ReadRange.out holds {len(mv)} bytes, the range {r.length}")
        outs.append(mv)
    return outs


class ByteBudget:
    """An async counting limit on bytes held by a store (first come, first served).

    ``acquire(n)`` waits until ``n`` more bytes fit under ``limit``; a request larger than the
    limit is clipped to it (it then waits until it holds the whole budget alone). A holder must
    not acquire again before releasing (FIFO order would make it wait behind waiters that wait
    for it); ``acquire(0)`` never waits.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def clip(self, n: int) -> int:
        return min(max(n, 0), self.limit)

    async def acquire(self, n: int) -> int:
        """Take ``clip(n)`` bytes; returns the amount to pass to ``release``."""
        n = self.clip(n)
        if n == 0:
            return 0
        if not self._waiters and self.used + n <= self.limit:
            self._take(n)
            return n
        fut = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self._waiters.append(entry)
        try:
            await fut
        except BaseException:
            if entry in self._waiters:
                self._waiters.remove(entry)
            elif fut.done() and not fut.cancelled():
                self.release(n)  # granted just as we were cancelled
            raise
        return n

    def try_acquire(self, n: int) -> int | None:
        """Take ``clip(n)`` bytes if that needs no waiting (and nobody waits); else None."""
        n = self.clip(n)
        if n == 0 or (not self._waiters and self.used + n <= self.limit):
            self._take(n)
            return n
        return None

    def _take(self, n: int) -> None:
        self.used += n
        self.peak = max(self.peak, self.used)

    def release(self, n: int) -> None:
        self.used -= n
        while self._waiters and self.used + self._waiters[0][0] <= self.limit:
            size, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._take(size)
            fut.set_result(None)


async def run_all(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Run coroutines concurrently; on the first failure cancel the others and raise it.
    Returns the results in order."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            failure = None if t.cancelled() else t.exception()
            if failure is not None:
                raise failure
        return [t.result() for t in tasks]
    finally:
        unfinished = [t for t in tasks if not t.done()]
        for t in unfinished:
            t.cancel()
        if unfinished:
            await asyncio.gather(*unfinished, return_exceptions=True)
