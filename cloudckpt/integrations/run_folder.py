"""The checkpoints a trainer names itself under one run folder (``checkpoint-500``,
``checkpoint_3``): which are complete, the newest, and pruning to the trainer's limit.

Complete means committed (its manifest is there): a half-written checkpoint is never listed, so
never resumed from, and never counted against a limit. Pruning never deletes the newest complete
checkpoint, and deletes through cloudckpt's safe deletion (manifest first, only the objects the
checkpoint owns; objects other checkpoints still reference stay). Not collective: call it on one
rank.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Collection
from dataclasses import dataclass

from cloudckpt.errors import ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY, join_url
from cloudckpt.runs.cleanup import delete_checkpoint
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage.base import CommonPrefix


@dataclass(frozen=True, kw_only=True)
class NamedCheckpoint:
    """A complete checkpoint ``<prefix><step>`` of a run."""

    name: str
    step: int
    url: str


def complete_checkpoints(run_url: str, prefix: str, *, storage=None) -> list[NamedCheckpoint]:
    """Every committed ``<prefix><N>`` folder directly under ``run_url``, lowest step first."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)/")
    store = shared_store(run_url, storage)

    async def scan() -> list[NamedCheckpoint]:
        found: list[tuple[int, str]] = []
        async for item in store.list("", delimiter="/"):
            m = pattern.fullmatch(item.prefix) if isinstance(item, CommonPrefix) else None
            if m is not None:
                found.append((int(m.group(1)), item.prefix[:-1]))

        async def committed(name: str) -> bool:
            try:
                await store.head(f"{name}/{MANIFEST_KEY}")
            except ObjectNotFound:
                return False
            return True

        done = await asyncio.gather(*(committed(name) for _, name in found))
        return [
            NamedCheckpoint(name=name, step=step, url=join_url(run_url, name))
            for (step, name), ok in sorted(zip(found, done))
            if ok
        ]

    return run_coroutine(scan())


def newest_complete(run_url: str, prefix: str, *, storage=None) -> NamedCheckpoint | None:
    """The complete ``<prefix><N>`` checkpoint of the highest step, None if there is none."""
    found = complete_checkpoints(run_url, prefix, storage=storage)
    return found[-1] if found else None


def prune_to(
    run_url: str, prefix: str, *, keep: int, protect: Collection[str] = (), storage=None
) -> list[str]:
    """Delete the oldest complete ``<prefix><N>`` checkpoints so that ``keep`` remain (at least
    one: the newest is never deleted), sparing the URLs in ``protect``; returns the deleted URLs."""
    found = complete_checkpoints(run_url, prefix, storage=storage)
    keep = max(1, keep)
    spared = {u.rstrip("/") for u in protect}
    victims = [c for c in found[: max(0, len(found) - keep)] if c.url not in spared]
    store = shared_store(run_url, storage)
    for c in victims:
        run_coroutine(delete_checkpoint(store, c.name + "/"))
    return [c.url for c in victims]
