"""``LocalStore``: the ``ObjectStore`` protocol on a local (or network-mounted) directory.

- A put writes a temporary file next to the target (``.<name>.cloudckpt-tmp-<id>``), optionally
  fsyncs it, then renames it into place (``overwrite``) or hard-links it (``create``: ``os.link``
  fails if the name exists, so exactly one concurrent creator wins; where the filesystem has no
  hard links, an ``O_EXCL`` claim of the name followed by a rename is used instead). With
  ``fsync`` the directory is fsynced too. Readers never see a partial file.
- A stream (``open_writer``) writes a temporary file of the same kind and publishes it the same
  way at ``commit`` (:mod:`cloudckpt.storage.local.files`).
- Unfinished uploads are leftover temporary files (``list_uploads`` / ``abort_upload``).
- Blocking file I/O runs on a private thread pool of ``concurrency`` threads.
- Keys map to paths below the root; an object cannot also be a "directory" of other keys
  (``StorageError``), unlike on S3. Empty directories are pruned when their last key is deleted.
- Symlinks are followed only while they stay inside the root: an object or directory that
  leads outside it is refused (``AccessDenied``) and left out of listings, so a crafted
  checkpoint directory cannot make a load read arbitrary files. The check and the open are one
  step (see :mod:`cloudckpt.storage.local.paths`: every component is opened relative to its
  checked parent directory, never following a link): swapping a directory for a symlink while
  the store works cannot make it read, write, list or delete anything outside the root. A child
  store's root is the parent's. Only regular files are objects (a FIFO or device is not found).
- Ranged reads run ``verified.read_verified`` (a block failing its crc is read once more), and
  stats count one ``get`` per coalesced span, like S3Store, so request counts compare.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import errno
import os
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from pathlib import Path
from typing import TypeVar

import numpy as np

from cloudckpt.errors import (
    AccessDenied,
    ConfigError,
    InvalidRange,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    StorageError,
)
from cloudckpt.storage.base import (
    Body,
    CommonPrefix,
    ObjectInfo,
    PutMode,
    ReadRange,
    StoreStats,
    UploadInfo,
    as_views,
    check_key,
    check_prefix,
    run_all,
)
from cloudckpt.storage.local.files import (
    TMP_RE as _TMP_RE,
)
from cloudckpt.storage.local.files import (
    At,
    LocalObjectWriter,
)
from cloudckpt.storage.local.files import (
    link_exclusive as _link_exclusive,  # a kill-point test patches this name
)
from cloudckpt.storage.local.files import (
    object_info as _info,
)
from cloudckpt.storage.local.files import (
    unlink_quietly as _unlink_quietly,
)
from cloudckpt.storage.local.files import (
    write_temp as _write_temp,
)
from cloudckpt.storage.local.listing import list_tree, scan_uploads
from cloudckpt.storage.local.paths import Jail, read_whole
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.ranges import HeldRange, Piece, plan_pieces
from cloudckpt.storage.verified import read_verified

T = TypeVar("T")
READ_PIECE = 16 * 1024 * 1024


class _LocalShared:
    def __init__(self, options: StorageOptions):
        self.options = options
        self.stats = StoreStats()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.closed = False

    def executor(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.closed:
            raise StorageError("the store is closed")
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.options.concurrency, thread_name_prefix="cloudckpt-local"
            )
        return self.pool


class LocalStore:
    """An ``ObjectStore`` over a directory. See ``cloudckpt.storage.base.ObjectStore``."""

    remote = False  #: capabilities: see ``ObjectStore``

    def __init__(
        self,
        root: str | os.PathLike[str],
        options: StorageOptions | None = None,
        *,
        _shared: _LocalShared | None = None,
        _child: bool = False,
        _jail: Jail | None = None,
    ):
        self.root = Path(os.path.abspath(os.fspath(root)))
        self._jail = _jail or Jail(self.root)
        self._shared = _shared or _LocalShared(options or StorageOptions())
        self._child = _child
        self.options = self._shared.options
        self.stats: StoreStats = self._shared.stats
        self.url = self.root.as_uri()

    def __repr__(self) -> str:
        return f"LocalStore({self.url!r})"

    @property
    def local_root(self) -> str:
        return str(self.root)

    # --- plumbing -------------------------------------------------------------------------------

    def _parts(self, key: str) -> list[str]:
        return check_key(key).split("/")

    async def _run(self, op: str, key: str | None, fn: Callable[[], T], count: int = 1) -> T:
        """The choke point: count, run in the pool, translate OS errors. A cancelled call returns
        only once its thread is done."""
        for _ in range(count):
            self.stats.count(op)
        loop = asyncio.get_running_loop()
        name = f"{self.url}/{key}" if key else self.url
        job = loop.run_in_executor(self._shared.executor(), fn)
        try:
            try:
                return await asyncio.shield(job)
            except asyncio.CancelledError:
                # a thread cannot be stopped: wait for it, so that it never writes into a
                # caller's buffer after the caller has seen the cancellation
                await asyncio.gather(job, return_exceptions=True)
                raise
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"{op} {name}: not found", key=key, operation=op) from exc
        except FileExistsError as exc:
            raise ObjectExists(
                f"{op} {name}: the object already exists", key=key, operation=op
            ) from exc
        except PermissionError as exc:
            raise AccessDenied(f"{op} {name}: {exc.strerror}", key=key, operation=op) from exc
        except (NotADirectoryError, IsADirectoryError) as exc:
            raise StorageError(
                f"{op} {name}: a key and a key prefix collide on disk", key=key, operation=op
            ) from exc
        except OSError as exc:
            raise StorageError(f"{op} {name}: {exc}", key=key, operation=op) from exc
        finally:
            # the error's traceback holds this frame, the frame the job, the job the error:
            # without this each expected miss (a HEAD's ObjectNotFound) is a reference cycle
            del job

    def child(self, prefix: str) -> LocalStore:
        prefix = check_prefix(prefix).strip("/")
        if not prefix:
            return self
        return LocalStore(
            self.root.joinpath(*prefix.split("/")),
            _shared=self._shared,
            _child=True,
            _jail=self._jail.child(prefix.split("/")),
        )

    async def close(self) -> None:
        if self._child:
            return
        self._shared.closed = True
        pool, self._shared.pool = self._shared.pool, None
        if pool is not None:
            await asyncio.get_running_loop().run_in_executor(None, pool.shutdown)

    async def __aenter__(self) -> LocalStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- writes ---------------------------------------------------------------------------------

    async def put(self, key: str, body: Body, *, mode: PutMode = "overwrite") -> ObjectInfo:
        if mode not in ("overwrite", "create"):
            raise ConfigError(f"bad put mode {mode!r}")
        parts = self._parts(key)
        views = as_views(body)
        size = sum(len(v) for v in views)
        fsync = self.options.fsync
        jail = self._jail

        def write() -> ObjectInfo:
            for _ in range(5):  # a concurrent delete may prune the directory as we reach it
                with jail.walk(parts[:-1], create=True) as d:
                    path = At(d.fd, parts[-1])
                    tmp = _write_temp(path, views, fsync)
                    if tmp is None:
                        continue
                    try:
                        if mode == "create":
                            _link_exclusive(tmp, path)
                        else:
                            os.replace(tmp.name, path.name, src_dir_fd=d.fd, dst_dir_fd=d.fd)
                            tmp = None
                    finally:
                        if tmp is not None:
                            _unlink_quietly(tmp)
                    if fsync:
                        os.fsync(d.fd)
                    return _info(key, os.stat(path.name, dir_fd=d.fd, follow_symlinks=False))
            raise FileNotFoundError(errno.ENOENT, "directory vanished", key)

        info = await self._run("put", key, write)
        self.stats.bytes_sent += size
        return info

    def open_writer(
        self, key: str, *, mode: PutMode = "overwrite", size_hint: int | None = None
    ) -> LocalObjectWriter:
        """A stream into a temporary file, published at ``commit`` as a put is
        (:mod:`cloudckpt.storage.local.files`)."""
        if mode not in ("overwrite", "create"):
            raise ConfigError(f"bad put mode {mode!r}")
        return LocalObjectWriter(
            jail=self._jail,
            parts=self._parts(key),
            key=key,
            where=self.url,
            create=mode == "create",
            fsync=self.options.fsync,
            size_hint=size_hint,
            run=self._run,
            stats=self.stats,
        )

    async def delete(self, keys: Iterable[str]) -> None:
        paths = [self._parts(k) for k in keys]
        jail = self._jail

        def remove() -> None:
            for parts in paths:
                try:
                    with jail.walk(parts[:-1]) as d:
                        os.unlink(parts[-1], dir_fd=d.fd)  # a link itself, never its target
                        d.prune()
                except FileNotFoundError:
                    continue

        await self._run("delete", None, remove, count=max(1, -(-len(paths) // 1000)))

    # --- reads ----------------------------------------------------------------------------------

    async def head(self, key: str) -> ObjectInfo:
        parts = self._parts(key)
        jail = self._jail

        def stat() -> ObjectInfo:
            with jail.walk(parts[:-1]) as d:
                return _info(key, d.stat_file(parts[-1]))

        return await self._run("head", key, stat)

    async def whole_checksum(self, key: str) -> None:
        """None: files keep no checksum of their bytes (``ObjectNotFound`` if missing)."""
        await self.head(key)
        return None

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The whole file (only a regular file: a FIFO or device is ``ObjectNotFound``); with
        ``max_bytes``, its size is checked (``ObjectTooLarge``) before a byte is read."""
        parts = self._parts(key)
        jail, url = self._jail, self.url

        def too_large(size: int) -> ObjectTooLarge:
            return ObjectTooLarge(
                f"get {url}/{key}: {size} bytes, more than the {max_bytes} allowed",
                key=key,
                operation="get",
                size=size,
                limit=max_bytes,
            )

        def read() -> bytes:
            fd = _open_inside(jail, parts)
            try:
                return read_whole(fd, max_bytes, too_large)
            finally:
                os.close(fd)

        data = await self._run("get", key, read)
        self.stats.bytes_received += len(data)
        return data

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        parts = self._parts(key)

        async def fetch(
            offsets: Sequence[int],
            lengths: Sequence[int],
            targets: Sequence[memoryview | HeldRange],
            *,
            reread: bool,
        ) -> None:
            await self._fetch_into(key, parts, offsets, lengths, targets)

        return await read_verified(key, ranges, fetch, where=self.url)

    async def _fetch_into(
        self,
        key: str,
        parts: Sequence[str],
        offsets: Sequence[int],
        lengths: Sequence[int],
        targets: Sequence[memoryview | HeldRange],
    ) -> None:
        """Read ranges into ``targets`` (flat views, or ``HeldRange``s given freshly read
        blocks): coalesced into pieces, pieces concurrently in the pool."""
        pieces = plan_pieces(
            offsets,
            lengths,
            gap=self.options.coalesce_gap,
            max_piece=self.options.part_size or READ_PIECE,
        )
        if not pieces:
            return
        jail = self._jail
        fd = await self._run("get", key, lambda: _open_inside(jail, parts), count=0)
        try:
            size = os.fstat(fd).st_size
            for offset, length in zip(offsets, lengths):
                if length and offset + length > size:
                    raise InvalidRange(
                        f"{self.url}/{key}: range [{offset}, {offset + length}) is past the end "
                        f"of the object ({size} bytes)",
                        key=key,
                        operation="get",
                    )

            def reader(piece: Piece) -> Callable[[], None]:
                def run() -> None:
                    for i in piece.members:
                        lo = max(offsets[i], piece.start)
                        hi = min(offsets[i] + lengths[i], piece.end)
                        target = targets[i]
                        if isinstance(target, HeldRange):  # verified, then copied to the sinks
                            part = np.empty(hi - lo, dtype=np.uint8).data  # uninitialised
                            _pread_into(fd, part, lo, self.url, key)
                            target.add(lo - offsets[i], part)
                        else:
                            _pread_into(
                                fd, target[lo - offsets[i] : hi - offsets[i]], lo, self.url, key
                            )

                return run

            await run_all(self._run("get", key, reader(p)) for p in pieces)
        finally:
            os.close(fd)
        self.stats.bytes_received += sum(p.length for p in pieces)

    # --- listings -------------------------------------------------------------------------------

    async def list(
        self, prefix: str = "", *, delimiter: str | None = None
    ) -> AsyncIterator[ObjectInfo | CommonPrefix]:
        check_prefix(prefix)
        if delimiter == "":
            raise ConfigError("delimiter must be None or non-empty")
        items = await self._run(
            "list", prefix or None, lambda: list_tree(self._jail, prefix, delimiter)
        )
        for item in items:
            yield item

    async def list_uploads(self, prefix: str = "") -> builtins.list[UploadInfo]:
        check_prefix(prefix)
        jail = self._jail
        return await self._run("list_uploads", prefix or None, lambda: scan_uploads(jail, prefix))

    async def abort_upload(self, upload: UploadInfo) -> None:
        m = _TMP_RE.match(upload.upload_id)
        if not m or "/" in upload.upload_id:
            raise ConfigError(f"not a LocalStore upload id: {upload.upload_id!r}")
        parts = self._parts(upload.key)
        jail = self._jail

        def abort() -> None:
            try:
                with jail.walk(parts[:-1]) as d:
                    _unlink_quietly(At(d.fd, upload.upload_id))
            except FileNotFoundError:
                pass

        await self._run("abort_multipart", upload.key, abort)


# --- blocking helpers (run in the pool) --------------------------------------------------------


def _open_inside(jail: Jail, parts: Sequence[str]) -> int:
    """A read-only fd of the object at ``parts`` (see :mod:`cloudckpt.storage.local.paths`)."""
    with jail.walk(parts[:-1]) as d:
        return d.open_file(parts[-1])


def _pread_into(fd: int, view: memoryview, offset: int, url: str, key: str) -> None:
    """Fill ``view`` with the bytes at ``offset`` of the file ``fd`` (object ``key`` of the store
    at ``url``); ``InvalidRange`` naming both when the file ends first (it shrank meanwhile)."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise InvalidRange(
                f"{url}/{key}: range [{offset}, {offset + len(view)}) is past the "
                f"end of the object (the file ended at byte {offset + done} "
                "while it was read)",
                key=key,
                operation="get",
            )
        done += n
