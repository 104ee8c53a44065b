"""The checkpoints a trainer names itself under one run folder (``checkpoint-500``,
``checkpoint_3``): which are complete, the newest, and pruning to the trainer's limit.

Complete means committed (its manifest is there): a half-written checkpoint is never listed, so
never resumed from, and never counted against a limit. Pruning never deletes the newest complete
checkpoint, and deletes through cloudckpt's safe deletion (manifest first, only the objects the
checkpoint owns; objects other checkpoints still reference stay). Not collective: call it on one
rank.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection
from dataclasses import dataclass

from cloudckpt.errors import ManifestError
from cloudckpt.runs.checkpoints import delete, list_checkpoints

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class NamedCheckpoint:
    """A complete checkpoint ``<prefix><step>`` of a run."""

    name: str
    step: int
    url: str


def complete_checkpoints(run_url: str, prefix: str, *, storage=None) -> list[NamedCheckpoint]:
    """Every committed ``<prefix><N>`` folder directly under ``run_url``, lowest N first (the
    step in the name: Accelerate's ``checkpoint_<iteration>`` saves another step in metadata)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    found = []
    for info in list_checkpoints(run_url, storage=storage):
        m = pattern.fullmatch(info.name)
        if info.complete and m is not None:
            found.append(NamedCheckpoint(name=info.name, step=int(m.group(1)), url=info.url))
    return sorted(found, key=lambda c: (c.step, c.name))


def newest_complete(run_url: str, prefix: str, *, storage=None) -> NamedCheckpoint | None:
    """The complete ``<prefix><N>`` checkpoint of the highest N, None if there is none."""
    found = complete_checkpoints(run_url, prefix, storage=storage)
    return found[-1] if found else None


def prune_to(
    run_url: str, prefix: str, *, keep: int, protect: Collection[str] = (), storage=None
) -> list[str]:
    """Delete the oldest complete ``<prefix><N>`` checkpoints so that ``keep`` remain (at least
    one: the newest is never deleted), sparing the URLs in ``protect``; returns the deleted URLs.
    One whose manifest is damaged is left in place (``cloudckpt rm`` removes it) and logged."""
    found = complete_checkpoints(run_url, prefix, storage=storage)
    spared = {u.rstrip("/") for u in protect}
    deleted = []
    for c in found[: max(0, len(found) - max(1, keep))]:
        if c.url in spared:
            continue
        try:
            delete(c.url, storage=storage)
        except ManifestError as exc:
            log.warning("left %s in place: %s", c.url, exc)
            continue
        deleted.append(c.url)
    return deleted
