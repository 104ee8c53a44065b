"""Deleting what a checkpoint owns, and nothing else.

Used by :mod:`cloudckpt.manager` and the ``cloudckpt`` command. Every deletion (``delete``,
``prune``, the clean-up of killed attempts after a save, ``cloudckpt rm`` / ``prune``) is planned
first by one of the ``plan_*`` functions, then done by :func:`carry_out`. A plan holds only keys
:func:`cloudckpt.layout.owned_key` accepts (the checkpoint's ``manifest.msgpack`` and data objects
``data/<attempt>/r<rank>-<n>.bin``) and unfinished uploads of such keys (S3 multipart uploads,
LocalStore temporary files). Any other key under the prefix is counted in the plan as *left*,
never deleted, and :func:`carry_out` logs it (INFO). The manifest goes first, so a checkpoint
stops being complete before any of its data goes.

Keys are relative to the store the plan was made on; a checkpoint is the keys under ``prefix``
('' for the store's root). A manifest's keys are relative to its own checkpoint root, so deleting
under one checkpoint's prefix never removes an object another manifest refers to. On a
LocalStore, a checkpoint folder that is a symlink leading outside the store's root is refused
(``AccessDenied`` from the manifest's HEAD) before anything is listed or deleted.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

from cloudckpt.api.manifest_io import fetch_manifest_bytes
from cloudckpt.errors import ObjectNotFound, PickleNotAllowed
from cloudckpt.layout import MANIFEST_KEY, data_key_attempt, owned_key
from cloudckpt.wording import plural

#: Keys per delete request (the S3 DeleteObjects limit).
DELETE_BATCH = 1000
#: Foreign keys a plan names (it counts them all).
LEFT_EXAMPLES = 5

log = logging.getLogger(__name__)


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


@dataclass(frozen=True, kw_only=True)
class DeletionPlan:
    """What one deletion removes: ``objects`` (store-relative keys; the manifest first when it
    goes) and ``uploads`` (unfinished uploads of owned keys). ``left`` counts the keys under
    ``prefix`` the layout does not own (never removed); ``left_examples`` names the first few."""

    prefix: str
    objects: tuple[str, ...] = ()
    uploads: tuple = ()
    left: int = 0
    left_examples: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        """Nothing to remove (there may still be keys left)."""
        return not self.objects and not self.uploads

    @property
    def has_manifest(self) -> bool:
        return bool(self.objects) and self.objects[0] == self.prefix + MANIFEST_KEY


class _Sorter:
    """Splits the keys under a prefix into owned (kept when ``wanted(rel)``) and left."""

    def __init__(self, prefix: str):
        self.prefix, self.objects, self.left, self.examples = prefix, [], 0, []

    def add(self, key: str, wanted: bool = True) -> None:
        rel = key[len(self.prefix):]
        if owned_key(rel):
            if wanted and rel != MANIFEST_KEY:
                self.objects.append(key)
            return
        self.left += 1
        if len(self.examples) < LEFT_EXAMPLES:
            self.examples.append(rel)

    def plan(self, manifest: bool, uploads: Iterable) -> DeletionPlan:
        head = (self.prefix + MANIFEST_KEY,) if manifest else ()
        return DeletionPlan(prefix=self.prefix, objects=head + tuple(self.objects),
                            uploads=tuple(uploads), left=self.left,
                            left_examples=tuple(self.examples))


async def _has_manifest(store, prefix: str) -> bool:
    """HEAD of the manifest; on a LocalStore it also refuses a prefix that leads outside the
    root through a symlink (``AccessDenied``), whether the manifest exists or not."""
    try:
        await store.head(prefix + MANIFEST_KEY)
        return True
    except ObjectNotFound:
        return False


def _owned_uploads(uploads, prefix: str, wanted=lambda rel: True) -> list:
    return [u for u in uploads
            if u.key.startswith(prefix) and owned_key(u.key[len(prefix):])
            and wanted(u.key[len(prefix):])]


async def plan_checkpoint(store, prefix: str) -> DeletionPlan:
    """Deleting the whole checkpoint at ``prefix``, complete or not: its manifest, every data
    object of every attempt, every unfinished upload of those keys."""
    manifest = await _has_manifest(store, prefix)
    sorter = _Sorter(prefix)
    async for item in store.list(prefix):
        sorter.add(item.key)
    return sorter.plan(manifest, _owned_uploads(await store.list_uploads(prefix), prefix))


async def plan_stale_attempts(store, prefix: str) -> DeletionPlan:
    """After a save committed at ``prefix``: the data objects and uploads of the other (killed)
    attempts at that prefix, and unfinished uploads of the manifest's key (a killed attempt's
    commit). The committed manifest and the objects of its own attempt stay."""
    raw = await fetch_manifest_bytes(store, prefix + MANIFEST_KEY)
    manifest, _ = decode_manifest_without_pickle(raw)
    used = {data_key_attempt(k) for k in manifest.objects} - {None}

    def stale(rel: str) -> bool:
        return rel == MANIFEST_KEY or data_key_attempt(rel) not in used

    sorter = _Sorter(prefix)
    async for item in store.list(prefix):
        sorter.add(item.key, stale(item.key[len(prefix):]))
    uploads = _owned_uploads(await store.list_uploads(prefix), prefix, stale)
    return sorter.plan(False, uploads)


async def plan_abandoned(store, prefix: str, uploads, cutoff: float) -> DeletionPlan | None:
    """An incomplete checkpoint's owned objects and ``uploads`` (its unfinished uploads, from a
    listing of the run) older than ``cutoff`` (epoch seconds); ``None`` when any owned object or
    upload is newer, or the manifest appeared (the save is alive, or committed: nothing goes)."""
    sorter, fresh = _Sorter(prefix), False
    async for item in store.list(prefix):
        rel = item.key[len(prefix):]
        if rel == MANIFEST_KEY:
            return None  # committed since the listing
        old = item.last_modified is not None and item.last_modified <= cutoff
        fresh = fresh or (owned_key(rel) and not old)
        sorter.add(item.key, old)
    stale = []
    for upload in _owned_uploads(uploads, prefix):
        if upload.initiated is None or upload.initiated > cutoff:
            fresh = True
        else:
            stale.append(upload)
    return None if fresh else sorter.plan(False, stale)


async def carry_out(store, plan: DeletionPlan, *,
                    progress: Callable[[int], None] | None = None) -> int:
    """Delete what ``plan`` names: the manifest alone first, then the other objects in batches of
    :data:`DELETE_BATCH`, then abort the uploads. Returns the number of objects removed (uploads
    not counted). Keys already gone are fine. Logs the keys the plan left in place."""
    objects = list(plan.objects)
    removed = 0
    if plan.has_manifest:
        await store.delete(objects[:1])
        removed, objects = 1, objects[1:]
        if progress is not None:
            progress(1)
    for i in range(0, len(objects), DELETE_BATCH):
        batch = objects[i:i + DELETE_BATCH]
        await store.delete(batch)
        removed += len(batch)
        if progress is not None:
            progress(len(batch))
    for upload in plan.uploads:
        await store.abort_upload(upload)
    if plan.left:
        log.info("left %s under %s/%s that are not part of the checkpoint layout "
                    "(e.g. %s)", plural(plan.left, "key"), getattr(store, "url", "?"), plan.prefix,
                    ", ".join(plan.left_examples))
    return removed


async def delete_checkpoint(store, prefix: str, *,
                            progress: Callable[[int], None] | None = None) -> int:
    """Plan and delete the checkpoint at ``prefix`` (:func:`plan_checkpoint`); returns the number
    of objects removed, the manifest included."""
    return await carry_out(store, await plan_checkpoint(store, prefix), progress=progress)


async def remove_stale_attempts(store, prefix: str) -> int:
    """Plan and delete the leftovers of killed attempts at a just-committed ``prefix``
    (:func:`plan_stale_attempts`); returns the number of objects removed."""
    return await carry_out(store, await plan_stale_attempts(store, prefix))
