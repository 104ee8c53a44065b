"""Listing a run and pruning it: which steps a store holds, which of them the retention policy
and the grace period for abandoned saves let go, and their removal.

Works on one ``ObjectStore`` opened at the run root (keys relative to it; the step prefixes of
:mod:`cloudckpt.layout`), on the caller's event loop; no torch, no collectives. What goes is
always planned by :mod:`cloudckpt.runs.cleanup` and removed by its ``carry_out`` (owned keys only,
manifest first; objects that other checkpoints reference, or incremental saves running
elsewhere pinned, stay). Costs and guarantees are those stated in :mod:`cloudckpt.runs.manager`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from cloudckpt.errors import ManifestError, ObjectNotFound
from cloudckpt.layout import (
    LIST_DELIMITER,
    MANIFEST_KEY,
    StepState,
    add_uploads,
    classify_listing,
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
    "newest_readable_step",
    "prune_run",
    "scan_run",
    "step_has_objects",
    "step_holders",
]

#: HEAD / GET requests of manifests a listing keeps in flight at once.
HEAD_CONCURRENCY = 32

log = logging.getLogger(__name__)


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
            plan = await plan_abandoned(store, step_dir(step), state.uploads, cutoff, now=now)
            if plan is None or plan.empty:
                continue  # still being written (or vanished, or nothing of ours): kept
        removed.append((step, state, plan))
        if not dry_run:
            await carry_out(store, plan, progress=progress)
    for home, plan in await collect_homes(store, homes, cutoff=cutoff, now=now):
        step = parse_step_dir(home + "/")
        if step is not None:
            removed.append((step, steps.get(step, StepState()), plan))
    if not dry_run:
        await sweep_pins(store, now=now)
    return removed
