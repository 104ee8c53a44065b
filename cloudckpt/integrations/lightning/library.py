"""The library calls the Lightning integration makes, in one place.

``exists``, ``delete`` and ``list_checkpoints`` by URL, saves replacing a reused name
(``SaveOptions(if_exists="replace")``), this process alone (``process_group="self"``) or every
rank, and whole loads placed by ``map_location``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import torch

from cloudckpt.api.async_save import SaveHandle, async_save
from cloudckpt.api.load import load_full
from cloudckpt.api.save import save
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.runs import checkpoints


@dataclass(frozen=True, kw_only=True)
class Listed:
    """One committed checkpoint folder directly under a folder."""

    name: str
    url: str
    committed_at: datetime | None


def exists(url: str, storage: Any = None) -> bool:
    """A committed checkpoint (its manifest) is at ``url`` (``cloudckpt.exists``)."""
    return checkpoints.exists(url, storage=storage)


def delete(url: str, storage: Any = None) -> int:
    """``cloudckpt.delete``: the checkpoint at ``url`` (objects removed); never an object another
    checkpoint references. ``CheckpointNotFound`` when there is none."""
    return checkpoints.delete(url, storage=storage)


def list_committed(url: str, storage: Any = None) -> list[Listed]:
    """The committed checkpoints directly under ``url``, oldest commit first
    (``cloudckpt.list_checkpoints`` without the half-written ones)."""
    return [
        Listed(name=info.name, url=info.url, committed_at=info.created_at)
        for info in checkpoints.list_checkpoints(url, storage=storage)
        if info.complete
    ]


def _replacing(options: SaveOptions) -> SaveOptions:
    """Lightning rewrites a name it reuses (``last.ckpt``): the new checkpoint replaces the old
    atomically (readable until the new manifest commits, its objects collected after)."""
    return dataclasses.replace(options, if_exists="replace")


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
        options=_replacing(options),
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
        options=_replacing(options),
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
