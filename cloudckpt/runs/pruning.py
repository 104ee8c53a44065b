"""Listing a run and pruning it: which checkpoint folders a store holds (``step-<N>`` or any
name a trainer chose), which of them the retention policy and the grace period for abandoned
saves let go, and their removal.

Works on one ``ObjectStore`` opened at the run root (keys relative to it; the checkpoint folders of
:mod:`cloudckpt.layout`), on the caller's event loop; no torch, no collectives. A listing is a
list of :class:`CheckpointInfo` (:func:`list_run`, :func:`checkpoint_details`); the step a
resume loads is :func:`latest_loadable`'s. What goes is
always planned by :mod:`cloudckpt.runs.cleanup` and removed by its ``carry_out`` (owned keys only,
manifest first; objects that other checkpoints reference, or incremental saves running
elsewhere pinned, stay). Costs and guarantees are those stated in :mod:`cloudckpt.runs.manager`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from cloudckpt.errors import CheckpointNotFound, ManifestError, ObjectNotFound
from cloudckpt.layout import (
    DATA_PREFIX,
    LIST_DELIMITER,
    MANIFEST_KEY,
    StepState,
    add_uploads,
    classify_listing,
    data_key_attempt,
    folder_label,
    folder_of_prefix,
    join_url,
    parse_step_dir,
    step_of_name,
)
from cloudckpt.runs.cleanup import (
    DeletionPlan,
    carry_out,
    collect_homes,
    plan_abandoned,
    plan_checkpoint,
    sweep_pins,
    uncommit_and_plan,
)
from cloudckpt.runs.refs import describe_holders
from cloudckpt.runs.retention import RetentionPolicy, select_names
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes

__all__ = [
    "HEAD_CONCURRENCY",
    "CheckpointInfo",
    "checkpoint_details",
    "checkpoint_info",
    "latest_loadable",
    "list_run",
    "newest_readable",
    "order_key",
    "prune_run",
    "scan_run",
    "folder_has_objects",
    "folder_holders",
]

#: HEAD / GET requests of manifests a listing keeps in flight at once.
HEAD_CONCURRENCY = 32
#: Keys of a ``<name>/data/`` folder looked at for a data object of the layout, for a folder not
#: named ``step-<N>`` that has no manifest and no pins (one list request).
OWNED_PROBE = 1000

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One checkpoint of a run.

    ``name`` is its folder's name (``step-000000000100``, ``last``, ``epoch=0-step=10.ckpt``) and
    ``url`` its URL. ``step`` is the step saved in its manifest's metadata (``"step"``, an int),
    else the last number in its name (:func:`cloudckpt.layout.step_of_name`), else ``None``; an
    incomplete checkpoint's comes from its name. ``created_at`` is when the manifest was committed
    (the store's last-modified time) and is ``None`` for an incomplete checkpoint.
    ``total_bytes``, ``objects`` and ``world_size`` come from the manifest: ``None`` unless
    details were asked for (and always for incomplete ones). So do ``own_bytes`` (chunk bytes
    stored in the checkpoint's own folder), ``shared_bytes`` (chunk bytes it references in older
    checkpoints' folders: an incremental checkpoint) and ``base_step`` (the step of the
    checkpoint it was saved against, ``None`` for a full one). ``damaged``: with details, the
    reason a complete checkpoint's manifest could not be decoded (its checksum or structure is
    wrong: it cannot be loaded); ``None`` otherwise. ``retained`` (listed with details only): a
    deleted checkpoint whose folder stays for the pins in it. ``held_by`` (details only): one
    line for each pin in the folder, saying which checkpoint or running save holds which
    objects, until when, or that prune removes it (:func:`cloudckpt.runs.refs.describe_holders`).
    ``tiers``: with a local tier (``CheckpointManager(local=...)``), where the step is complete:
    ``"local"`` (this node's tier alone), ``"peers"`` (the nodes' tiers together), ``"store"``
    (the object store).
    """

    step: int | None
    url: str
    complete: bool
    name: str = ""
    created_at: datetime | None = None
    manifest_bytes: int | None = None
    total_bytes: int | None = None
    objects: int | None = None
    world_size: int | None = None
    own_bytes: int | None = None
    shared_bytes: int | None = None
    base_step: int | None = None
    damaged: str | None = None
    retained: bool = False
    held_by: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()


def _utc(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, tz=timezone.utc)


