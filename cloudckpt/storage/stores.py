"""Opening a store from a URL: ``open_store`` picks the backend, ``local_path`` names a local
one."""

from __future__ import annotations

import os

from cloudckpt.errors import ConfigError
from cloudckpt.storage.base import ObjectStore
from cloudckpt.storage.local.store import LocalStore
from cloudckpt.storage.options import StorageOptions
from cloudckpt.storage.urls import parse_store_url


def local_path(url: str | os.PathLike[str]) -> str | None:
    """The filesystem path of a ``file://`` URL or plain path; None for an ``s3://`` URL.
    Raises ``ConfigError`` for anything else (see :mod:`cloudckpt.storage.urls`)."""
    parsed = parse_store_url(url)
    return parsed.path if parsed.kind == "local" else None


def open_store(url: str | os.PathLike[str], options: StorageOptions | None = None) -> ObjectStore:
    """The store for ``url``: ``S3Store`` for ``s3://BUCKET[/PATH]``, ``LocalStore`` for
    ``file:///PATH`` or a plain path. Nothing is contacted yet. Anything else, and malformed
    URLs (``s3:/b``, ``S3://b``, ``gs://b``, ``s3://``...), raise ``ConfigError`` with a hint
    (:func:`cloudckpt.storage.urls.parse_store_url`)."""
    if options is not None and not isinstance(options, StorageOptions):
        raise ConfigError("options must be a StorageOptions")
    parsed = parse_store_url(url)
    if parsed.kind == "s3":
        from cloudckpt.storage.s3.store import S3Store  # aiobotocore: imported on first use

        return S3Store(parsed.url, options or StorageOptions())
    return LocalStore(parsed.path, options)
