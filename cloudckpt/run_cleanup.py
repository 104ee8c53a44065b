"""Deleting a run's objects safely: whole checkpoints and a killed attempt's leftovers.

Used by :mod:`cloudckpt.manager`. Every function works on a store rooted at the run and keys
relative to it. A checkpoint's manifest keys are relative to its own root, so deleting only
under one checkpoint's prefix never removes an object another manifest refers to.
"""

from __future__ import annotations

from typing import Callable

from cloudckpt.api.manifest_io import fetch_manifest_bytes
from cloudckpt.errors import ObjectNotFound, PickleNotAllowed
from cloudckpt.layout import MANIFEST_KEY

#: Keys per delete request (the S3 DeleteObjects limit).
DELETE_BATCH = 1000


def decode_manifest_without_pickle(raw: bytes):
    """Decode and validate manifest bytes without ever unpickling: returns the ``Manifest`` (each
    pickled value replaced by ``None``) and the names of the pickled values. For listings and
    inspection, where the values themselves are not needed. The bytes are checked and parsed
    once; anything malformed (pickle outside the values included) raises ``ManifestError``."""
    from dataclasses import replace

    from cloudckpt.manifest import encode_value, is_pickled
    from cloudckpt.manifest.codec import manifest_from_document, read_document

    document = read_document(raw)
    try:
        return manifest_from_document(document, allow_pickle=False), ()
    except PickleNotAllowed as exc:
        refused = exc
    values = document.fields.get("values")
    if type(values) is not dict:
        raise refused
    values, pickled = dict(values), []
    for name, blob in values.items():
        if type(name) is str and type(blob) is bytes and is_pickled(blob, key=name):
            values[name] = encode_value(None, key=name, allow_pickle=False)
            pickled.append(name)
    if not pickled:  # the pickle is elsewhere (metadata, structure): refused as it is
        raise refused
    fields = {**document.fields, "values": values}
    return manifest_from_document(replace(document, fields=fields), allow_pickle=False), \
        tuple(sorted(pickled))


async def _delete_keys(store, keys, progress: Callable[[int], None] | None = None) -> int:
    """Delete ``keys`` (an iterable or async iterable) in batches of :data:`DELETE_BATCH`."""
    removed, batch = 0, []

    async def flush() -> None:
        nonlocal removed, batch
        await store.delete(batch)
        removed += len(batch)
        if progress is not None:
            progress(len(batch))
        batch = []

    if not hasattr(keys, "__aiter__"):
        keys = _each(keys)
    async for key in keys:
        batch.append(key)
        if len(batch) >= DELETE_BATCH:
            await flush()
    if batch:
        await flush()
    return removed


async def _each(items):
    for item in items:
        yield item


async def _keys_under(store, prefix: str, keep=lambda rel: False):
    async for item in store.list(prefix):
        if not keep(item.key[len(prefix):]):
            yield item.key


async def _remove_stale_attempts(store, prefix: str) -> None:
    """Delete the objects and uploads under checkpoint ``prefix`` that its committed manifest
    does not use: leftovers of a killed earlier attempt at the same step."""
    manifest, _ = decode_manifest_without_pickle(await fetch_manifest_bytes(store, prefix + MANIFEST_KEY))
    used = {k.rsplit("/", 1)[0] + "/" for k in manifest.objects}

    def keep(rel: str) -> bool:
        return rel == MANIFEST_KEY or any(rel.startswith(d) for d in used)

    await _delete_keys(store, _keys_under(store, prefix, keep))
    # an unfinished upload of the manifest's key is a killed attempt's commit: never needed
    for upload in await store.list_uploads(prefix):
        if upload.key[len(prefix):] == MANIFEST_KEY or not keep(upload.key[len(prefix):]):
            await store.abort_upload(upload)


async def delete_prefix(store, prefix: str, *,
                        progress: Callable[[int], None] | None = None) -> int:
    """Delete the checkpoint whose root is ``prefix`` in ``store`` ('' for the store's root):
    manifest first, then every object under ``prefix`` in batches, then unfinished uploads.
    Returns the number of objects removed (the manifest included)."""
    manifest_key = prefix + MANIFEST_KEY
    removed = 0
    try:
        await store.head(manifest_key)
        await store.delete([manifest_key])
        removed += 1
    except ObjectNotFound:
        pass
    removed += await _delete_keys(store, _keys_under(store, prefix), progress)
    for upload in await store.list_uploads(prefix):
        await store.abort_upload(upload)
    return removed
