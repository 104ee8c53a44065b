"""The DCP checkpoints of a run folder: list them, tell complete from half-written, delete, prune.

A *run* is a folder (``s3://bucket/run``, ``file:///path`` or a path) with one DCP checkpoint per
sub-folder, named by its step as torchtitan names them (``step-100/.metadata``,
``step-100/__0_0.distcp``, ...). Contract:

- A checkpoint is *complete* exactly when its ``.metadata`` exists: every DCP writer writes it
  last (:class:`cloudckpt.dcp.StorageWriter` in create mode). A folder with other objects and no
  ``.metadata`` is *incomplete* (a save in progress, or killed): listed, never loaded.
- A folder's step is the last run of digits in its name (``step-100`` -> 100, ``epoch_2-step_7``
  -> 7); a name without one (or with more than 18 digits) has step ``None``: listed, never
  chosen as the latest, never pruned.
- :func:`prune_run` deletes the complete checkpoints a :class:`~cloudckpt.runs.retention.
  RetentionPolicy` does not keep (never the newest complete one) and, of incomplete folders,
  only the owned objects older than ``abandoned_after`` seconds (a save still writing keeps its
  fresh objects).
- Deleting (:func:`delete_folder`) removes ``.metadata`` first (the checkpoint stops being
  complete before any data goes), then only the keys DCP writers write directly in the folder
  (``.metadata.checksums``, ``__<r>_<n>.distcp``, ``__<r>.metadata[.checksums]``) and their
  unfinished uploads; anything else is left in place and logged.

Cost: one delimited listing of the run root, one HEAD of ``.metadata`` per folder (concurrent),
and a listing of each folder that is deleted or looks incomplete (a folder without objects is
not listed: some stores show an emptied folder). Names come from the store's
listing and are checked like any key (a name the store should not have produced is skipped).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

from cloudckpt.dcp.metadata import METADATA_KEY
from cloudckpt.errors import ConfigError, ObjectNotFound
from cloudckpt.runs.retention import RetentionPolicy, select_to_delete
from cloudckpt.storage.base import CommonPrefix, ObjectInfo, check_key
from cloudckpt.wording import plural

log = logging.getLogger(__name__)

_STEP_RE = re.compile(r"(\d+)(?!.*\d)")
_MAX_STEP_DIGITS = 18
_OWNED_RE = re.compile(
    r"^(\.metadata(\.checksums)?|__\d+_\d+\.distcp|__\d+\.metadata(\.checksums)?)$"
)
_HEADS_IN_FLIGHT = 16


@dataclass(frozen=True, kw_only=True)
class DCPCheckpoint:
    """One folder of a run: ``name`` (no slash), ``step`` (or None), ``complete`` (its
    ``.metadata`` exists) and ``committed`` (the store's time of that ``.metadata``)."""

    name: str
    step: int | None
    complete: bool
    committed: float | None = None


def step_of(name: str) -> int | None:
    """The step a folder name carries (module doc), or ``None``."""
    m = _STEP_RE.search(name)
    if m is None or len(m.group(1)) > _MAX_STEP_DIGITS:
        return None
    return int(m.group(1))


def _folder_name(prefix: str) -> str | None:
    name = prefix.rstrip("/")
    try:
        check_key(name)
    except ConfigError:
        return None
    return None if "/" in name else name


async def list_run(store) -> list[DCPCheckpoint]:
    """The folders of the run at ``store`` (complete or not), oldest step first (unnumbered
    folders last, by name)."""
    names: list[str] = []
    async for entry in store.list("", delimiter="/"):
        if isinstance(entry, CommonPrefix):
            name = _folder_name(entry.prefix)
            if name is None:
                log.warning("%s: skipping a folder the store listed as %r", store.url, entry.prefix)
                continue
            names.append(name)
    gate = asyncio.Semaphore(_HEADS_IN_FLIGHT)

    async def look(name: str) -> DCPCheckpoint | None:
        async with gate:
            try:
                info = await store.head(f"{name}/{METADATA_KEY}")
            except ObjectNotFound:
                if not await _has_objects_before(store, name, float("inf")):
                    return None  # an empty folder some stores list after a delete
                return DCPCheckpoint(name=name, step=step_of(name), complete=False)
        return DCPCheckpoint(
            name=name, step=step_of(name), complete=True, committed=info.last_modified
        )

    found = [c for c in await asyncio.gather(*(look(n) for n in names)) if c is not None]
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, c.name))


def latest_complete(checkpoints: list[DCPCheckpoint]) -> DCPCheckpoint | None:
    """The complete checkpoint of the highest step (the newest commit among equal steps)."""
    numbered = [c for c in checkpoints if c.complete and c.step is not None]
    if not numbered:
        return None
    return max(numbered, key=lambda c: (c.step, c.committed or 0.0))


async def delete_folder(store, name: str, *, older_than: float | None = None) -> int:
    """Delete the owned objects of folder ``name`` (module doc), ``.metadata`` first; with
    ``older_than`` (epoch seconds) only those last modified before it. Returns objects removed."""
    check_key(name)
    prefix = f"{name}/"
    owned: list[str] = []
    foreign: list[str] = []
    async for entry in store.list(prefix):
        if not isinstance(entry, ObjectInfo):
            continue
        rel = entry.key[len(prefix) :]
        if not _OWNED_RE.match(rel):
            foreign.append(rel)
        elif older_than is None or (entry.last_modified or 0.0) < older_than:
            owned.append(entry.key)
    if foreign:
        log.warning(
            "%s/%s: leaving %s no DCP writer writes (%s)",
            store.url,
            name,
            plural(len(foreign), "object"),
            ", ".join(sorted(foreign)[:5]),
        )
    meta = f"{prefix}{METADATA_KEY}"
    if meta in owned:  # uncommit first: never a complete-looking checkpoint with data missing
        await store.delete([meta])
    await store.delete([k for k in owned if k != meta])
    for upload in await store.list_uploads(prefix):
        rel = upload.key[len(prefix) :]
        started = upload.initiated or 0.0
        if _OWNED_RE.match(rel) and (older_than is None or started < older_than):
            await store.abort_upload(upload)
    return len(owned)


async def prune_run(
    store,
    policy: RetentionPolicy,
    *,
    abandoned_after: float = 3600.0,
    dry_run: bool = False,
) -> list[DCPCheckpoint]:
    """Apply ``policy`` to the complete checkpoints, clear abandoned objects of incomplete
    folders (module doc); return the checkpoints deleted (or that would be), oldest first."""
    checkpoints = await list_run(store)
    doomed_steps = select_to_delete(
        [c.step for c in checkpoints if c.complete and c.step is not None], policy
    )
    cutoff = time.time() - abandoned_after
    removed = []
    for c in checkpoints:
        if c.complete and c.step in doomed_steps:
            if not dry_run:
                await delete_folder(store, c.name)
            removed.append(c)
        elif not c.complete:
            if dry_run:
                if await _has_objects_before(store, c.name, cutoff):
                    removed.append(c)
            elif await delete_folder(store, c.name, older_than=cutoff):
                removed.append(c)
    return removed


async def _has_objects_before(store, name: str, cutoff: float) -> bool:
    """Whether folder ``name`` holds an object last modified before ``cutoff``."""
    async for entry in store.list(f"{name}/"):
        if isinstance(entry, ObjectInfo) and (entry.last_modified or 0.0) < cutoff:
            return True
    return False