def checkpoint_info(
    run_url: str, name: str, state: StepState, step: int | None = None
) -> CheckpointInfo:
    """Folder ``name`` of the run at ``run_url`` as its listing ``state`` shows it (no details);
    ``step``: the one its manifest's metadata gives, else the name's."""
    m = state.manifest
    return CheckpointInfo(
        step=step_of_name(name) if step is None else step,
        name=name,
        url=join_url(run_url, name),
        complete=m is not None,
        created_at=None if m is None else _utc(m.last_modified),
        manifest_bytes=m.size if m is not None else None,
    )


def order_key(info: CheckpointInfo) -> tuple:
    """The order of a run's checkpoints, oldest first: by step (those with none first), then by
    commit time (incomplete ones after the complete ones of their step), then by name."""
    created = info.created_at.timestamp() if info.created_at is not None else float("inf")
    return (info.step is not None, info.step or 0, created, info.name)


def _manifest_key(name: str) -> str:
    return f"{name}/{MANIFEST_KEY}"


async def scan_run(store) -> dict[str, StepState]:
    """Every checkpoint folder of the run by one ``delimiter="/data/"`` walk of its root, plus
    one HEAD of the manifest of each folder that looks incomplete (so a complete one is never
    reported incomplete, including after SeaweedFS 4.48's paging skips keys after a ``data/``
    prefix)."""
    items = [item async for item in store.list("", delimiter=LIST_DELIMITER)]
    folders = classify_listing(items)
    suspects = [s for s, st in folders.items() if st.manifest is None]
    if suspects:
        sem = asyncio.Semaphore(HEAD_CONCURRENCY)

        async def _head(name: str):
            async with sem:
                try:
                    return name, await store.head(_manifest_key(name))
                except ObjectNotFound:
                    return name, None

        for name, info in await asyncio.gather(*(_head(s) for s in suspects)):
            folders[name].manifest = info
    named = [  # a data/ folder of some other layout does not make a checkpoint
        n
        for n, st in folders.items()
        if st.manifest is None and not st.pins and parse_step_dir(n + "/") is None
    ]
    if named:
        sem = asyncio.Semaphore(HEAD_CONCURRENCY)

        async def _owned(name: str) -> tuple[str, bool]:
            async with sem:
                return name, await _holds_data_object(store, name)

        for name, owned in await asyncio.gather(*(_owned(n) for n in named)):
            if not owned:
                del folders[name]
    return folders


async def _holds_data_object(store, name: str) -> bool:
    """Whether folder ``name``'s ``data/`` holds a data object of the layout among its first
    :data:`OWNED_PROBE` keys (a killed save's objects are the first ones listed)."""
    seen = 0
    async for item in store.list(f"{name}/{DATA_PREFIX}"):
        if data_key_attempt(item.key[len(name) + 1 :]) is not None:
            return True
        seen += 1
        if seen >= OWNED_PROBE:
            break
    return False


async def metadata_steps(store, folders: dict[str, StepState]) -> dict[str, int]:
    """The step each complete folder's manifest records in its metadata (``"step"``, an int),
    for the folders not named ``step-<012d>`` (one manifest GET each, :data:`HEAD_CONCURRENCY`
    at once; the canonical names are the steps the manager saved). A manifest that cannot be
    read or decoded gives none (its name's step is used; ``details`` report the damage)."""
    named = [
        n
        for n, st in folders.items()
        if st.manifest is not None and parse_step_dir(n + "/") is None
    ]
    sem = asyncio.Semaphore(HEAD_CONCURRENCY)

    async def _one(name: str) -> tuple[str, int | None]:
        async with sem:
            try:
                raw = await fetch_manifest_bytes(store, _manifest_key(name))
                manifest, _ = decode_manifest_without_pickle(raw)
            except (ObjectNotFound, ManifestError):
                return name, None
        step = manifest.metadata.get("step")
        ok = type(step) is int and step >= 0
        return name, step if ok else None

    found = await asyncio.gather(*(_one(n) for n in named))
    return {n: s for n, s in found if s is not None}


async def _infos(store, run_url: str, folders: dict[str, StepState]) -> list[CheckpointInfo]:
    steps = await metadata_steps(store, folders)
    infos = [checkpoint_info(run_url, n, st, steps.get(n)) for n, st in folders.items()]
    return sorted(infos, key=order_key)


