"""Listing a run and pruning it: which steps a store holds, which of them the retention policy
and the grace period for abandoned saves let go, and their removal.

Works on one ``ObjectStore`` opened at the run root (keys relative to it; the step prefixes of
:mod:`cloudckpt.layout`), on the caller's event loop; no torch, no collectives. A listing is a
list of :class:`CheckpointInfo` (:func:`list_run`, :func:`checkpoint_details`); the step a
resume loads is :func:`latest_loadable_step`'s. What goes is
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
    LIST_DELIMITER,
    MANIFEST_KEY,
    StepState,
    add_uploads,
    classify_listing,
    join_url,
    parse_step_dir,
    step_dir,
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
from cloudckpt.runs.retention import RetentionPolicy, select_to_delete
from cloudckpt.stored import decode_manifest_without_pickle, fetch_manifest_bytes

__all__ = [
    "HEAD_CONCURRENCY",
    "CheckpointInfo",
    "checkpoint_details",
    "checkpoint_info",
    "latest_loadable_step",
    "list_run",
    "newest_readable_step",
    "prune_run",
    "scan_run",
    "step_has_objects",
    "step_holders",
]

#: HEAD / GET requests of manifests a listing keeps in flight at once.
HEAD_CONCURRENCY = 32

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CheckpointInfo:
    """One checkpoint of a run.

    ``created_at`` is when the manifest was committed (the store's last-modified time) and is
    ``None`` for an incomplete checkpoint. ``total_bytes``, ``objects`` and ``world_size`` come
    from the manifest: ``None`` unless details were asked for (and always for incomplete ones).
    So do ``own_bytes`` (chunk bytes stored in the checkpoint's own folder), ``shared_bytes``
    (chunk bytes it references in older checkpoints' folders: an incremental checkpoint) and
    ``base_step`` (the step of the checkpoint it was saved against, ``None`` for a full one).
    ``damaged``: with details, the reason a complete checkpoint's manifest could not be decoded
    (its checksum or structure is wrong: it cannot be loaded); ``None`` otherwise.
    ``retained`` (listed with details only): a deleted checkpoint whose folder stays for the
    pins in it. ``held_by`` (details only): one line for each pin in the folder, saying which
    checkpoint or running save holds which objects, until when, or that prune removes it
    (:func:`cloudckpt.runs.refs.describe_holders`). ``tiers``: with a local tier
    (``CheckpointManager(local=...)``), where the step is complete: ``"local"`` (this node's
    tier alone), ``"peers"`` (the nodes' tiers together), ``"store"`` (the object store).
    """

    step: int
    url: str
    complete: bool
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


def checkpoint_info(run_url: str, step: int, state: StepState) -> CheckpointInfo:
    """Step ``step`` of the run at ``run_url`` as its listing ``state`` shows it (no details)."""
    m = state.manifest
    return CheckpointInfo(
        step=step,
        url=join_url(run_url, step_dir(step)),
        complete=m is not None,
        created_at=None if m is None else _utc(m.last_modified),
        manifest_bytes=m.size if m is not None else None,
    )


async def scan_run(store) -> dict[int, StepState]:
    """Every step of the run by one ``delimiter="/data/"`` walk of its root, plus one HEAD of the
    manifest of each step that looks incomplete (so a complete step is never reported
    incomplete, including after SeaweedFS 4.48's paging skips keys after a ``data/`` prefix)."""
    items = [item async for item in store.list("", delimiter=LIST_DELIMITER)]
    steps = classify_listing(items)
    suspects = [s for s, st in steps.items() if st.manifest is None]
    if suspects:
        sem = asyncio.Semaphore(HEAD_CONCURRENCY)

        async def _head(step: int):
            async with sem:
                try:
                    return step, await store.head(step_dir(step) + MANIFEST_KEY)
                except ObjectNotFound:
                    return step, None

        for step, info in await asyncio.gather(*(_head(s) for s in suspects)):
            steps[step].manifest = info
    return steps


async def list_run(
    store, run_url: str, *, details: bool = False, progress: Callable[[int], None] | None = None
) -> list[CheckpointInfo]:
    """Every checkpoint of the run, oldest step first (``CheckpointManager.list``): retained
    folders and each folder's holders with ``details`` only, with the manifests' details."""
    steps = await scan_run(store)
    infos = [
        checkpoint_info(run_url, s, steps[s])
        for s in sorted(steps)
        if details or not steps[s].retained
    ]
    if not details:
        return infos
    infos = await read_details(store, infos, progress)
    held = await step_holders(store, [s for s in steps if steps[s].pins])
    return [
        replace(i, retained=steps[i.step].retained, held_by=held.get(i.step, ())) for i in infos
    ]


async def checkpoint_details(store, run_url: str, step: int) -> CheckpointInfo:
    """Step ``step``'s checkpoint with details; ``CheckpointNotFound`` if it is not complete."""
    try:
        head = await store.head(step_dir(step) + MANIFEST_KEY)
    except ObjectNotFound as exc:
        raise CheckpointNotFound(
            f"no complete checkpoint at {join_url(run_url, step_dir(step))}"
        ) from exc
    info = checkpoint_info(run_url, step, StepState(manifest=head))
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
                raw = await fetch_manifest_bytes(store, step_dir(info.step) + MANIFEST_KEY)
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
        return replace(
            info,
            total_bytes=int(manifest.total_bytes()),
            objects=len(manifest.objects),
            world_size=int(manifest.world_size),
            own_bytes=int(own_bytes),
            shared_bytes=int(manifest.total_bytes()) - int(own_bytes),
            base_step=parse_step_dir(manifest.base + "/") if manifest.base else None,
        )

    return list(await asyncio.gather(*(_one(i) for i in infos)))


async def latest_loadable_step(store, run_url: str, complete: list[int]) -> int | None:
    """The newest of the ``complete`` steps (oldest first), its manifest checked to decode (one
    GET); ``None`` when none is left. ``ManifestError`` when that manifest is damaged, naming
    the step and the newest older one that decodes: a resume never falls back to an older step
    on its own (that would silently lose training), and never fails without saying which step
    would load."""
    while complete:
        newest = complete[-1]
        try:
            decode_manifest_without_pickle(
                await fetch_manifest_bytes(store, step_dir(newest) + MANIFEST_KEY)
            )
        except ObjectNotFound:  # deleted since the listing: the next newest is the latest
            complete = complete[:-1]
            continue
        except ManifestError as exc:
            older = await newest_readable_step(store, complete[:-1])
            if older is None:
                hint = "no older checkpoint of the run decodes either"
            else:
                hint = (
                    f"the newest one that decodes is step {older}: "
                    f"load(state_dict, step={older}) resumes from it"
                )
            raise ManifestError(
                f"step {newest} ({join_url(run_url, step_dir(newest))}), the newest complete "
                f"checkpoint, cannot be loaded: {exc}. Not falling back on an older step by "
                f"itself: {hint} (`cloudckpt ls --details {run_url}` marks the damaged ones)"
            ) from exc
        return newest
    return None


async def newest_readable_step(store, steps_complete) -> int | None:
    """The newest of ``steps_complete`` whose manifest is still there and decodes (checksum and
    structure; pickled values are not unpickled), or ``None``. A damaged manifest is logged
    (WARNING) and skipped. One manifest GET per step tried, newest first."""
    for step in sorted(set(steps_complete), reverse=True):
        try:
            decode_manifest_without_pickle(
                await fetch_manifest_bytes(store, step_dir(step) + MANIFEST_KEY)
            )
        except ObjectNotFound:
            continue
        except ManifestError as exc:
            log.warning(
                "step %d: its manifest is damaged, so it is not counted as the newest "
                "loadable checkpoint: %s",
                step,
                exc,
            )
            continue
        return step
    return None


async def step_has_objects(store, step: int) -> bool:
    """Whether anything is stored under step ``step``: a finished object or an unfinished
    upload (of a killed attempt, say)."""
    async for _ in store.list(step_dir(step)):
        return True
    return bool(await store.list_uploads(step_dir(step)))


async def step_holders(store, steps, *, now: float | None = None) -> dict[int, tuple[str, ...]]:
    """What holds each of ``steps`` (steps whose folders hold pins): step -> the lines of
    :func:`cloudckpt.runs.refs.describe_holders`, the referrers' manifests read once."""
    manifests: dict = {}
    steps = sorted(steps)
    lines = await asyncio.gather(
        *(describe_holders(store, step_dir(s)[:-1], now=now, manifests=manifests) for s in steps)
    )
    return dict(zip(steps, lines))


async def prune_run(
    store,
    retention: RetentionPolicy,
    abandoned_after: float,
    *,
    dry_run: bool = False,
    progress: Callable[[int], None] | None = None,
    now: float | None = None,
) -> list[tuple[int, StepState, DeletionPlan]]:
    """Remove (unless ``dry_run``) the complete steps ``retention`` does not keep and the
    incomplete ones whose owned objects and uploads are all older than ``abandoned_after``
    seconds (by this machine's clock, or ``now``); return each with its listing state and the
    plan that was (or would be) carried out, oldest step first. Each step is planned just
    before it is removed, so a save that resumes at an abandoned step keeps its fresh objects.
    Objects other checkpoints reference stay; once the steps are removed, the folders they
    referenced that have no manifest are collected too (listed after the others), and the pins
    of saves that never committed are removed once their lease is over (``sweep_pins``).

    Whatever the policy says, the newest complete step is kept, and so is the newest one whose
    manifest decodes (:func:`newest_readable_step`, read only when something would go): a
    damaged newest manifest never costs the last loadable checkpoint."""
    now = time.time() if now is None else now
    steps = add_uploads(await scan_run(store), await store.list_uploads(""))
    complete = [s for s, st in steps.items() if st.manifest is not None]
    doomed_complete = select_to_delete(complete, retention)
    if doomed_complete:
        doomed_complete.discard(await newest_readable_step(store, complete))
    cutoff = now - abandoned_after
    removed: list[tuple[int, StepState, DeletionPlan]] = []
    homes: set[str] = set()
    for step in sorted(steps):
        state = steps[step]
        if state.manifest is not None:
            if step not in doomed_complete:
                continue
            if dry_run:
                plan = await plan_checkpoint(store, step_dir(step), now=now)
            else:  # the manifest goes before what it keeps is judged
                plan, used = await uncommit_and_plan(store, step_dir(step), now=now)
                homes |= used
        else:
            abandoned = await plan_abandoned(store, step_dir(step), state.uploads, cutoff, now=now)
            if abandoned is None or abandoned.empty:
                continue  # still being written (or vanished, or nothing of ours): kept
            plan = abandoned
        removed.append((step, state, plan))
        if not dry_run:
            await carry_out(store, plan, progress=progress)
    for home, plan in await collect_homes(store, homes, cutoff=cutoff, now=now):
        home_step = parse_step_dir(home + "/")
        if home_step is not None:
            removed.append((home_step, steps.get(home_step, StepState()), plan))
    if not dry_run:
        await sweep_pins(store, now=now)
    return removed
