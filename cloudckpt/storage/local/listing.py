"""Listings of a :class:`~cloudckpt.storage.local.store.LocalStore` (blocking: run in its pool):
the objects and common prefixes under a prefix, and the unfinished uploads (leftover temporary
files, :mod:`cloudckpt.storage.local.files`). Only what ``Jail`` reaches is listed."""

from __future__ import annotations

from cloudckpt.storage.base import CommonPrefix, ObjectInfo, UploadInfo
from cloudckpt.storage.local.files import TMP_MARK, TMP_RE, object_info
from cloudckpt.storage.local.paths import Jail, dir_level, has_files, walk_files


def dir_hint(prefix: str) -> str:
    """The deepest directory (relative, "" or ending in "/") every key with ``prefix`` is under."""
    return prefix[: prefix.rfind("/") + 1]


def list_tree(jail: Jail, prefix: str, delimiter: str | None) -> list[ObjectInfo | CommonPrefix]:
    """Keys under ``prefix`` in order, rolled up at ``delimiter`` (``ObjectStore.list``)."""
    hint = dir_hint(prefix)
    if delimiter == "/":  # one directory level is enough
        out: list[ObjectInfo | CommonPrefix] = []
        for rel, st in dir_level(jail, hint, TMP_MARK):
            if not rel.rstrip("/").startswith(prefix):
                continue
            if st is None:
                if has_files(jail, rel, TMP_MARK):
                    out.append(CommonPrefix(rel))
            else:
                out.append(object_info(rel, st))
        return sorted(out, key=lambda x: x.key if isinstance(x, ObjectInfo) else x.prefix)
    files = sorted(
        (rel, st)
        for rel, st in walk_files(jail, hint, temps=False, mark=TMP_MARK)
        if rel.startswith(prefix)
    )
    out = []
    last_prefix = None
    for rel, st in files:
        if delimiter:
            cut = rel.find(delimiter, len(prefix))
            if cut >= 0:
                common = rel[: cut + len(delimiter)]
                if common != last_prefix:
                    out.append(CommonPrefix(common))
                    last_prefix = common
                continue
        out.append(object_info(rel, st))
    return out


def scan_uploads(jail: Jail, prefix: str) -> list[UploadInfo]:
    """The temporary files of unfinished writes whose key starts with ``prefix``, by key."""
    found = []
    for rel, st in walk_files(jail, dir_hint(prefix), temps=True, mark=TMP_MARK):
        name = rel.rpartition("/")[2]
        m = TMP_RE.match(name)
        if not m:
            continue
        key = rel[: len(rel) - len(name)] + m.group("name")
        if key.startswith(prefix):
            found.append(UploadInfo(key=key, upload_id=name, initiated=st.st_mtime))
    return sorted(found, key=lambda u: (u.key, u.initiated or 0.0, u.upload_id))