async def list_run(
    store, run_url: str, *, details: bool = False, progress: Callable[[int], None] | None = None
) -> list[CheckpointInfo]:
    """Every checkpoint of the run in :func:`order_key` order (``CheckpointManager.list``):
    retained folders and each folder's holders with ``details`` only, with the manifests'
    details."""
    folders = await scan_run(store)
    if not details:
        folders = {n: st for n, st in folders.items() if not st.retained}
    infos = await _infos(store, run_url, folders)
    if not details:
        return infos
    infos = await read_details(store, infos, progress)
    held = await folder_holders(store, [n for n in folders if folders[n].pins])
    return [
        replace(i, retained=folders[i.name].retained, held_by=held.get(i.name, ())) for i in infos
    ]


async def checkpoint_details(store, run_url: str, name: str) -> CheckpointInfo:
    """Folder ``name``'s checkpoint with details; ``CheckpointNotFound`` if it is not
    complete."""
    try:
        head = await store.head(_manifest_key(name))
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no complete checkpoint at {join_url(run_url, name)}") from exc
    info = checkpoint_info(run_url, name, StepState(manifest=head))
    return (await read_details(store, [info], None))[0]


async def read_details(
    store, infos: list[CheckpointInfo], progress: Callable[[int], None] | None
) -> list[CheckpointInfo]:
    """``infos`` with what each complete checkpoint's manifest says (one GET each, at most
    :data:`HEAD_CONCURRENCY` at once); a manifest that does not decode sets ``damaged``, one
    deleted since the listing makes its checkpoint incomplete."""
    sem = asyncio.Semaphore(HEAD_CONCURRENCY)

    async def _one(info: CheckpointInfo) -> CheckpointInfo:
        if not info.complete:
            return info
        async with sem:
            try:
                raw = await fetch_manifest_bytes(store, _manifest_key(info.name))
            except ObjectNotFound:  # deleted since the listing
                return replace(info, complete=False, created_at=None)
        if progress is not None:
            progress(1)
        try:
            manifest, _ = decode_manifest_without_pickle(raw)
        except ManifestError as exc:  # listed as damaged; the other checkpoints still are
            return replace(info, damaged=str(exc))
        own = manifest.object_sizes()
        own_bytes = sum(n for (key, n), home in zip(own.items(), manifest.object_homes) if not home)
        step = manifest.metadata.get("step")
        return replace(
            info,
            step=step if type(step) is int and step >= 0 else info.step,
            total_bytes=int(manifest.total_bytes()),
            objects=len(manifest.objects),
            world_size=int(manifest.world_size),
            own_bytes=int(own_bytes),
            shared_bytes=int(manifest.total_bytes()) - int(own_bytes),
            base_step=step_of_name(manifest.base) if manifest.base else None,
        )

    return list(await asyncio.gather(*(_one(i) for i in infos)))


async def latest_loadable(store, run_url: str, complete: list[str]) -> str | None:
    """The newest of the ``complete`` folders (oldest first), its manifest checked to decode (one
    GET); ``None`` when none is left. ``ManifestError`` when that manifest is damaged, naming
    the checkpoint and the newest older one that decodes: a resume never falls back to an older
    one on its own (that would silently lose training), and never fails without saying which
    one would load."""
    while complete:
        newest = complete[-1]
        try:
            decode_manifest_without_pickle(await fetch_manifest_bytes(store, _manifest_key(newest)))
        except ObjectNotFound:  # deleted since the listing: the next newest is the latest
            complete = complete[:-1]
            continue
        except ManifestError as exc:
            older = await newest_readable(store, complete[:-1])
            if older is None:
                hint = "no older checkpoint of the run decodes either"
            else:
                arg = parse_step_dir(older + "/")
                arg_text = repr(older) if arg is None else str(arg)
                hint = (
                    f"the newest one that decodes is {folder_label(older)}: "
                    f"load(state_dict, step={arg_text}) resumes from it"
                )
            raise ManifestError(
                f"{folder_label(newest)} ({join_url(run_url, newest)}), the newest complete "
                f"checkpoint, cannot be loaded: {exc}. Not falling back on an older step by "
                f"itself: {hint} (`cloudckpt ls --details {run_url}` marks the damaged ones)"
            ) from exc
        return newest
    return None


