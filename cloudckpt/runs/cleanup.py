"""Deleting what a checkpoint owns, and nothing else.

Used by :mod:`cloudckpt.runs.manager` and the ``cloudckpt`` command. Every deletion (``delete``,
``prune``, the clean-up of killed attempts after a save, ``cloudckpt rm`` / ``prune``) is planned
first by one of the ``plan_*`` functions, then done by :func:`carry_out`. A plan holds only keys
:func:`cloudckpt.layout.owned_key` accepts (the checkpoint's ``manifest.msgpack`` and data objects
``data/<attempt>/r<rank>-<n>.bin``) and unfinished uploads of such keys (S3 multipart uploads,
LocalStore temporary files). Any other key under the prefix is counted in the plan as *left*,
never deleted, and :func:`carry_out` logs it (INFO). The manifest goes first, so a checkpoint
stops being complete before any of its data goes.

Keys are relative to the store the plan was made on; a checkpoint is the keys under ``prefix``
('' for the store's root). When ``prefix`` is one folder of the store (``"<folder>/"``: the store
is the run root), the checkpoint's objects may be referenced by incremental checkpoints of sibling
folders: every plan then leaves out the objects :func:`cloudckpt.runs.refs.folder_references` says
are kept (counted in ``kept``), and :func:`delete_checkpoint` removes the manifest *before* it
asks, then removes the checkpoint's own pins in the folders it referenced and collects those
folders too: only those that held its pin, so that a forged or damaged manifest never widens a
deletion to a sibling (see docs/architecture.md, "Deleting with references"). A checkpoint at
the store's root ('') has no siblings: nothing can reference it. On a LocalStore, a checkpoint
folder that is a symlink leading outside the store's root is refused (``AccessDenied`` from the
manifest's HEAD) before anything is listed or deleted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from cloudckpt.errors import CloudCkptError, ObjectNotFound
from cloudckpt.layout import (
    DATA_PREFIX,
    MANIFEST_KEY,
    data_key_attempt,
    owned_key,
    parse_pin_key,
    pin_key,
)
from cloudckpt.runs.refs import FolderRefs, folder_references, judge_pin, read_manifest_or_none
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes
from cloudckpt.wording import plural

#: Keys per delete request (the S3 DeleteObjects limit).
DELETE_BATCH = 1000
#: Foreign keys a plan names (it counts them all).
LEFT_EXAMPLES = 5

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class DeletionPlan:
    """What one deletion removes: ``objects`` (store-relative keys; the manifest first when it
    goes) and ``uploads`` (unfinished uploads of owned keys). ``left`` counts the keys under
    ``prefix`` the layout does not own (never removed); ``left_examples`` names the first few.
    ``kept``: owned objects that stay because other checkpoints reference them (or an
    incremental save running elsewhere pinned them)."""

    prefix: str
    objects: tuple[str, ...] = ()
    uploads: tuple = ()
    left: int = 0
    left_examples: tuple[str, ...] = ()
    kept: int = 0

    @property
    def empty(self) -> bool:
        """Nothing to remove (there may still be keys left)."""
        return not self.objects and not self.uploads

    @property
    def has_manifest(self) -> bool:
        return bool(self.objects) and self.objects[0] == self.prefix + MANIFEST_KEY


class _Sorter:
    """Splits the keys under a prefix into owned (kept when ``wanted(rel)``, or when ``refs``
    keeps them) and left."""

    def __init__(self, prefix: str, refs: FolderRefs | None = None):
        self.prefix, self.left, self.refs, self.kept = prefix, 0, refs, 0
        self.objects: list[str] = []
        self.examples: list[str] = []

    def add(self, key: str, wanted: bool = True) -> None:
        rel = key[len(self.prefix) :]
        if owned_key(rel):
            if (
                wanted
                and rel != MANIFEST_KEY
                and self.refs is not None
                and _refs_keep(self.refs, rel)
            ):
                self.kept += 1
            elif wanted and rel != MANIFEST_KEY:
                self.objects.append(key)
            return
        self.left += 1
        if len(self.examples) < LEFT_EXAMPLES:
            self.examples.append(rel)

    def plan(self, manifest: bool, uploads: Iterable) -> DeletionPlan:
        head = (self.prefix + MANIFEST_KEY,) if manifest else ()
        return DeletionPlan(
            prefix=self.prefix,
            objects=head + tuple(self.objects),
            uploads=tuple(uploads),
            left=self.left,
            left_examples=tuple(self.examples),
            kept=self.kept,
        )


def _refs_keep(refs: FolderRefs, rel: str) -> bool:
    """Whether ``refs`` keeps the owned key ``rel``: a referenced or pinned data object, or a
    pin that still protects something (pins go with the folder's last referenced object)."""
    if parse_pin_key(rel) is not None:
        return rel not in refs.stale_pins and (refs.pinned or bool(refs.keys))
    return refs.keeps(rel)


def _folder(prefix: str) -> str | None:
    """The folder of a one-segment ``prefix`` ("<folder>/"), else None (no siblings)."""
    name = prefix[:-1] if prefix.endswith("/") else ""
    return name if name and "/" not in name else None


async def _refs(store, prefix: str, now: float | None) -> FolderRefs | None:
    folder = _folder(prefix)
    return None if folder is None else await folder_references(store, folder, now=now)


async def _has_manifest(store, prefix: str) -> bool:
    """HEAD of the manifest; on a LocalStore it also refuses a prefix that leads outside the
    root through a symlink (``AccessDenied``), whether the manifest exists or not."""
    try:
        await store.head(prefix + MANIFEST_KEY)
        return True
    except ObjectNotFound:
        return False


def _owned_uploads(uploads, prefix: str, wanted=lambda rel: True) -> list:
    return [
        u
        for u in uploads
        if u.key.startswith(prefix)
        and owned_key(u.key[len(prefix) :])
        and wanted(u.key[len(prefix) :])
    ]


async def plan_checkpoint(store, prefix: str, *, now: float | None = None) -> DeletionPlan:
    """Deleting the whole checkpoint at ``prefix``, complete or not: its manifest, every data
    object of every attempt, every unfinished upload of those keys, its pins; less what other
    checkpoints reference (``kept``; see the module docstring). Removes nothing: the plan of a
    real deletion is made after the manifest is gone (:func:`delete_checkpoint`)."""
    manifest = await _has_manifest(store, prefix)
    sorter = _Sorter(prefix, await _refs(store, prefix, now))
    async for item in store.list(prefix):
        sorter.add(item.key)
    return sorter.plan(manifest, _owned_uploads(await store.list_uploads(prefix), prefix))


async def plan_stale_attempts(store, prefix: str, *, now: float | None = None) -> DeletionPlan:
    """After a save committed at ``prefix``: the data objects and uploads of the other (killed)
    attempts at that prefix, and unfinished uploads of the manifest's key (a killed attempt's
    commit). The committed manifest, the objects of its own attempt, the pins and whatever other
    checkpoints reference stay."""
    raw = await fetch_manifest_bytes(store, prefix + MANIFEST_KEY)
    manifest, _ = decode_manifest_without_pickle(raw)
    used = {
        data_key_attempt(k) for h, k in zip(manifest.object_homes, manifest.objects) if not h
    } - {None}

    def stale(rel: str) -> bool:
        return rel == MANIFEST_KEY or (
            data_key_attempt(rel) is not None and data_key_attempt(rel) not in used
        )

    sorter = _Sorter(prefix, await _refs(store, prefix, now))
    async for item in store.list(prefix):
        sorter.add(item.key, stale(item.key[len(prefix) :]))
    uploads = _owned_uploads(await store.list_uploads(prefix), prefix, stale)
    return sorter.plan(False, uploads)


async def plan_abandoned(
    store, prefix: str, uploads, cutoff: float, *, now: float | None = None
) -> DeletionPlan | None:
    """An incomplete checkpoint's owned objects and ``uploads`` (its unfinished uploads, from a
    listing of the run) older than ``cutoff`` (epoch seconds), less what other checkpoints
    reference or pin (``kept``); ``None`` when any owned object or upload that would go is newer,
    or the manifest appeared (the save is alive, or committed: nothing goes)."""
    refs = await _refs(store, prefix, now)
    if refs is not None and refs.pinned:
        return None  # an incremental save running elsewhere may need any of it
    sorter, fresh = _Sorter(prefix, refs), False
    async for item in store.list(prefix):
        rel = item.key[len(prefix) :]
        if rel == MANIFEST_KEY:
            return None  # committed since the listing
        old = item.last_modified is not None and item.last_modified <= cutoff
        pin = parse_pin_key(rel) is not None  # written by other folders' saves: no sign of life
        kept = refs is not None and owned_key(rel) and _refs_keep(refs, rel)
        fresh = fresh or (owned_key(rel) and not pin and not old and not kept)
        sorter.add(item.key, old or pin)
    stale = []
    for upload in _owned_uploads(uploads, prefix):
        if upload.initiated is None or upload.initiated > cutoff:
            fresh = True
        else:
            stale.append(upload)
    return None if fresh else sorter.plan(False, stale)


async def carry_out(
    store, plan: DeletionPlan, *, progress: Callable[[int], None] | None = None
) -> int:
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
        batch = objects[i : i + DELETE_BATCH]
        await store.delete(batch)
        removed += len(batch)
        if progress is not None:
            progress(len(batch))
    for upload in plan.uploads:
        await store.abort_upload(upload)
    if plan.left:
        log.info(
            "left %s under %s/%s that are not part of the checkpoint layout (e.g. %s)",
            plural(plan.left, "key"),
            getattr(store, "url", "?"),
            plan.prefix,
            ", ".join(plan.left_examples),
        )
    return removed


async def delete_checkpoint(
    store,
    prefix: str,
    *,
    progress: Callable[[int], None] | None = None,
    now: float | None = None,
    cutoff: float | None = None,
) -> int:
    """Delete the checkpoint at ``prefix``; returns the number of objects removed, the manifest
    included (:func:`uncommit_and_plan`, :func:`carry_out`, then :func:`collect_homes` of the
    folders it referenced with ``cutoff``, default: an hour before ``now``)."""
    plan, homes = await uncommit_and_plan(store, prefix, now=now)
    removed = await carry_out(store, plan, progress=progress)
    now = time.time() if now is None else now
    await collect_homes(store, homes, cutoff=now - 3600.0 if cutoff is None else cutoff, now=now)
    return removed


async def uncommit_and_plan(
    store, prefix: str, *, now: float | None = None
) -> tuple[DeletionPlan, frozenset[str]]:
    """The first half of deleting the checkpoint at ``prefix``: read its manifest, delete it,
    delete its pins in the folders it referenced; then plan the rest (:func:`plan_checkpoint`,
    the manifest first in the plan when there was one). Returns the plan and the folders the
    checkpoint referenced (to :func:`collect_homes` once the plan is carried out): only those
    homes of its manifest that hold its save's pin, never its own folder, so that a forged or
    damaged manifest cannot widen a deletion to a sibling folder."""
    folder = _folder(prefix)
    if folder is None:
        return await plan_checkpoint(store, prefix, now=now), frozenset()
    committed = await _has_manifest(store, prefix)  # refuses a symlink out of the run first
    homes: frozenset[str] = frozenset()
    if committed:
        try:
            manifest = await read_manifest_or_none(store, folder)
        except CloudCkptError as exc:  # damaged: its pins elsewhere expire on their own
            log.warning("deleting %s: its manifest cannot be read (%s)", folder, exc)
            manifest = None
        await store.delete([prefix + MANIFEST_KEY])  # uncommitted: nothing new may use it
        if manifest is not None and manifest.attempt:
            named = sorted({h for h in manifest.object_homes if h and h != folder})
            pins = [f"{h}/{pin_key(manifest.attempt, folder)}" for h in named]
            homes = await _really_pinned(store, named, pins)
            if pins:
                await store.delete(pins)
    plan = await plan_checkpoint(store, prefix, now=now)
    if committed:
        plan = replace(plan, objects=(prefix + MANIFEST_KEY,) + plan.objects)
    return plan, homes


async def _really_pinned(store, homes: list[str], pins: list[str]) -> frozenset[str]:
    """Of the folders a manifest being deleted names as homes, those holding its pin (HEAD of
    each, 16 at a time): the save that wrote the manifest really referenced them. A home
    without it was named by a forged or damaged manifest: it is not collected."""
    sem = asyncio.Semaphore(16)

    async def pinned(home: str, key: str) -> str | None:
        async with sem:
            try:
                await store.head(key)
            except ObjectNotFound:
                return None
        return home

    found = await asyncio.gather(*(pinned(h, k) for h, k in zip(homes, pins)))
    unpinned = len(homes) - sum(f is not None for f in found)
    if unpinned:
        log.warning(
            "the manifest being deleted names %s holding no pin of its save as homes: "
            "left alone (a forged or damaged reference)",
            plural(unpinned, "folder"),
        )
    return frozenset(f for f in found if f is not None)


async def collect_homes(store, homes, *, cutoff: float, now: float | None = None) -> list:
    """After a checkpoint that referenced the folders ``homes`` was deleted: remove what is no
    longer referenced of those among them that have no manifest (retained only for references),
    by the rule of :func:`plan_abandoned` with ``cutoff``. Returns ``(folder, plan)`` of each
    folder collected."""
    done = []
    for home in sorted(homes):
        if await _has_manifest(store, home + "/"):
            continue
        uploads = await store.list_uploads(home + "/")
        plan = await plan_abandoned(store, home + "/", uploads, cutoff, now=now)
        if plan is not None and not plan.empty:
            await carry_out(store, plan)
            done.append((home, plan))
    return done


async def sweep_pins(
    store, *, now: float | None = None, folder: str | None = None, thorough: bool = False
) -> int:
    """Remove the pins of the run (a store at its root) that protect nothing any more; returns
    how many. Judged like :func:`cloudckpt.runs.refs.folder_references` does (a pin not backed by
    its attempt's committed manifest lives until its lease is over). Looked at: the pins whose
    saving folder has no manifest in one ``delimiter="/data/"`` listing (saves killed before
    they committed, checkpoints whose deletion was cut short); with ``folder``, also every pin
    that folder's saves wrote; with ``thorough``, every pin (one manifest GET per folder that
    pins anything)."""
    now = time.time() if now is None else now
    items = [i async for i in store.list("", delimiter="/" + DATA_PREFIX)]
    committed = {
        i.key[: -len(MANIFEST_KEY) - 1]
        for i in items
        if hasattr(i, "key") and i.key.endswith("/" + MANIFEST_KEY)
    }
    candidates = []
    for info in items:
        home, sep, rel = getattr(info, "key", "").partition("/")
        named = parse_pin_key(rel) if sep and "/" not in home else None
        if named is not None and (thorough or named[1] == folder or named[1] not in committed):
            candidates.append((home, info))
    manifests: dict = {}
    verdicts = await asyncio.gather(
        *(judge_pin(store, h, i, now, manifests) for h, i in candidates)
    )
    stale = [i.key for (_, i), (v, _) in zip(candidates, verdicts) if v == "stale"]
    for k in range(0, len(stale), DELETE_BATCH):
        await store.delete(stale[k : k + DELETE_BATCH])
    return len(stale)


async def remove_stale_attempts(store, prefix: str, *, now: float | None = None) -> int:
    """Plan and delete the leftovers of killed attempts at a just-committed ``prefix``
    (:func:`plan_stale_attempts`); returns the number of objects removed."""
    return await carry_out(store, await plan_stale_attempts(store, prefix, now=now))
