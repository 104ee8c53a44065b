"""Reaching files below a root without leaving it, for
:class:`~cloudckpt.storage.local.store.LocalStore`.

Contract:
- Every path component is opened relative to the directory fd of its parent with ``O_NOFOLLOW``
  (directories with ``O_DIRECTORY`` too), starting from an fd of the root. So the check that a
  path stays inside the root and the open are one step: a directory swapped for a symlink
  between two calls cannot redirect a read, a write, a delete or a listing outside the root.
- The kernel never follows a symlink below the root; this module does. A link met on the way is
  read (``readlink`` relative to its directory) and its target resolved against the directories
  already opened (relative targets, ``..`` going up the opened chain) or against the root's path
  (absolute targets, which must start with the root's path or its real path). A target that goes
  above the root, or an absolute one elsewhere, raises ``PermissionError`` (``AccessDenied`` in
  the store): LocalStore's rule "symlinks are followed only while they stay inside the root".
  At most :data:`MAX_LINKS` links per resolution (``ELOOP`` beyond).
- Files are opened non-blocking and must be regular files (a FIFO, socket, device or directory
  is "not found"), so a crafted directory cannot hang or feed a read.
- The root path itself is trusted (opened normally, following links, as the user named it).
- Pure ``os`` calls, blocking: LocalStore runs them in its thread pool.
- :func:`read_whole` reads an opened file whole, bounded by a size checked before reading.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

R = TypeVar("R")

#: symlinks followed within one resolution before giving up (like the kernel's 40).
MAX_LINKS = 40
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_NOFOLLOW | _CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | _CLOEXEC
#: errors an ``O_NOFOLLOW`` open gives for a symlink (Linux: ELOOP, or ENOTDIR with
#: O_DIRECTORY; BSDs: EMLINK / EFTYPE)
_LINK_ERRNOS = {errno.ELOOP, errno.ENOTDIR, errno.EMLINK, getattr(errno, "EFTYPE", errno.ELOOP)}


def refused(path: str) -> PermissionError:
    return PermissionError(errno.EACCES, "refused: a symlink leads outside the store root", path)


class Jail:
    """A root directory (``path``) below which keys are resolved (see module doc). ``prefix``:
    components of a child store's directory below the root, walked before every key."""

    def __init__(self, path: Path, prefix: Sequence[str] = ()):
        self.path = Path(path)
        self.prefix = tuple(prefix)
        anchors = {
            tuple(Path(os.path.abspath(self.path)).parts),
            tuple(Path(os.path.realpath(self.path)).parts),
        }
        self._anchors = sorted(anchors, key=len, reverse=True)

    def child(self, parts: Sequence[str]) -> Jail:
        return Jail(self.path, self.prefix + tuple(parts))

    @property
    def where(self) -> str:
        return str(self.path.joinpath(*self.prefix))

    def walk(self, parts: Sequence[str] = (), *, create: bool = False) -> Walk:
        """A :class:`Walk` standing in the directory ``prefix + parts`` (created when ``create``:
        the root too). Raises FileNotFoundError / NotADirectoryError / PermissionError."""
        if create:
            os.makedirs(self.path, exist_ok=True)
        w = Walk(self, os.open(self.path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _CLOEXEC))
        try:
            w.enter(self.prefix, create=create)
            w.base = len(w.fds)
            w.enter(parts, create=create)
        except BaseException:
            w.close()
            raise
        return w

    def anchored(self, target: str) -> list[str]:
        """Components, relative to the root, of absolute link ``target`` (PermissionError when it
        does not start with the root's path)."""
        parts = Path(target).parts
        for anchor in self._anchors:
            if parts[: len(anchor)] == anchor:
                return list(parts[len(anchor) :])
        raise refused(target)


