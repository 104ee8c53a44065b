"""The library calls the Lightning integration makes, in one place.

``exists``, ``delete`` and ``list_checkpoints`` by URL, saves replacing a reused name
(``SaveOptions(if_exists="replace")``), this process alone (``process_group="self"``) or every
rank, and whole loads placed by ``map_location``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from cloudckpt.api.async_save import SaveHandle, async_save
from cloudckpt.api.load import load_full
from cloudckpt.api.save import save
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.runs import checkpoints
from cloudckpt.statedict.rng import RNGState


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


RNG_KEY = "cloudckpt_rng_states"
"""Where a Lightning checkpoint saved through cloudckpt keeps ``cloudckpt.RNGState`` (Lightning
saves no generator states of its own): the saving ranks' torch, CUDA, numpy and Python states."""


def with_rng_states(checkpoint: Mapping[str, Any]) -> dict[str, Any]:
    """``checkpoint`` (not changed) and this rank's generator states under :data:`RNG_KEY`."""
    return {**checkpoint, RNG_KEY: RNGState()}


def restore_rng_states(checkpoint: dict[str, Any]) -> None:
    """Pop :data:`RNG_KEY` and set this rank's generators from it (kept if it has none)."""
    states = checkpoint.pop(RNG_KEY, None)
    if isinstance(states, dict):
        RNGState().load_state_dict(states)


def load_whole(
    url: str, *, storage: Any, allow_pickle: bool, map_location: MapLocation = None
) -> dict:
    """``cloudckpt.load_full`` (this process alone), tensors placed by ``map_location``."""
    return load_full(url, storage=storage, allow_pickle=allow_pickle, map_location=map_location)
