"""A read-only fsspec view of the cloudckpt checkpoints under a URL.

Lightning asks a filesystem object whether a checkpoint path exists and when it was written
(``ModelCheckpoint.file_exists``, the ``ckpt_path="last"`` lookup). This view answers those
questions from cloudckpt's own listing: a checkpoint exists when its manifest does (a half-written
one does not), its time is its manifest's commit. Nothing else goes through fsspec: it cannot
open files. It is registered with fsspec for the ``cloudckpt+s3`` protocol (see
:mod:`cloudckpt.integrations.lightning.urls`).
"""

from __future__ import annotations

import threading
from datetime import datetime
from typing import Any

import fsspec
from fsspec.spec import AbstractFileSystem

from cloudckpt.integrations.lightning import library
from cloudckpt.integrations.lightning.urls import ALIAS, checkpoint_url

PROTOCOL = ALIAS + "s3"

_lock = threading.Lock()
_storage_of: dict[str, Any] = {}  # checkpoint URL -> the StorageOptions to reach it with


def remember_storage(url: str, storage: Any) -> None:
    """The storage options the view uses for ``url`` when fsspec builds it without them."""
    with _lock:
        _storage_of[url] = storage


def _storage(url: str) -> Any:
    with _lock:
        return _storage_of.get(url)


class CheckpointFolderView(AbstractFileSystem):
    """``exists``, ``modified``, ``info``, ``ls``, ``isdir`` of cloudckpt checkpoints; no open."""

    protocol = (PROTOCOL,)
    cachable = False

    def __init__(self, *args: Any, storage: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.storage = storage

    def _options(self, url: str) -> Any:
        return self.storage if self.storage is not None else _storage(url)

    def exists(self, path: Any, **kwargs: Any) -> bool:
        url = checkpoint_url(path)
        return library.exists(url, self._options(url))

    def modified(self, path: Any) -> datetime:
        url = checkpoint_url(path)
        above, _, name = url.rstrip("/").rpartition("/")
        for listed in library.list_committed(above, self._options(url)):
            if listed.name == name and listed.committed_at is not None:
                return listed.committed_at
        raise FileNotFoundError(f"no committed checkpoint at {url}")

    def ls(self, path: Any, detail: bool = True, **kwargs: Any) -> list[Any]:
        url = checkpoint_url(path).rstrip("/")
        listed = library.list_committed(url, self._options(url))
        if not detail:
            return [c.url for c in listed]
        return [{"name": c.url, "type": "directory", "size": 0} for c in listed]

    def info(self, path: Any, **kwargs: Any) -> dict[str, Any]:
        url = checkpoint_url(path)
        if not self.exists(url):
            raise FileNotFoundError(f"no committed checkpoint at {url}")
        return {"name": url, "type": "directory", "size": 0}

    def isdir(self, path: Any) -> bool:
        return self.exists(path)

    def _open(self, path: Any, mode: str = "rb", **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"cannot open {path} as a file: cloudckpt checkpoints are read with "
            f"CloudCheckpointIO (or cloudckpt.load_full), other S3 files need s3fs"
        )


def register() -> None:
    """Register the view with fsspec for ``cloudckpt+s3://`` (idempotent)."""
    fsspec.register_implementation(PROTOCOL, CheckpointFolderView, clobber=True)
