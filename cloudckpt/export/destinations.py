"""Where a safetensors export writes: a local folder or a store prefix (``s3://``).

Contract of an :class:`ExportFolder` (both kinds): files are taken one at a time
(:meth:`~ExportFolder.open` -> ``write`` ... -> ``commit``, or ``discard``) and an existing
file is never replaced: a name taken between :meth:`~ExportFolder.existing` and the commit
raises :class:`~cloudckpt.errors.ExportTargetNotEmpty` and leaves that file as it was.
``existing`` lists the names an export would clash with (``*.safetensors`` and
``*.safetensors.index.json`` directly in the folder, hidden names excepted); ``sync`` makes the
committed names durable; ``remove`` deletes files this export committed (after a failure). A
failed or interrupted (``KeyboardInterrupt``) write or commit leaves no temporary entry.

- :class:`LocalFolder`: the folder is created if missing. Each file is written to a fresh
  temporary entry (:func:`~cloudckpt.storage.local.files.create_temp`: ``.<name>.cloudckpt-tmp-<16
  hex>``, ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600, through the folder's descriptor),
  streamed, given the usual mode (0666 less the umask), fsynced, then published under its name
  (:func:`~cloudckpt.storage.local.files.link_exclusive`: fails if the name exists, a symlink
  included) and the temporary entry removed. ``sync`` fsyncs the folder.
- :class:`StoreFolder`: a prefix of any ``ObjectStore``; each file is streamed
  (``ObjectStore.open_writer`` in ``create`` mode, its size, known from its header, as the
  hint). On S3 the store holds a few parts of it, about ``part_size x (concurrency + 1)``
  (:mod:`cloudckpt.storage.s3.stream`), whatever the file's size. A file that fits one part is
  one PutObject with ``If-None-Match: *``; a larger one claims its key, streams its parts and
  completes with ``If-None-Match: *``: at any size a file is never written over
  (``ObjectExists`` from the store). A failed or interrupted write or commit aborts the upload
  (a completion the server had already taken may still stand: that file then remains, never an
  index naming it).

Local folders do not go through a LocalStore (a StoreFolder over it): its listing leaves out
links that lead outside the folder (a dangling ``x.safetensors`` link would not be refused), its
files get mode 0644 less the umask rather than the usual 0666 less the umask, and it fsyncs only
with ``StorageOptions.fsync``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Sequence
from typing import Protocol

from cloudckpt.errors import ConfigError, ExportTargetNotEmpty, ObjectExists
from cloudckpt.runtime.loop import run_coroutine, shared_store, start_task
from cloudckpt.storage.base import CommonPrefix, ObjectWriter
from cloudckpt.storage.local.files import (
    At,
    create_temp,
    finish_file,
    link_exclusive,
    unlink_quietly,
)
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.urls import StoreURL

_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)


class ExportFile(Protocol):
    """One file being written (module doc): ``write`` the bytes in order, then ``commit``
    (exactly the size given to ``open``); ``discard`` after any failure (idempotent)."""

    def write(self, view: bytes | memoryview) -> None: ...
    def commit(self) -> None: ...
    def discard(self) -> None: ...


class ExportFolder(Protocol):
    """Where an export writes (module doc). ``where`` names it in messages."""

    where: str

    def existing(self) -> list[str]: ...
    def open(self, name: str, size: int) -> ExportFile: ...
    def sync(self) -> None: ...
    def remove(self, names: Sequence[str]) -> None: ...
    def close(self) -> None: ...


def open_folder(dst: StoreURL, storage: StorageOptions | None = None) -> ExportFolder:
    """The folder of a parsed destination: a :class:`StoreFolder` for ``s3://``, else a
    :class:`LocalFolder`."""
    if dst.kind == "s3":
        return StoreFolder(dst.url, storage)
    return LocalFolder(dst.path)


def clashes(name: str) -> bool:
    """Whether an export refuses a folder holding ``name``."""
    return not name.startswith(".") and name.endswith((".safetensors", ".safetensors.index.json"))


def _taken(where: str, name: str) -> ExportTargetNotEmpty:
    return ExportTargetNotEmpty(
        f"{where}/{name} appeared while exporting (another export into "
        "the same folder?); nothing was written over it",
        names=(name,),
    )


class LocalFolder:
    """A local folder (module doc). ``path`` is created if missing."""

    def __init__(self, path: str):
        self.where = path
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(
                f"cannot export into {path}: it is a file, not a folder; give a "
                "folder (it is created if missing)"
            )
        os.makedirs(path, exist_ok=True)
        self.fd = os.open(path, _DIR)

    def existing(self) -> list[str]:
        return sorted(n for n in os.listdir(self.fd) if clashes(n))

    def open(self, name: str, size: int) -> _LocalFile:
        tmp, fd = create_temp(At(self.fd, name))
        return _LocalFile(self, name, tmp, fd)

    def sync(self) -> None:
        os.fsync(self.fd)

    def remove(self, names: Sequence[str]) -> None:
        for name in names:
            try:
                os.unlink(name, dir_fd=self.fd)
            except OSError:
                pass

    def close(self) -> None:
        os.close(self.fd)


class _LocalFile:
    def __init__(self, folder: LocalFolder, name: str, tmp: At, fd: int):
        self.folder, self.name, self.tmp = folder, name, tmp
        self.file = os.fdopen(fd, "wb")

    def write(self, view: bytes | memoryview) -> None:
        self.file.write(view)

    def commit(self) -> None:
        self.file.flush()
        finish_file(self.file.fileno())
        self.file.close()
        try:
            link_exclusive(self.tmp, At(self.folder.fd, self.name))
        except FileExistsError as exc:
            raise _taken(self.folder.where, self.name) from exc
        finally:
            unlink_quietly(self.tmp)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        unlink_quietly(self.tmp)


class StoreFolder:
    """A prefix of any ``ObjectStore`` (module doc), opened from its URL."""

    def __init__(self, url: str, storage: StorageOptions | None = None):
        self.where = url.rstrip("/")
        self.store = shared_store(url, storage)

    def existing(self) -> list[str]:
        async def scan() -> list[str]:
            return [
                e.key
                for e in [e async for e in self.store.list("", delimiter="/")]
                if not isinstance(e, CommonPrefix) and clashes(e.key)
            ]

        return sorted(run_coroutine(scan()))

    def open(self, name: str, size: int) -> _StoreFile:
        return _StoreFile(self, name, size)

    def sync(self) -> None:
        pass

    def remove(self, names: Sequence[str]) -> None:
        if names:
            run_coroutine(self.store.delete(list(names)))

    def close(self) -> None:
        pass


class _StoreFile:
    def __init__(self, folder: StoreFolder, name: str, size: int):
        self.folder, self.name, self.size = folder, name, size
        self.stream: ObjectWriter = folder.store.open_writer(name, mode="create", size_hint=size)

    def write(self, view: bytes | memoryview) -> None:
        self._wait(self.stream.write(view))

    def commit(self) -> None:
        if self.stream.size != self.size:
            raise AssertionError(
                f"{self.name}: {self.stream.size} bytes written, {self.size} planned"
            )
        self._wait(self.stream.commit())

    def discard(self) -> None:
        run_coroutine(self.stream.abort())

    def _wait(self, coro: Awaitable[object]) -> None:
        """Run a step of the stream on the runtime's loop. Interrupted (``KeyboardInterrupt``):
        the step is cancelled, which aborts the stream, before the interruption goes on."""
        task = start_task(coro)
        try:
            task.result()
        except ObjectExists as exc:
            raise _taken(self.folder.where, self.name) from exc
        except Exception:
            raise
        except BaseException:
            task.cancel_and_wait()
            raise
