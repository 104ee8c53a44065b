"""Checkpoint paths as Lightning passes them, and the one alias the integration adds.

Lightning resolves ``ckpt_path="last"`` by asking fsspec for the filesystem of each candidate
(``fs.exists``, ``fs.modified``): an ``s3://`` candidate would need s3fs, whose ``modified`` of a
folder fails. :class:`~cloudckpt.integrations.lightning.model_checkpoint.CloudModelCheckpoint`
hands such candidates over as ``cloudckpt+s3://...``, a protocol this package registers with
fsspec (:mod:`cloudckpt.integrations.lightning.folder_view`); the plugin reads it as ``s3://...``.
"""

from __future__ import annotations

import os
from typing import Any

ALIAS = "cloudckpt+"


def checkpoint_url(path: Any) -> str:
    """The cloudckpt URL of a checkpoint path Lightning passes (str or PathLike; alias removed)."""
    text = os.fspath(path)
    return text[len(ALIAS) :] if text.startswith(ALIAS) else text


def is_remote(path: Any) -> bool:
    """A URL with a scheme (``s3://``), not a local path."""
    return "://" in os.fspath(path)


def aliased(url: str) -> str:
    """``url`` as a candidate Lightning's fsspec lookups resolve through cloudckpt."""
    return ALIAS + url if is_remote(url) and not url.startswith(ALIAS) else url
