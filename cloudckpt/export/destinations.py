"""Where a safetensors export writes: a local folder or an S3 prefix.

Both take files one at a time (:meth:`open` -> ``write`` ... -> ``commit``) and never replace
an existing file:

- :class:`LocalFolder`: the folder is created if missing. Each file is written to a fresh
  temporary entry ``.<name>.<random>.partial`` (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600,
  through the folder's descriptor), streamed, given the usual mode (0666 less the umask),
  fsynced, then hard-linked onto its name (which fails if the name exists, a symlink
  included) and the temporary entry removed. :meth:`sync` fsyncs the folder.
- :class:`S3Folder`: each file is streamed (``ObjectStore.open_writer`` in ``create`` mode, its
  size, known from its header, as the hint): the store holds a few parts of it, about
  ``part_size x (concurrency + 1)`` (:mod:`cloudckpt.storage.s3.stream`), whatever the file's
  size. A file that fits one part is one PutObject with ``If-None-Match: *``; a larger one
  claims its key, streams its parts and completes with ``If-None-Match: *``: at any size a file
  is never written over (``ObjectExists`` from the store). A failed or interrupted
  (``KeyboardInterrupt``) write or commit aborts the upload (a completion the server had
  already taken may still stand: that file then remains, never an index naming it).

:meth:`existing` lists the names an export would clash with (``*.safetensors`` and
``*.safetensors.index.json`` directly in the folder, hidden names excepted); :meth:`remove`
deletes files this export committed (after a failure). A name taken between the check and the
commit raises :class:`~cloudckpt.errors.ExportTargetNotEmpty`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from cloudckpt.errors import ConfigError, ExportTargetNotEmpty, ObjectExists
from cloudckpt.export.file import finish_file, temp_name
from cloudckpt.runtime.loop import run_coroutine, shared_store, start_task
from cloudckpt.storage.base import CommonPrefix

_FLAGS = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _FLAGS
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _FLAGS
_ATTEMPTS = 16


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
    """A local folder (see module doc). ``path`` is created if missing."""

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
        for _ in range(_ATTEMPTS):
            tmp = temp_name(name)
            try:
                fd = os.open(tmp, _NEW, 0o600, dir_fd=self.fd)
                return _LocalFile(self, name, tmp, fd)
            except FileExistsError:
                continue
        raise FileExistsError(
            f"could not create a fresh temporary file for {name} in "
            f"{self.where} ({_ATTEMPTS} names taken)"
        )

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
    def __init__(self, folder: LocalFolder, name: str, tmp: str, fd: int):
        self.folder, self.name, self.tmp = folder, name, tmp
        self.file = os.fdopen(fd, "wb")

    def write(self, view) -> None:
        self.file.write(view)

    def commit(self) -> None:
        dir_fd = self.folder.fd
        self.file.flush()
        finish_file(self.file.fileno())
        self.file.close()
        try:
            os.link(
                self.tmp, self.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False
            )
        except FileExistsError as exc:
            raise _taken(self.folder.where, self.name) from exc
        finally:
            os.unlink(self.tmp, dir_fd=dir_fd)

    def discard(self) -> None:
        if not self.file.closed:
            self.file.close()
        try:
            os.unlink(self.tmp, dir_fd=self.folder.fd)
        except FileNotFoundError:
            pass


class S3Folder:
    """An S3 prefix (see module doc)."""

    def __init__(self, url: str, storage=None):
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

    def open(self, name: str, size: int) -> _S3File:
        return _S3File(self, name, size)

    def sync(self) -> None:
        pass

    def remove(self, names: Sequence[str]) -> None:
        if names:
            run_coroutine(self.store.delete(list(names)))

    def close(self) -> None:
        pass


class _S3File:
    def __init__(self, folder: S3Folder, name: str, size: int):
        self.folder, self.name, self.size = folder, name, size
        self.stream = folder.store.open_writer(name, mode="create", size_hint=size)

    def write(self, view) -> None:
        self._wait(self.stream.write(view))

    def commit(self) -> None:
        if self.stream.size != self.size:
            raise AssertionError(
                f"{self.name}: {self.stream.size} bytes written, {self.size} planned"
            )
        self._wait(self.stream.commit())

    def discard(self) -> None:
        run_coroutine(self.stream.abort())

    def _wait(self, coro) -> None:
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
