"""The library calls the Lightning integration makes, in one place.

Issue 24 adds ``cloudckpt.exists``, ``cloudckpt.delete``, ``cloudckpt.list_checkpoints``,
``SaveOptions(if_exists="replace")``, ``map_location`` on loads and ``cloudckpt.RNGState``.
Until each lands, the function here does the same with what exists (and says below where it
falls short); the callers do not change when they do.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from cloudckpt.api.async_save import SaveHandle, async_save
from cloudckpt.api.load import load_full
from cloudckpt.api.save import save
from cloudckpt.errors import CheckpointNotFound, ObjectNotFound
from cloudckpt.layout import MANIFEST_KEY, join_url, split_folder
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.runs.cleanup import delete_checkpoint
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage.base import CommonPrefix, ObjectInfo


@dataclass(frozen=True, kw_only=True)
class Listed:
    """One committed checkpoint folder directly under a folder."""

    name: str
    url: str
    committed_at: datetime | None


def exists(url: str, storage: Any = None) -> bool:
    """A committed checkpoint (its manifest) is at ``url``."""

    async def head() -> bool:
        try:
            await shared_store(url, storage).head(MANIFEST_KEY)
        except ObjectNotFound:
            return False
        return True

    return run_coroutine(head())


def delete(url: str, storage: Any = None) -> int:
    """Delete the checkpoint at ``url`` (objects removed); never an object a sibling references.
    ``CheckpointNotFound`` when there is none."""
    if not exists(url, storage):
        raise CheckpointNotFound(f"no committed checkpoint at {url} (nothing to remove)")
    above = split_folder(url)
    if above is None:
        return run_coroutine(delete_checkpoint(shared_store(url, storage), ""))
    return run_coroutine(delete_checkpoint(shared_store(above[0], storage), above[1] + "/"))


def list_committed(url: str, storage: Any = None) -> list[Listed]:
    """The committed checkpoints directly under ``url``, oldest commit first."""
    store = shared_store(url, storage)

    async def scan() -> list[Listed]:
        folders = [
            entry.prefix.rstrip("/")
            async for entry in store.list("", delimiter="/")
            if isinstance(entry, CommonPrefix)
        ]
        found = []
        for folder in folders:
            async for entry in store.list(f"{folder}/{MANIFEST_KEY}"):
                if isinstance(entry, ObjectInfo) and entry.key == f"{folder}/{MANIFEST_KEY}":
                    when = entry.last_modified
                    stamp = None if when is None else datetime.fromtimestamp(when, timezone.utc)
                    found.append(Listed(name=folder, url=join_url(url, folder), committed_at=stamp))
        return found

    epoch = datetime.fromtimestamp(0, timezone.utc)
    return sorted(run_coroutine(scan()), key=lambda c: (c.committed_at or epoch, c.name))


def _replacing(url: str, storage: Any, options: SaveOptions, whole_world: bool) -> SaveOptions:
    if "if_exists" in {f.name for f in dataclasses.fields(SaveOptions)}:
        return dataclasses.replace(options, if_exists="replace")
    # until if_exists lands: not atomic (a crash between the two leaves no checkpoint there)
    together = whole_world and dist.is_available() and dist.is_initialized()
    if (not together or dist.get_rank() == 0) and exists(url, storage):
        delete(url, storage)
    if together:
        dist.barrier()
    return options


def save_replacing(
    state: Mapping[str, Any],
    url: str,
    *,
    whole_world: bool,
    storage: Any,
    allow_pickle: bool,
    metadata: Mapping[str, Any],
    options: SaveOptions,
) -> SaveResult:
    """``cloudckpt.save``, replacing a checkpoint already at ``url`` (Lightning reuses names).
    ``whole_world``: every rank saves its part (collective); otherwise this process alone."""
    return save(
        state,
        url,
        process_group=None if whole_world else "self",
        storage=storage,
        allow_pickle=allow_pickle,
        metadata=metadata,
        options=_replacing(url, storage, options, whole_world),
    )


def async_save_replacing(
    state: Mapping[str, Any],
    url: str,
    *,
    whole_world: bool,
    storage: Any,
    allow_pickle: bool,
    metadata: Mapping[str, Any],
    options: SaveOptions,
) -> SaveHandle:
    """:func:`save_replacing` as ``cloudckpt.async_save``: returns once the data is staged."""
    return async_save(
        state,
        url,
        process_group=None if whole_world else "self",
        storage=storage,
        allow_pickle=allow_pickle,
        metadata=metadata,
        options=_replacing(url, storage, options, whole_world),
    )


MapLocation = Any  # a device, a string, a dict or a callable, as torch.load takes it


def load_whole(
    url: str, *, storage: Any, allow_pickle: bool, map_location: MapLocation = None
) -> dict:
    """``cloudckpt.load_full`` (this process alone), tensors placed by ``map_location``."""
    state = load_full(url, storage=storage, allow_pickle=allow_pickle)
    if map_location is None:
        return state
    return _map_tensors(state, _placer(map_location))


def _placer(map_location: MapLocation) -> Callable[[torch.Tensor], torch.Tensor]:
    if callable(map_location) and not isinstance(map_location, (str, torch.device)):

        def by_callable(t: torch.Tensor) -> torch.Tensor:
            moved = map_location(t, "cpu")
            return t if moved is None else moved

        return by_callable
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        if target is None:
            return lambda t: t
        return lambda t: t.to(torch.device(target))
    device = torch.device(map_location)
    return lambda t: t.to(device)


def _map_tensors(node: Any, place: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(node, torch.Tensor):
        return place(node)
    if isinstance(node, dict):
        out = type(node)()
        for key, value in node.items():
            out[key] = _map_tensors(value, place)
        return out
    if isinstance(node, list):
        return [_map_tensors(v, place) for v in node]
    if isinstance(node, tuple):
        return tuple(_map_tensors(v, place) for v in node)
    return node
