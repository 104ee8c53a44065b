"""A save between its phases: the plan each rank made (:class:`PreparedSave`, a value) and what
:func:`cloudckpt.api.save.finish_save` learns as it goes (:class:`SaveProgress`).

``async_save`` stages a :class:`PreparedSave`'s items (a copy of the plan with the staged
tensors) and hands it to the save thread; nothing in a plan changes once
:func:`~cloudckpt.api.save.prepare_save` made it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cloudckpt.options import SaveOptions
from cloudckpt.planning.save.share import SaveShare
from cloudckpt.storage.base import ObjectStore
from cloudckpt.transport import ControlChannel


@dataclass(frozen=True, kw_only=True)
class PreparedSave:
    """A save after planning (phases 1-2), a value: what this rank writes and where, ready for
    :func:`~cloudckpt.api.save.finish_save`. What the later phases learn is kept apart, in a
    :class:`SaveProgress`."""

    url: str
    store: ObjectStore  # the checkpoint's store, opened once for the whole save
    channel: ControlChannel
    options: SaveOptions
    attempt: str
    share: SaveShare  # this rank's part of the plan (the coordinator's: with the skeleton)
    items: list  # [(chunk_id, tensor)] this rank writes
    values: dict[str, bytes]  # encoded values this rank owns
    structure: Any
    metadata: dict
    allow_pickle: bool
    plan_cached: bool
    started: float
    incremental: bool = False  # every rank hashes its items (the coordinator's word)
    with_base: bool = False  # the coordinator was given a base (every rank knows)
    base: BaseSite | None = None  # the coordinator's base, if any
    base_read: Any = None  # the coordinator's read of the base (a future), if any


@dataclass(frozen=True, kw_only=True)
class BaseSite:
    """Where an incremental save's base is: the run root's store (opened once), the new
    checkpoint's folder and the base's folder in it."""

    run_store: ObjectStore
    folder: str
    base: str


@dataclass
class SaveProgress:
    """What :func:`finish_save` learns as it goes (the plan itself never changes)."""

    manifest_sent: bool = False  # the coordinator issued the manifest's PUT
    used_homes: frozenset = frozenset()  # the folders the committed manifest references
    base_used: str = ""  # the base's folder, on every rank ("": a full save)