class Walk:
    """A chain of open directory fds from the root (``fds[0]``) to the current directory;
    ``names[i]`` is the name of ``fds[i + 1]`` in ``fds[i]``. A context manager closing them."""

    def __init__(self, jail: Jail, root_fd: int):
        self.jail = jail
        self.fds = [root_fd]
        self.names: list[str] = []
        self.links = 0
        self.base = 1

    @property
    def fd(self) -> int:
        return self.fds[-1]

    def __enter__(self) -> Walk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.pop())

    def _up(self) -> None:
        if len(self.fds) == 1:
            raise refused(self.jail.where)
        os.close(self.fds.pop())
        self.names.pop()

    def _follow(self, name: str, error: OSError) -> list[str]:
        """The components a symlink ``name`` of the current directory stands for (the walk moves
        to the root for an absolute target); re-raises ``error`` when ``name`` is no link."""
        self.links += 1
        if self.links > MAX_LINKS:
            raise OSError(errno.ELOOP, "too many levels of symbolic links", name)
        try:
            target = os.readlink(name, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            # no link: a file where a directory was wanted, or an entry swapped meanwhile
            # (a link then, a directory now: try again, within the MAX_LINKS budget)
            if error.errno in (errno.ELOOP, errno.EMLINK):
                return [name]
            try:
                mode = os.stat(name, dir_fd=self.fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                return [name]
            if stat.S_ISDIR(mode) or stat.S_ISLNK(mode):
                return [name]
            raise error from None
        if os.path.isabs(target):
            parts = self.jail.anchored(target)
            while len(self.fds) > 1:
                self._up()
            return parts
        return [p for p in target.split("/") if p]

    def enter(self, parts: Sequence[str], *, create: bool = False) -> None:
        """Move into directory ``parts`` (relative to the current one), following links inside
        the root; missing directories are made when ``create``."""
        pending = list(parts)
        made = 0
        while pending:
            part = pending.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                self._up()
                continue
            try:
                fd = os.open(part, _DIR_FLAGS, dir_fd=self.fd)
            except FileNotFoundError:
                if not create or made > 2 * MAX_LINKS:
                    raise
                made += 1
                try:
                    os.mkdir(part, 0o777, dir_fd=self.fd)
                except FileExistsError:
                    pass
                pending.insert(0, part)
                continue
            except OSError as exc:
                if exc.errno not in _LINK_ERRNOS:
                    raise
                pending[0:0] = self._follow(part, exc)
                continue
            self.fds.append(fd)
            self.names.append(part)

    def _final(self, name: str, attempt: Callable[[str], R]) -> R:
        """Run ``attempt(name)`` on the last component, following links inside the root:
        ``attempt`` returns a result, or raises OSError (a link error leads to following)."""
        while True:
            if name in ("", ".", ".."):
                raise FileNotFoundError(errno.ENOENT, "not a file", name)
            try:
                return attempt(name)
            except _IsLink:
                err = OSError(errno.ELOOP, "symbolic link", name)
            except OSError as exc:
                if exc.errno not in _LINK_ERRNOS or exc.errno == errno.ENOTDIR:
                    raise
                err = exc
            parts = self._follow(name, err)
            if not parts:  # a link to the root itself, or to "/" below it: a directory
                raise FileNotFoundError(errno.ENOENT, "not a file", name)
            self.enter(parts[:-1])
            name = parts[-1]

    def open_file(self, name: str) -> int:
        """An fd (read-only) of regular file ``name`` of the current directory."""

        def attempt(n: str) -> int:
            fd = os.open(n, _FILE_FLAGS, dir_fd=self.fd)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise FileNotFoundError(errno.ENOENT, "not a file", n)
                os.set_blocking(fd, True)
            except BaseException:
                os.close(fd)
                raise
            return fd

        return self._final(name, attempt)

    def stat_file(self, name: str) -> os.stat_result:
        """The stat of regular file ``name`` of the current directory (links followed inside)."""

        def attempt(n: str) -> os.stat_result:
            st = os.stat(n, dir_fd=self.fd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                raise _IsLink
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(errno.ENOENT, "not a file", n)
            return st

        return self._final(name, attempt)

    def prune(self) -> None:
        """Remove the directories of the chain that are empty, deepest first, down to (not
        including) the store's own directory."""
        while len(self.fds) > self.base:
            name = self.names[-1]
            os.close(self.fds.pop())
            self.names.pop()
            try:
                os.rmdir(name, dir_fd=self.fd)
            except OSError:
                return


class _IsLink(Exception):
    pass


def walk_files(
    jail: Jail, rel_dir: str, *, temps: bool, mark: str
) -> Iterator[tuple[str, os.stat_result]]:
    """``(key relative to the store, stat)`` of every regular file below directory ``rel_dir``
    ("" or ending in "/"), not descending into symlinked directories; a symlinked file is listed
    when it leads to a regular file inside the root. Only names holding ``mark`` when ``temps``,
    only the others otherwise."""
    try:
        top = jail.walk(rel_dir.split("/"))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    with top:
        stack: list[tuple[str, int, Iterator[tuple[str, bool, bool]] | None]] = [
            (rel_dir, os.dup(top.fd), None)
        ]
        try:
            while stack:
                rel, fd, entries = stack[-1]
                if entries is None:
                    with os.scandir(fd) as it:
                        entries = iter(
                            [(e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it]
                        )
                    stack[-1] = (rel, fd, entries)
                item = next(entries, None)
                if item is None:
                    os.close(stack.pop()[1])
                    continue
                name, is_dir, is_link = item
                if is_dir:
                    try:
                        sub = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:  # gone, or swapped for a link meanwhile: not descended
                        continue
                    stack.append((f"{rel}{name}/", sub, None))
                    continue
                if (mark in name) != temps:
                    continue
                st = _entry_stat(jail, fd, rel, name, is_link)
                if st is not None:
                    yield f"{rel}{name}", st
        finally:
            for _, fd, _ in stack:
                os.close(fd)


def _entry_stat(
    jail: Jail, dir_fd: int, rel: str, name: str, is_link: bool
) -> os.stat_result | None:
    """The stat of a listed regular file (a link: of the file it leads to inside the root), or
    None when it is none (or leads outside)."""
    try:
        if not is_link:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode):
                return st
            if not stat.S_ISLNK(st.st_mode):
                return None
        with jail.walk(rel.split("/")) as w:
            return w.stat_file(name)
    except OSError:
        return None


def dir_level(jail: Jail, rel_dir: str, mark: str) -> list[tuple[str, os.stat_result | None]]:
    """One level of directory ``rel_dir`` ("" or ending in "/"): ``(key, stat)`` for each object
    (as :func:`walk_files` lists them, names holding ``mark`` left out), ``(name + "/", None)``
    for each sub-directory that is no link."""
    try:
        top = jail.walk(rel_dir.split("/"))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    with top:
        with os.scandir(top.fd) as it:
            entries = [(e.name, e.is_dir(follow_symlinks=False), e.is_symlink()) for e in it]
        out: list[tuple[str, os.stat_result | None]] = []
        for name, is_dir, is_link in entries:
            if is_dir:
                out.append((f"{rel_dir}{name}/", None))
            elif mark not in name:
                st = _entry_stat(jail, top.fd, rel_dir, name, is_link)
                if st is not None:
                    out.append((f"{rel_dir}{name}", st))
        return out


def has_files(jail: Jail, rel_dir: str, mark: str) -> bool:
    return any(True for _ in walk_files(jail, rel_dir, temps=False, mark=mark))


def read_whole(
    fd: int, max_bytes: int | None = None, too_large: Callable[[int], Exception] = ValueError
) -> bytes:
    """The contents of the open regular file ``fd`` from offset 0 (the fd is left open). With
    ``max_bytes``: ``too_large(size)`` is raised before a byte is read when the file's size is
    over it, and as soon as more than that has been read, should the file grow meanwhile."""
    if max_bytes is None:
        with open(fd, "rb", closefd=False) as f:
            return f.read()
    size = os.fstat(fd).st_size
    if size > max_bytes:
        raise too_large(size)
    pieces, total, want = [], 0, size + 1
    with open(fd, "rb", closefd=False) as f:
        while piece := f.read(want):  # the size seen so far, then what it grew by
            pieces.append(piece)
            total += len(piece)
            if total > max_bytes:
                raise too_large(total)
            want = min(1 << 20, max_bytes + 1 - total)
    return b"".join(pieces) if len(pieces) != 1 else pieces[0]
