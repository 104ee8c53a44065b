"""What the ``cloudckpt`` command checks about a URL before it calls it a run or an empty one.

Contract:
- :func:`check_local_url`: a plain relative path that does not exist and whose first segment
  could be a bucket name (``bucket/x``) is a :class:`UsageError` (exit 2) that suggests
  ``s3://bucket/x``; the command never looks at an empty local listing for it. Every command
  runs it on its URL.
- :func:`check_local_destination`: the same for a place to write (``convert``'s DST, ``export
  --format``'s OUT) when it has two segments or more and its first does not exist here:
  ``bucket/x`` would otherwise become a new local folder ``bucket`` silently. ``./bucket/x`` is
  the way to say "a new local folder".
- :func:`missing_local_folder`: ``ls`` and ``prune`` given a local path that does not exist get a
  :class:`CheckpointNotFound` (exit 1), not "no checkpoints" and exit 0. An S3 prefix with nothing
  under it stays an empty run (S3 has no folders to be missing; a new run looks like that).
- :func:`refuse_not_a_run`: what ``ls`` and ``prune`` do when a URL holds no step checkpoint:
  :func:`missing_local_folder`, then a checkpoint at the URL is a :class:`UsageError` that names
  ``cloudckpt show URL`` (and its run, when it is a step of one), and so is :func:`not_a_run`'s
  reason; otherwise the URL is an empty run.
- :func:`not_a_run`: for a URL with no step folders and no manifest (``ls``, ``prune``, and
  ``show``/``verify``/``export`` finding no checkpoint to use), the one-line reason it is not a
  run when the folders right under it are checkpoints (what ``examples/smoke.py`` leaves under
  ``smoke/``) or runs; ``None`` when neither is found. Bounded: the first :data:`MAX_LISTED`
  entries of one delimited listing, then at most :data:`MAX_PROBED` folders, each one HEAD and,
  when that is not a checkpoint, one delimited listing stopped at its first step folder or after
  :data:`MAX_LISTED` entries.
- :func:`resolve_checkpoint`: the checkpoint ``show``, ``verify`` and ``export`` read: ``URL``
  itself when it is one, step N of the run at ``URL`` with ``--step N`` (a checkpoint given with
  ``--step`` is a :class:`UsageError`), else the run's newest complete checkpoint (named on
  stderr); a URL with none is :func:`not_a_run`'s :class:`UsageError` or ``CheckpointNotFound``.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys

from cloudckpt.cli.options import UsageError
from cloudckpt.cli.store import CommandStorage, has_manifest
from cloudckpt.errors import CheckpointNotFound, ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY, folder_label, join_url, parse_step_dir, step_dir

MAX_LISTED = 1000
MAX_PROBED = 20
_EXAMPLES = 3
# A first path segment that could be an S3 bucket (3-63 of a-z 0-9 . -).
_BUCKET_LIKE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


def _plain_path(url: str) -> str | None:
    """The local path of a URL given without a scheme, else None."""
    return None if url.startswith(("s3://", "file:")) else url


def check_local_url(url: str) -> None:
    """Refuse a missing relative path that reads as ``bucket/key`` (see the module docstring)."""
    path = _plain_path(url)
    if path is None or os.path.isabs(path) or path.startswith(("~", ".")) or os.path.lexists(path):
        return
    first = path.split("/", 1)[0]
    if _BUCKET_LIKE.match(first):
        raise UsageError(
            f"{url} is not a local path (nothing there, relative to "
            f"{os.getcwd()}); an S3 URL needs its scheme: s3://{path}"
        )


def check_local_destination(url: str, what: str) -> None:
    """Refuse a destination ``bucket/x`` (see the module docstring); ``what``: its name."""
    path = _plain_path(url)
    if path is None or os.path.isabs(path) or path.startswith(("~", ".")) or "/" not in path:
        return
    first = path.split("/", 1)[0]
    if _BUCKET_LIKE.match(first) and not os.path.lexists(first):
        raise UsageError(
            f"{what} {url} is neither an S3 URL nor under a local folder that "
            f"exists ({first} is not in {os.getcwd()}): write s3://{path} for S3, "
            f"or ./{path} for a new local folder"
        )


def missing_local_folder(url: str) -> None:
    """``CheckpointNotFound`` when ``url`` is a local path with nothing there."""
    path = _plain_path(url)
    if path is None:
        from cloudckpt.storage.urls import parse_store_url

        parsed = parse_store_url(url)
        path = parsed.path if parsed.kind == "local" else None
    if path is not None and not os.path.lexists(path):
        raise CheckpointNotFound(
            f"no such local folder: {url} (check the path; an S3 URL starts with s3://)"
        )


async def _children(store) -> list[str]:
    """The folder names right under the store's root, from the first MAX_LISTED entries."""
    from cloudckpt.storage.base import CommonPrefix

    names, seen = [], 0
    async for entry in store.list("", delimiter="/"):
        seen += 1
        if isinstance(entry, CommonPrefix):
            names.append(entry.prefix)
        if seen >= MAX_LISTED:
            break
    return names


