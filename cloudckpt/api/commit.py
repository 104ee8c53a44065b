"""The commit of a save: its manifest written in create mode (:func:`write_manifest`; a
committed checkpoint there: ``CheckpointExists``, also refused up front by
:func:`refuse_existing`), or replacing a committed checkpoint (``SaveOptions(if_exists=
"replace")``).

Replacing (the coordinator, in ``save commit``; the checkpoint's own store, keys relative to it):

1. before the swap, :func:`replaced_attempts` reads the committed manifest (one bounded GET) and
   notes the attempts of the data objects it keeps in its own folder;
2. the new manifest overwrites the old one: the commit (readers get one or the other whole);
3. after it, :func:`collect_replaced` deletes the owned data objects (and unfinished uploads of
   such keys) that the new manifest does not use and that either belong to an attempt the old
   manifest used, or are older than :data:`STALE_AFTER` (a killed save's leftovers; a save of
   the same name still running elsewhere keeps its fresh objects). Never another folder's
   objects, never keys the layout does not own (:func:`cloudckpt.layout.owned_key`). A folder
   holding pins (other checkpoints of an incremental run use its objects) is left whole: the
   ``CheckpointManager``'s clean-up after its saves and ``prune`` judge those references
   (:mod:`cloudckpt.runs.cleanup`). A failure here does not fail the committed save: it is
   logged (WARNING) and the next replacing save collects what is left.
"""

from __future__ import annotations

import logging
import time

from cloudckpt.errors import (
    CheckpointExists,
    CloudCkptError,
    ManifestError,
    ObjectExists,
    ObjectNotFound,
)
from cloudckpt.layout import DATA_PREFIX, MANIFEST_KEY, PINS_PREFIX, data_key_attempt
from cloudckpt.manifest.codec import encode_manifest
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes
from cloudckpt.wording import plural

__all__ = [
    "STALE_AFTER",
    "collect_replaced",
    "refuse_existing",
    "replaced_attempts",
    "write_manifest",
]

#: Seconds after which an object of an attempt no manifest names counts as a killed save's.
STALE_AFTER = 3600.0
_BATCH = 1000

log = logging.getLogger(__name__)


def refuse_existing(url: str, store) -> None:
    """``CheckpointExists`` when a checkpoint is committed at ``url`` (its manifest's HEAD)."""
    try:
        run_coroutine(store.head(MANIFEST_KEY))
    except ObjectNotFound:
        return
    raise CheckpointExists(f"a checkpoint is already committed at {url}")


def write_manifest(url: str, store, manifest, *, replace: bool) -> None:
    """The commit: ``manifest`` written in create mode, or, with ``replace``, over the committed
    one, whose objects are collected after (module docstring)."""
    old = replaced_attempts(store) if replace else frozenset()
    body = encode_manifest(manifest)
    try:
        run_coroutine(store.put(MANIFEST_KEY, body, mode="overwrite" if replace else "create"))
    except ObjectExists as exc:
        raise CheckpointExists(f"a checkpoint was committed at {url} meanwhile") from exc
    if replace:  # committed: what the replaced checkpoint alone used goes now
        collect_replaced(url, store, old, manifest)


def own_attempts(manifest) -> frozenset[str]:
    """The attempts of the data objects ``manifest`` keeps in its own folder."""
    return frozenset(
        a
        for home, key in zip(manifest.object_homes, manifest.objects)
        if not home and (a := data_key_attempt(key)) is not None
    )


def replaced_attempts(store) -> frozenset[str]:
    """The attempts of the committed checkpoint about to be replaced (none when there is none, or
    when its manifest does not decode: its objects then go by age only)."""
    try:
        manifest, _ = decode_manifest_without_pickle(
            run_coroutine(fetch_manifest_bytes(store, MANIFEST_KEY))
        )
    except ObjectNotFound:
        return frozenset()
    except ManifestError as exc:
        log.warning("replacing a checkpoint whose manifest does not decode (%s)", exc)
        return frozenset()
    return own_attempts(manifest)


def collect_replaced(url: str, store, old: frozenset[str], manifest) -> int:
    """Step 3 of the module docstring; returns the objects deleted (0 after a logged failure)."""
    try:
        return run_coroutine(_collect(store, old, own_attempts(manifest), time.time()))
    except (CloudCkptError, OSError) as exc:
        log.warning(
            "%s is replaced, but the objects of the checkpoint it replaced could not all be "
            "deleted (the next replacing save retries): %s",
            url,
            exc,
        )
        return 0


async def _collect(store, old: frozenset[str], used: frozenset[str], now: float) -> int:
    async for _ in store.list(PINS_PREFIX):
        log.info("kept the replaced checkpoint's objects: other checkpoints pin them")
        return 0

    def doomed(key: str, modified: float | None) -> bool:
        attempt = data_key_attempt(key)
        if attempt is None or attempt in used:
            return False
        return attempt in old or (modified is not None and modified <= now - STALE_AFTER)

    keys = [i.key async for i in store.list(DATA_PREFIX) if doomed(i.key, i.last_modified)]
    for k in range(0, len(keys), _BATCH):
        await store.delete(keys[k : k + _BATCH])
    uploads = [u for u in await store.list_uploads(DATA_PREFIX) if doomed(u.key, u.initiated)]
    for upload in uploads:
        await store.abort_upload(upload)
    if keys or uploads:
        log.info(
            "replaced: deleted %s and %s of the old checkpoint",
            plural(len(keys), "object"),
            plural(len(uploads), "upload"),
        )
    return len(keys)
