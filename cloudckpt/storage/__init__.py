"""Async object storage: the ``ObjectStore`` protocol, ``S3Store`` (aiobotocore) and
``LocalStore`` (directories). Never imports torch.

``open_store(url, options)`` picks the backend: ``s3://bucket/prefix`` -> ``S3Store``;
``file:///path`` or a plain path -> ``LocalStore``.
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from cloudckpt.errors import ConfigError
from cloudckpt.storage.base import (
    CommonPrefix,
    ObjectInfo,
    ObjectStore,
    ReadRange,
    StoreStats,
    UploadInfo,
)
from cloudckpt.storage.local import LocalStore
from cloudckpt.storage.options import RetryOptions, StorageOptions
from cloudckpt.storage.s3 import S3Store

__all__ = [
    "CommonPrefix",
    "LocalStore",
    "ObjectInfo",
    "ObjectStore",
    "ReadRange",
    "RetryOptions",
    "S3Store",
    "StorageOptions",
    "StoreStats",
    "UploadInfo",
    "local_path",
    "open_store",
]


def local_path(url: str | os.PathLike) -> str | None:
    """The filesystem path of a ``file://`` URL or plain path; None for other schemes.
    Raises ``ConfigError`` for a malformed ``file://`` URL."""
    text = os.fspath(url)
    if not isinstance(text, str):
        raise ConfigError(f"a store URL must be a string, not {type(text).__name__}")
    if text.startswith("file:"):
        parsed = urlparse(text)
        if parsed.netloc not in ("", "localhost") or parsed.query or parsed.fragment:
            raise ConfigError(f"unsupported file URL {text!r} (use file:///absolute/path)")
        path = unquote(parsed.path)
        if not path.startswith("/"):
            raise ConfigError(f"file URL needs an absolute path: {text!r}")
        return path
    if "://" in text:
        return None
    if not text.strip():
        raise ConfigError("empty store URL")
    return text


def open_store(url: str | os.PathLike, options: StorageOptions | None = None) -> ObjectStore:
    """The store for ``url``: ``S3Store`` for ``s3://``, ``LocalStore`` for ``file://`` or a plain
    path. Nothing is contacted yet. Unknown schemes or malformed URLs raise ``ConfigError``."""
    if options is not None and not isinstance(options, StorageOptions):
        raise ConfigError("options must be a StorageOptions")
    text = os.fspath(url) if isinstance(url, os.PathLike) else url
    if isinstance(text, str) and text.startswith("s3://"):
        return S3Store(text, options or StorageOptions())
    path = local_path(text)
    if path is None:
        raise ConfigError(f"unsupported store URL {text!r}: use s3://, file:// or a path")
    return LocalStore(path, options)