async def newest_readable(store, complete: list[str]) -> str | None:
    """The newest of the ``complete`` folders (oldest first) whose manifest is still there and
    decodes (checksum and structure; pickled values are not unpickled), or ``None``. A damaged
    manifest is logged (WARNING) and skipped. One manifest GET per folder tried, newest
    first."""
    for name in reversed(complete):
        try:
            decode_manifest_without_pickle(await fetch_manifest_bytes(store, _manifest_key(name)))
        except ObjectNotFound:
            continue
        except ManifestError as exc:
            log.warning(
                "%s: its manifest is damaged, so it is not counted as the newest "
                "loadable checkpoint: %s",
                folder_label(name),
                exc,
            )
            continue
        return name
    return None


async def folder_has_objects(store, name: str) -> bool:
    """Whether anything is stored under folder ``name``: a finished object or an unfinished
    upload (of a killed attempt, say)."""
    async for _ in store.list(name + "/"):
        return True
    return bool(await store.list_uploads(name + "/"))


async def folder_holders(store, names, *, now: float | None = None) -> dict[str, tuple[str, ...]]:
    """What holds each of the folders ``names`` (folders holding pins): name -> the lines of
    :func:`cloudckpt.runs.refs.describe_holders`, the referrers' manifests read once."""
    manifests: dict = {}
    names = sorted(names)
    lines = await asyncio.gather(
        *(describe_holders(store, n, now=now, manifests=manifests) for n in names)
    )
    return dict(zip(names, lines))


async def prune_run(
    store,
    retention: RetentionPolicy,
    abandoned_after: float,
    *,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    now: float | None = None,
    run_url: str = "",
) -> list[tuple[CheckpointInfo, DeletionPlan]]:
    """Remove (unless ``dry_run``) the complete checkpoints ``retention`` does not keep and the
    incomplete ones whose owned objects and uploads are all older than ``abandoned_after``
    seconds (by this machine's clock, or ``now``); return each (as seen at ``run_url``) with
    the plan that was (or would be) carried out, in :func:`order_key` order. The rules see the
    complete checkpoints in that order (``keep_last`` keeps the last ones; ``keep_every``,
    ``keep_steps`` and ``keep_if`` judge each one's step, one without a step is kept by
    ``keep_last`` only). Each folder is planned just before it is removed, so a save that
    resumes at an abandoned folder keeps its fresh objects. Objects other checkpoints
    reference stay; once the checkpoints are removed, the folders they referenced that have no
    manifest are collected too (listed after the others), and the pins of saves that never
    committed are removed once their lease is over (``sweep_pins``).

    Whatever the policy says, the newest complete checkpoint in that order is kept, so is the
    last one committed when it has no step (ordered first, yet the newest), and so is the
    newest one whose manifest decodes (:func:`newest_readable`, read only when something would
    go): a damaged newest manifest never costs the last loadable checkpoint."""
    now = time.time() if now is None else now
    folders = add_uploads(await scan_run(store), await store.list_uploads(""))
    infos = await _infos(store, run_url, folders)
    complete = [i for i in infos if i.complete]
    doomed = select_names([(i.name, i.step) for i in complete], retention)
    if doomed:
        last_committed = max(complete, key=lambda i: (order_key(i)[2], order_key(i)))
        if last_committed.step is None:  # ordered first for want of a step, yet the newest
            doomed.discard(last_committed.name)
        doomed.discard(await newest_readable(store, [i.name for i in complete]))
    cutoff = now - abandoned_after
    removed: list[tuple[CheckpointInfo, DeletionPlan]] = []
    homes: set[str] = set()
    for info in infos:
        state, prefix = folders[info.name], info.name + "/"
        if state.manifest is not None:
            if info.name not in doomed:
                continue
            if dry_run:
                plan = await plan_checkpoint(store, prefix, now=now)
            else:  # the manifest goes before what it keeps is judged
                plan, used = await uncommit_and_plan(store, prefix, now=now)
                homes |= used
        else:
            abandoned = await plan_abandoned(store, prefix, state.uploads, cutoff, now=now)
            if abandoned is None or abandoned.empty:
                continue  # still being written (or vanished, or nothing of ours): kept
            plan = abandoned
        removed.append((info, plan))
        if not dry_run:
            await carry_out(store, plan, progress=progress)
    for home, plan in await collect_homes(store, homes, cutoff=cutoff, now=now):
        if folder_of_prefix(home + "/") is not None:
            state = folders.get(home, StepState())
            removed.append((checkpoint_info(run_url, home, state), plan))
    if not dry_run:
        await sweep_pins(store, now=now)
    return removed
