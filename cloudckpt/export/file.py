"""Writing a checkpoint as one file, ``.safetensors`` or ``.pt`` (``cloudckpt export``).

Contract:
- :func:`export` consolidates the checkpoint with :func:`cloudckpt.api.load.load_full` (every block
  verified) and only then creates anything on disk.
- OUT is written through a fresh temporary entry in OUT's folder, ``.<OUT name>.cloudckpt-tmp-<16
  hex>`` (:func:`cloudckpt.storage.local.files.create_temp`, as every local write), created
  exclusively (a name that exists, a planted symlink included, is never opened; another
  random name is tried):
  - ``.pt``: a file (``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600) written by ``torch.save``
    through the descriptor that created it, never reopened by name;
  - ``.safetensors``: safetensors writes by path (its own temporary file, then a rename), so on
    Linux it writes into a private directory (``mkdir`` mode 0700, checked to be ours) reached as
    ``/proc/self/fd/N/...``: the directory this process opened, whatever its name points at by
    then. Elsewhere the file is serialized in memory and written like a ``.pt``.
  The result gets the usual mode (0666 less the umask), is fsynced and renamed onto OUT
  (``os.replace``: a symlink at OUT is replaced, never written through).
- On any failure, ``KeyboardInterrupt`` included, the temporary entry is removed and OUT is
  untouched: an existing OUT stays as it was, a missing one is not created.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from cloudckpt.api.load import load_full
from cloudckpt.errors import ConfigError, SafetensorsError
from cloudckpt.hf.header import safetensors_dtype
from cloudckpt.storage.local.files import At, create_temp, finish_file, new_file
from cloudckpt.storage.options import StorageOptions

_PROC_FD = "/proc/self/fd"
_FLAGS = getattr(os, "O_CLOEXEC", 0)
_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | _FLAGS


def export(
    url: str, out: str, *, allow_pickle: bool = False, storage: StorageOptions | None = None
) -> list[str]:
    """Write the checkpoint at ``url`` to ``out`` (``.safetensors``, or ``.pt`` / ``.pth`` for
    ``torch.save``). Returns the names of non-tensor values a ``.safetensors`` file could not hold
    (not representable in JSON metadata), which are left out.

    Raises ``ValueError`` for another suffix; the load's errors as they are.
    """
    kind = export_kind(out)
    if kind is None:
        raise ValueError(f"OUT must end with .safetensors or .pt, got {out!r}")
    state = load_full(url, storage=storage, allow_pickle=allow_pickle)
    if kind == ".pt":
        write_new_file(out, lambda f: torch.save(state, f))
        return []
    from safetensors import torch as st

    tensors, meta, skipped = _safetensors_parts(state, url)
    if os.path.isdir(_PROC_FD):
        write_new_file_by_path(out, lambda path: st.save_file(tensors, path, metadata=meta))
    else:  # pragma: no cover - no /proc: in memory
        write_new_file(out, lambda f: f.write(st.save(tensors, metadata=meta)))
    return skipped


def export_kind(out: str) -> str | None:
    """``".safetensors"``, ``".pt"`` or None (an unsupported suffix)."""
    if out.endswith(".safetensors"):
        return ".safetensors"
    if out.endswith((".pt", ".pth")):
        return ".pt"
    return None


def write_new_file(out: str, write: Callable[[BinaryIO], object]) -> None:
    """Create or replace ``out`` with what ``write(file)`` writes to a fresh temporary file
    (see module doc)."""

    def fill(tmp: At, fd: int, name: str) -> None:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            finish_file(fd)
        os.replace(tmp.name, name, src_dir_fd=tmp.dir_fd, dst_dir_fd=tmp.dir_fd)

    def remove(tmp: At) -> None:
        os.unlink(tmp.name, dir_fd=tmp.dir_fd)

    _with_temp(out, new_file, fill, remove)


def write_new_file_by_path(out: str, write: Callable[[str], None]) -> None:
    """Create or replace ``out`` with the file ``write(path)`` makes at ``path``, a name in a
    fresh private directory reached through ``/proc/self/fd`` (see module doc)."""

    def make(tmp: At) -> int:
        os.mkdir(tmp.name, 0o700, dir_fd=tmp.dir_fd)
        fd = os.open(tmp.name, _DIR | os.O_NOFOLLOW, dir_fd=tmp.dir_fd)
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            os.close(fd)
            raise PermissionError(f"{tmp.name}: the private directory was replaced")
        return fd

    def fill(tmp: At, fd: int, name: str) -> None:
        try:
            write(f"{_PROC_FD}/{fd}/{name}")
            made = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | _FLAGS, dir_fd=fd)
            try:
                finish_file(made)
            finally:
                os.close(made)
            os.replace(name, name, src_dir_fd=fd, dst_dir_fd=tmp.dir_fd)
        finally:
            for entry in os.listdir(fd):  # what the writer left (its own temporary file)
                os.unlink(entry, dir_fd=fd)
            os.close(fd)
        os.rmdir(tmp.name, dir_fd=tmp.dir_fd)

    def remove(tmp: At) -> None:
        os.rmdir(tmp.name, dir_fd=tmp.dir_fd)

    _with_temp(out, make, fill, remove)


def _with_temp(
    out: str,
    make: Callable[[At], int],
    fill: Callable[[At, int, str], None],
    remove: Callable[[At], None],
) -> None:
    """``make(tmp)`` a fresh entry next to OUT (``create_temp``), then ``fill(tmp, fd, name)``
    it and move the result onto OUT; ``remove(tmp)`` on any failure."""
    folder, name = os.path.split(os.path.abspath(out))
    dir_fd = os.open(folder, _DIR)
    try:
        tmp, fd = create_temp(At(dir_fd, name), make)
        try:
            fill(tmp, fd, name)
        except BaseException:
            try:
                remove(tmp)
            except OSError:
                pass
            raise
    finally:
        os.close(dir_fd)


def _flatten(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    if isinstance(tree, dict):
        for k, v in tree.items():
            _flatten(v, f"{prefix}{k}.", out)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            _flatten(v, f"{prefix}{i}.", out)
    else:
        out[prefix[:-1]] = tree


def _safetensors_parts(
    state: Any, url: str
) -> tuple[dict[str, torch.Tensor], dict[str, str], list[str]]:
    """(tensors, metadata, names of values left out) of a consolidated state; ``ConfigError``
    for a tensor of a dtype safetensors cannot hold (complex128)."""
    flat: dict[str, Any] = {}
    _flatten(state, "", flat)
    tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
    for k, v in tensors.items():
        try:
            safetensors_dtype(v.dtype)
        except SafetensorsError as exc:
            raise ConfigError(
                f"tensor {k} is {str(v.dtype).removeprefix('torch.')}, which "
                "safetensors cannot hold; export to .pt, or with --format "
                "safetensors (which leaves it out)"
            ) from exc
    meta = {"format": "pt", "cloudckpt.source": url}
    skipped = []
    for k, v in flat.items():
        if isinstance(v, torch.Tensor):
            continue
        try:
            meta[f"cloudckpt.value.{k}"] = json.dumps(v)
        except (TypeError, ValueError):
            skipped.append(k)
    return tensors, meta, skipped
