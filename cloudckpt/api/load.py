"""``cloudckpt.load`` / ``load_full`` / ``read_manifest``: the distributed load protocol.

Every rank of the process group calls :func:`load` with the state dict it wants filled (its own
sharding, any world size). Phases, each closed by a fail-together exchange:

1. manifest: the coordinator reads it and broadcasts the bytes (or every rank reads it, with
   ``share_manifest=False``); every rank decodes and validates it.
2. plan: flatten the state dict (after ``state_dict()`` on stateful values), plan the reads of
   every requested piece (strict: missing names fail), exchange the plans.
3. read-once assignment: computed identically on every rank; broadcast subgroups created or
   reused.
4. data: each rank fetches its own regions (crc-verified) in the background while the broadcast
   batches run in the one global order; every region lands in its destination (dtype converted).
5. values and ``load_state_dict()`` on stateful values.

Destinations are written only with verified bytes; a rank that fails leaves its tensors possibly
half filled, and every rank raises the same error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Mapping

import torch

from cloudckpt import layout
from cloudckpt.errors import CheckpointNotFound, ManifestError, ObjectNotFound
from cloudckpt.manifest import decode_manifest
from cloudckpt.options import LoadOptions, LoadResult
from cloudckpt.api.load_data import fetch_into, move_data
from cloudckpt.api.manifest_io import fetch_manifest_bytes
from cloudckpt.planning import (PieceSpec, decode_local_load_plan, encode_local_load_plan,
                                plan_local_load)
from cloudckpt.runtime import run_coroutine, shared_store, wait_for_pending_save
from cloudckpt.stateful import resolve_stateful, restore_stateful
from cloudckpt.statedict import flatten_state_dict, set_by_path, torch_dtype, unflatten_state_dict
from cloudckpt.transport import ControlChannel

log = logging.getLogger(__name__)


def read_manifest(url: str, *, storage=None, allow_pickle: bool = False):
    """Read and validate the manifest of the checkpoint at ``url`` (no collective)."""
    return decode_manifest(read_manifest_bytes(url, storage), allow_pickle=allow_pickle)


def read_manifest_bytes(url: str, storage) -> bytes:
    store = shared_store(url, storage)
    try:
        return run_coroutine(fetch_manifest_bytes(store, layout.MANIFEST_KEY))
    except ObjectNotFound as exc:
        raise CheckpointNotFound(f"no committed checkpoint at {url} (no manifest: {exc})") from exc


def load(state_dict: Mapping[str, Any], url: str, *, process_group=None, storage=None,
         allow_pickle: bool = False, strict: bool = True,
         options: LoadOptions | None = None) -> LoadResult:
    """Fill ``state_dict`` in place from the checkpoint at ``url``. Collective.

    Tensors (plain, DTensor, :class:`cloudckpt.GlobalPiece`) are filled in place, converting
    dtype when the stored one differs. Non-tensor values are replaced. With ``strict`` (the
    default) a name missing from the checkpoint raises :class:`MissingKeysError`; names stored but
    not requested are reported in ``LoadResult.unexpected_keys``.
    """
    wait_for_pending_save()
    options = options or LoadOptions()
    channel = ControlChannel(process_group, timeout=options.timeout)
    started = time.perf_counter()
    store = shared_store(url, storage)

    raw, error, manifest = b"", None, None
    if channel.is_coordinator or not options.share_manifest:
        try:
            raw = read_manifest_bytes(url, storage)
            if channel.is_coordinator:
                manifest = decode_manifest(raw, allow_pickle=allow_pickle)
                run_coroutine(check_object_extents(store, manifest))
        except BaseException as exc:
            error = exc
    channel.agree("load manifest", b"", error)
    if options.share_manifest:
        raw = channel.broadcast_bytes(raw if channel.is_coordinator else None)

    error, payload = None, b""
    try:
        if manifest is None:
            manifest = decode_manifest(raw, allow_pickle=allow_pickle)
        broadcastable = _broadcast_predicate(channel)
        resolved, found = resolve_stateful(state_dict)
        flat = flatten_state_dict(resolved, is_broadcastable=broadcastable)
        requests, dests = [], []
        for leaf in flat.tensors.values():
            for spec, tensor in leaf.pieces:
                requests.append(spec)
                dests.append(tensor)
        plan = plan_local_load(manifest, requests, rank=channel.rank,
                               value_names=tuple(flat.values), strict=strict)
        payload = encode_local_load_plan(plan)
    except BaseException as exc:
        error = exc
    raw_plans = channel.agree("load planning", payload, error)

    error = None
    fetched = received = broadcasts = 0
    try:
        plans = [decode_local_load_plan(b) for b in raw_plans]
        fetched, received, broadcasts = move_data(store, manifest, plans, channel, dests, options)
        for name, leaf in flat.values.items():
            if name in manifest.values:
                _assign_value(state_dict, resolved, found, leaf.path, manifest.values[name])
        restore_stateful(resolved, found)
    except BaseException as exc:
        error = exc
    channel.agree("load", b"", error)
    if plan.unexpected and channel.is_coordinator:
        shown = ", ".join(plan.unexpected[:8]) + (" ..." if len(plan.unexpected) > 8 else "")
        log.warning("cloudckpt.load: %d stored name(s) were not requested and stay unloaded: %s "
                    "(a fresh optimizer has no state to fill: gather it with "
                    "torch.distributed.checkpoint.state_dict.get_state_dict first)",
                    len(plan.unexpected), shown)
    return LoadResult(url=url, bytes_fetched=fetched, bytes_received=received,
                      seconds=time.perf_counter() - started,
                      unexpected_keys=tuple(plan.unexpected), broadcasts=broadcasts)


def load_full(url: str, *, storage=None, allow_pickle: bool = False,
              options: LoadOptions | None = None) -> dict:
    """Consolidate the checkpoint at ``url`` into full CPU tensors in this process.

    No collective; works with or without ``torch.distributed``. Returns the nested state dict
    with the saved structure (dicts, lists, tuples) and non-tensor values restored.
    """
    options = options or LoadOptions()
    manifest = read_manifest(url, storage=storage, allow_pickle=allow_pickle)
    store = shared_store(url, storage)
    run_coroutine(check_object_extents(store, manifest))  # before allocating declared shapes
    leaves: dict[str, Any] = dict(manifest.values)
    requests, dests = [], []
    for name, record in manifest.tensors.items():
        full = torch.empty(tuple(record.shape), dtype=torch_dtype(record.dtype))
        leaves[name] = full
        requests.append(PieceSpec(name=name, dtype=record.dtype, global_shape=tuple(record.shape),
                                  offsets=(0,) * len(record.shape), sizes=tuple(record.shape),
                                  broadcastable=False))
        dests.append(full)
    plan = plan_local_load(manifest, requests, rank=0, value_names=tuple(manifest.values))
    run_coroutine(fetch_into(store, manifest, plan.reads, dests, options.max_read_bytes))
    return unflatten_state_dict(manifest.structure, leaves)


async def check_object_extents(store, manifest) -> None:
    """Refuse a manifest whose chunks reach past the end of the objects actually stored.

    One HEAD per data object. Run before anything is allocated from declared shapes or chunk
    lengths, so a manifest cannot make a load reserve memory that real objects do not justify.
    Raises :class:`ManifestError` naming the object.
    """
    extents = manifest.object_extents()

    async def check(index: int, key: str) -> None:
        need = extents.get(key, 0)
        if need == 0:
            return
        try:
            info = await store.head(key)
        except ObjectNotFound as exc:
            raise ManifestError(f"data object {key} is missing", path=f"objects[{index}]") from exc
        if info.size < need:
            raise ManifestError(f"data object {key} holds {info.size} bytes, the manifest "
                                f"refers to {need}", path=f"objects[{index}]")

    await asyncio.gather(*(check(i, k) for i, k in enumerate(manifest.objects)))


# -- helpers ------------------------------------------------------------------------------------


def _broadcast_predicate(channel: ControlChannel):
    """Destinations the job's broadcast backend can carry: CUDA for NCCL, CPU for gloo."""
    device_type = "cuda" if channel.backend == "nccl" else "cpu"
    return lambda t: t.device.type == device_type


def _assign_value(original, resolved, found, path: tuple, value) -> None:
    """Set a loaded non-tensor value in the resolved tree, and in the caller's own containers
    unless the path goes through a stateful object (which gets it via load_state_dict)."""
    set_by_path(resolved, path, value)
    if any(path[:len(p)] == p for p, _ in found):
        return
    try:
        set_by_path(original, path, value)
    except TypeError:  # a value inside a tuple cannot be replaced in place
        pass
