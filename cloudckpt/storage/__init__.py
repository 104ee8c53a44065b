"""Async object storage: the ``ObjectStore`` protocol, ``S3Store`` (aiobotocore) and
``LocalStore`` (directories). Never imports torch.

``open_store(url, options)`` picks the backend: ``s3://bucket/prefix`` -> ``S3Store``;
``file:///path`` or a plain path -> ``LocalStore``; anything else is refused
(``parse_store_url``, :mod:`cloudckpt.storage.urls`).

``S3Store`` is imported on first use (aiobotocore, botocore and aiohttp take a good part of a
second to import): a process that only uses ``file://`` never imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cloudckpt.storage.base import (
    CommonPrefix,
    ObjectInfo,
    ObjectStore,
    ReadRange,
    StoreStats,
    UploadInfo,
)
from cloudckpt.storage.local.store import LocalStore
from cloudckpt.storage.options import RetryOptions, StorageOptions
from cloudckpt.storage.stores import local_path, open_store
from cloudckpt.storage.urls import StoreURL, parse_store_url

if TYPE_CHECKING:
    from cloudckpt.storage.s3.store import S3Store

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
    "StoreURL",
    "UploadInfo",
    "local_path",
    "open_store",
    "parse_store_url",
]


def __getattr__(name: str) -> type[S3Store]:
    if name == "S3Store":
        from cloudckpt.storage.s3.store import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