async def _kind(store, folder: str) -> str | None:
    """``"checkpoint"`` (a manifest), ``"run"`` (a step folder right under it) or None."""
    try:
        await store.head(folder + MANIFEST_KEY)
        return "checkpoint"
    except ObjectNotFound:
        pass
    seen = 0
    async for entry in store.list(folder, delimiter="/"):
        key = getattr(entry, "prefix", None)
        if key is not None and parse_step_dir(key[len(folder) :]) is not None:
            return "run"
        seen += 1
        if seen >= MAX_LISTED:
            break
    return None


async def not_a_run(store, url: str, command: str) -> str | None:
    """Why ``url`` is not a run when checkpoints or runs sit right under it (module docstring)."""
    folders = (await _children(store))[:MAX_PROBED]
    kinds = await asyncio.gather(*(_kind(store, f) for f in folders))
    reads = command if command in ("show", "verify") else "show"
    for kind, what, then in (
        ("checkpoint", "checkpoints", f"see one with: cloudckpt {reads}"),
        ("run", "runs", f"use one with: cloudckpt {command}"),
    ):
        found = [join_url(url, f) for f, k in zip(folders, kinds) if k == kind]
        if found:
            more = ", ..." if len(found) > _EXAMPLES else ""
            return (
                f"{url} is not a run (no step-<N> folders) but a folder of {what}: "
                f"{', '.join(found[:_EXAMPLES])}{more}; {then} {found[0]}"
            )
    return None


def step_of_url(url: str) -> tuple[str, int] | None:
    """(run URL, step) when ``url``'s last segment is a step folder ``step-<012d>`` of a run."""
    parent, _, last = url.rstrip("/").rpartition("/")
    step = parse_step_dir(last + "/")
    if step is None or not parent.strip("/") or parent.endswith((":", "/")):
        return None  # no run above it (a bucket, a filesystem root, a relative name)
    return parent, step


def refuse_not_a_run(storage: CommandStorage, url: str, command: str) -> None:
    """``ls``/``prune`` found no step checkpoint at ``url`` (see the module docstring)."""
    from cloudckpt.runtime.loop import run_coroutine

    missing_local_folder(url)
    store = storage.open(url)
    if has_manifest(store):
        located = step_of_url(url)
        run = f", or its run: cloudckpt {command} {located[0]}" if located else ""
        raise UsageError(
            f"{url} is a checkpoint, not a run: {command} takes a run's URL; "
            f"to see this checkpoint use: cloudckpt show {url}{run}"
        )
    reason = run_coroutine(not_a_run(store, url, command))
    if reason is not None:
        raise UsageError(reason)


def resolve_checkpoint(storage: CommandStorage, url: str, step: int | None, command: str) -> str:
    """The checkpoint URL meant by ``url`` / ``--step`` (see the module docstring; ``command``:
    for the hint of a folder of checkpoints or runs)."""
    from cloudckpt.runtime.loop import run_coroutine

    store = storage.open(url)
    is_checkpoint = has_manifest(store)
    if step is not None:
        if is_checkpoint:
            raise UsageError(
                f"{url} is a checkpoint already; give its run's URL with --step "
                f"{step}, or drop --step"
            )
        return join_url(url, step_dir(step))
    if is_checkpoint:
        return url
    latest = storage.manager(url).latest()
    if latest is None:
        reason = run_coroutine(not_a_run(store, url, command))
        if reason is not None:  # a folder of checkpoints or of runs: say which to give
            raise UsageError(reason)
        raise CheckpointNotFound(f"no complete checkpoint at {url} (nor a run with one)")
    print(
        f"using the newest complete checkpoint: {folder_label(latest.name)} ({latest.url})",
        file=sys.stderr,
    )
    return latest.url
