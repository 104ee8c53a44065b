"""``cloudckpt prune`` and ``cloudckpt rm``: the deletion commands (see :mod:`cloudckpt.cli.main`
for what they delete and refuse).

Counts read as ``ls`` reads them: "objects" are data objects; a checkpoint's manifest is named
("the manifest and 3 objects"), not counted, and unfinished uploads are counted apart.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from cloudckpt.cli import documents
from cloudckpt.cli.format import is_step_folder, label
from cloudckpt.cli.options import EXIT_FAILED, EXIT_OK, UsageError
from cloudckpt.cli.store import CommandStorage, has_manifest, progress
from cloudckpt.cli.urls import refuse_not_a_run, step_of_url
from cloudckpt.layout import join_url, step_dir
from cloudckpt.wording import plural


def _left_note(url: str, plan, verb: str) -> None:
    """One stderr line about the keys a deletion leaves because the layout does not own them."""
    if plan.left:
        more = ", ..." if plan.left > len(plan.left_examples) else ""
        print(
            f"{verb} {plural(plan.left, 'key')} under {url} that "
            f"{'is' if plan.left == 1 else 'are'} not part of a checkpoint: "
            f"{', '.join(plan.left_examples)}{more}",
            file=sys.stderr,
        )


def _counts(plan, removed: int | None = None) -> str:
    """A deletion's counts in the words ``ls`` uses: ``objects`` are data objects (the manifest
    is named, not counted), then unfinished uploads and the objects kept for other checkpoints.
    ``removed``: the objects actually deleted (the manifest included), else the plan's."""
    data = (len(plan.objects) if removed is None else removed) - int(plan.has_manifest)
    kept = f"; {plural(plan.kept, 'object')} kept, other checkpoints use them" if plan.kept else ""
    return (
        f"{'the manifest and ' if plan.has_manifest else ''}{plural(max(data, 0), 'object')}, "
        f"{plural(len(plan.uploads), 'upload')}{kept}"
    )


def _print_keys(base: str, plan) -> None:
    """Every object and upload of ``plan`` (keys relative to ``base``), one per line."""
    for key in plan.objects:
        print(f"  {join_url(base, key)}")
    for upload in plan.uploads:
        print(f"  upload {join_url(base, upload.key)} {upload.upload_id}")


def cmd_prune(args: Any, storage: CommandStorage) -> int:
    mgr = storage.manager(
        args.url,
        keep_last=args.keep_last,
        keep_every=args.keep_every,
        abandoned_after=args.abandoned_after,
    )
    if not mgr.list():
        refuse_not_a_run(storage, args.url, "prune")
    with progress(None, "deleting") as bar:
        removed = mgr.prune_plans(dry_run=args.dry_run, progress=bar.update)
    if args.json:
        documents.emit(documents.prune_document(mgr.url, removed, args.dry_run))
        for info, plan in removed:
            _left_note(info.url, plan, "would leave" if args.dry_run else "left")
        return EXIT_OK
    verb = "would remove" if args.dry_run else "removed"
    if not removed:
        print("nothing to remove")
    for info, plan in removed:
        state = "complete" if info.complete else "abandoned"
        print(f"{verb} {label(info)} ({state})  {info.url}  ({_counts(plan)})")
        if args.dry_run:
            _print_keys(mgr.url, plan)
        _left_note(info.url, plan, "would leave" if args.dry_run else "left")
    return EXIT_OK


def cmd_rm(args: Any, storage: CommandStorage) -> int:
    """Delete one checkpoint, complete or incomplete: only the keys the layout owns. A step of a
    run (``--step N``, or a URL ending in ``step-<012d>``) goes through
    ``CheckpointManager(run).delete`` and its guards; a run or a folder that is neither is
    refused (exit 2), and a URL with nothing there is "nothing to remove" (exit 1). A URL with no
    manifest that holds step checkpoints is a run, unless it is a step that owns keys itself."""
    from cloudckpt.runs.cleanup import delete_checkpoint, plan_checkpoint
    from cloudckpt.runtime.loop import run_coroutine

    located = (args.url, args.step) if args.step is not None else step_of_url(args.url)
    if located is not None:
        if args.step is not None and has_manifest(storage.open(args.url)):
            raise UsageError(
                f"{args.url} is a checkpoint already; give its run's URL with "
                f"--step {args.step}, or drop --step"
            )
        mgr, step = storage.manager(located[0]), located[1]
        url, base = join_url(mgr.url, step_dir(step)), mgr.url
        plan = mgr.plan_delete(step)  # refuses a step folder that leads out of the run

        def delete(progress) -> int:
            return mgr.delete(step, progress=progress)
    else:  # from the folder above it, when there is one: siblings may reference its objects
        from cloudckpt.layout import split_folder
        from cloudckpt.storage.urls import parse_store_url

        url, plan, above = args.url, None, split_folder(args.url)
        if above is not None and os.path.islink(parse_store_url(url).path or "/"):
            above = None  # a folder the user named through a symlink: itself, no siblings
        base, prefix = (url, "") if above is None else (above[0], above[1] + "/")
        store = storage.open(base)

        def delete(progress) -> int:
            return run_coroutine(delete_checkpoint(store, prefix, progress=progress))

    if plan is None:
        plan = run_coroutine(plan_checkpoint(store, prefix))
    # a run is refused; a folder that owns something is a checkpoint whatever it holds
    if plan.empty:
        others = storage.manager(url).list()
        if others:  # never "its newest": rm removes only what the user named
            newest = ([i for i in others if i.complete] or others)[-1]
            how = (
                f"give --step N (its newest complete: cloudckpt rm {url} --step {newest.step})"
                if is_step_folder(newest)
                else f"give its URL (its newest complete: cloudckpt rm {newest.url})"
            )
            raise UsageError(
                f"{url} is a run with {plural(len(others), 'checkpoint')}, not a "
                f"checkpoint; rm removes one checkpoint: {how}"
            )
    if plan.empty and plan.left:
        raise UsageError(
            f"{url} is neither a checkpoint nor a run ({plural(plan.left, 'key')} "
            "there, none part of a checkpoint); nothing removed"
        )
    if plan.empty:
        used = (
            f": its {plural(plan.kept, 'object')} are used by other checkpoints"
            if plan.kept
            else ""
        )
        print(f"nothing to remove at {url}{used}", file=sys.stderr)
        return EXIT_FAILED
    state = "" if plan.has_manifest else "incomplete checkpoint, "
    if args.dry_run:
        print(f"would remove {url} ({state}{_counts(plan)})")
        _print_keys(base, plan)
        _left_note(url, plan, "would leave")
        return EXIT_OK
    with progress(len(plan.objects), "deleting") as bar:
        removed = delete(bar.update)
    print(f"removed {url} ({state}{_counts(plan, removed)})")
    _left_note(url, plan, "left")
    return EXIT_OK
