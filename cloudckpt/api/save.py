"""``cloudckpt.save``: the distributed save protocol.

Every rank of the process group calls :func:`save` with its own state dict. Phases (each ends in
a fail-together exchange on the control channel, so a failure anywhere raises the same
:class:`~cloudckpt.errors.CheckpointError` on every rank, within the channel's timeout):

1. plan: ``state_dict()`` on stateful values, flatten, local plan, fingerprint; the coordinator
   refuses an existing checkpoint (``CheckpointExists``) and picks the attempt id.
2. global plan: reused from the cache when every rank's fingerprint matches a cached plan,
   otherwise local plans are exchanged (msgpack) and every rank computes the same global plan.
3. write: each rank uploads the items it owns under ``data/<attempt>/``.
4. commit: the coordinator assembles the manifest from everyone's chunk locations and values and
   writes it in ``create`` mode. Its presence is the commit.

:func:`prepare_save` (phases 1-2) and :func:`finish_save` (phases 3-4) are separate so that
``async_save`` can stage data between them and run the rest in the background.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Mapping

import msgpack
import torch

from cloudckpt import layout
from cloudckpt.errors import CheckpointExists, ObjectExists, ObjectNotFound
from cloudckpt.manifest import decode_value, encode_manifest, encode_value
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.planning import (LocalSavePlan, SavePlanCache, WrittenChunks, assemble_manifest,
                                decode_local_save_plan, decode_written_chunks,
                                encode_local_save_plan, encode_written_chunks, key_digest,
                                plan_global_save, save_plan_cache_key)
from cloudckpt.runtime import run_coroutine, shared_store, wait_for_pending_save
from cloudckpt.stateful import resolve_stateful
from cloudckpt.statedict import flatten_state_dict, merge_structures
from cloudckpt.transport import ControlChannel
from cloudckpt.writer import WriterOptions, write_chunks

_plan_cache = SavePlanCache(maxsize=8)


@dataclass
class PreparedSave:
    """A save after planning: what this rank writes, ready for :func:`finish_save`."""

    url: str
    channel: ControlChannel
    options: SaveOptions
    storage: Any
    attempt: str
    plan: Any                      # GlobalSavePlan
    items: list                    # [(chunk_id, tensor)] this rank writes
    values: dict[str, bytes]       # encoded values this rank owns
    structure: Any
    metadata: dict
    allow_pickle: bool
    plan_cached: bool
    started: float = field(default_factory=time.perf_counter)


def save(state_dict: Mapping[str, Any], url: str, *, process_group=None, storage=None,
         allow_pickle: bool = False, metadata: Mapping[str, Any] | None = None,
         options: SaveOptions | None = None) -> SaveResult:
    """Save ``state_dict`` (this rank's part) to the checkpoint at ``url``. Collective.

    ``url`` is ``s3://bucket/prefix``, ``file:///path`` or a plain path. ``storage`` is a
    :class:`cloudckpt.storage.StorageOptions`. Non-tensor values must be msgpack-able unless
    ``allow_pickle=True``. Raises :class:`CheckpointExists` if ``url`` already holds a committed
    checkpoint (which stays untouched), and :class:`CheckpointError` (the same on every rank)
    if any rank fails.
    """
    prepared = prepare_save(state_dict, url, process_group=process_group, storage=storage,
                            allow_pickle=allow_pickle, metadata=metadata, options=options)
    return finish_save(prepared)


def prepare_save(state_dict, url, *, process_group=None, storage=None, allow_pickle=False,
                 metadata=None, options=None) -> PreparedSave:
    """Phases 1-2: plan the save on every rank. Collective."""
    wait_for_pending_save()
    options = options or SaveOptions()
    channel = ControlChannel(process_group, timeout=options.timeout)
    started = time.perf_counter()
    error: BaseException | None = None
    payload = b""
    try:
        resolved, _ = resolve_stateful(state_dict)
        flat = flatten_state_dict(resolved)
        pieces, tensors = [], []
        for leaf in flat.tensors.values():
            for spec, tensor in leaf.pieces:
                pieces.append(spec)
                tensors.append(tensor)
        value_names = tuple(flat.values)
        encoded_values = {name: encode_value(v.value, key=name, allow_pickle=allow_pickle)
                          for name, v in flat.values.items()}
        local = LocalSavePlan(rank=channel.rank, world_size=channel.size,
                              pieces=tuple(pieces), value_names=value_names)
        attempt = ""
        if channel.is_coordinator:
            _refuse_existing(url, storage)
            attempt = layout.new_attempt_id()
        payload = msgpack.packb([local.fingerprint(), attempt])
    except BaseException as exc:  # reported to every rank by agree()
        error = exc
    gathered = channel.agree("save planning", payload, error)
    fingerprints = tuple(msgpack.unpackb(g)[0] for g in gathered)
    attempt = msgpack.unpackb(gathered[0])[1]

    key = save_plan_cache_key(fingerprints, replicas_to_lowest_rank=options.replicas_to_lowest_rank)
    key = key + (msgpack.packb(list(channel.ranks)),)
    plan = _plan_cache.get(key) if options.use_plan_cache else None
    # caches can differ between ranks (a restarted rank): reuse only if every rank hits
    votes = channel.all_gather_bytes(msgpack.packb([plan is not None, key_digest(key)]))
    plan_cached = all(msgpack.unpackb(v)[0] for v in votes) and \
        len({bytes(msgpack.unpackb(v)[1]) for v in votes}) == 1
    if not plan_cached:
        raw_plans = channel.all_gather_bytes(encode_local_save_plan(local))
        error = None
        try:
            plan = plan_global_save([decode_local_save_plan(b) for b in raw_plans],
                                    rank=channel.rank,
                                    replicas_to_lowest_rank=options.replicas_to_lowest_rank)
        except BaseException as exc:
            error = exc
        channel.agree("save global planning", b"", error)
        if options.use_plan_cache:
            _plan_cache.put(key, plan)

    items = [(w.chunk_id, tensors[w.piece_index]) for w in plan.writes]
    owned = {name: encoded_values[name] for name, owner in plan.value_owner.items()
             if owner == channel.rank and name in encoded_values}
    return PreparedSave(url=url, channel=channel, options=options, storage=storage,
                        attempt=attempt, plan=plan, items=items, values=owned,
                        structure=flat.structure, metadata=dict(metadata or {}),
                        allow_pickle=allow_pickle, plan_cached=plan_cached, started=started)


def finish_save(p: PreparedSave) -> SaveResult:
    """Phases 3-4: upload this rank's items, then commit. Collective."""
    channel = p.channel
    error: BaseException | None = None
    payload = b""
    rank_bytes = 0
    try:
        store = shared_store(p.url, p.storage)
        wopts = WriterOptions(object_size=p.options.object_size,
                              checksum_block_size=p.options.checksum_block_size,
                              max_staging_bytes=p.options.max_staging_bytes)
        locations, stats = run_coroutine(
            write_chunks(store, p.items, rank=channel.rank, attempt=p.attempt, options=wopts))
        rank_bytes = stats.bytes_written
        payload = msgpack.packb([encode_written_chunks(_written_chunks(channel.rank, locations,
                                                                       p.values)),
                                 p.plan.skeleton.digest(), stats.bytes_written, stats.objects,
                                 encode_value(p.structure, key="structure", allow_pickle=False)])
    except BaseException as exc:
        error = exc
    gathered = channel.agree("save upload", payload, error)

    error = None
    total_bytes = total_objects = 0
    try:
        reports = [msgpack.unpackb(g) for g in gathered]
        total_bytes = sum(r[2] for r in reports)
        total_objects = sum(r[3] for r in reports)
        if channel.is_coordinator:
            if len({bytes(r[1]) for r in reports}) != 1:
                raise RuntimeError("ranks disagree on the global save plan (plan cache out of sync)")
            manifest = assemble_manifest(
                p.plan.skeleton, [decode_written_chunks(r[0]) for r in reports],
                world_size=channel.size, checksum_block_size=p.options.checksum_block_size,
                metadata=p.metadata, allow_pickle=p.allow_pickle,
                # ranks may hold different keys (pipeline stages): the union of their nestings
                structure=merge_structures([decode_value(r[4], key="structure", allow_pickle=False)
                                            for r in reports]))
            store = shared_store(p.url, p.storage)
            try:
                run_coroutine(store.put(layout.MANIFEST_KEY, encode_manifest(manifest),
                                        mode="create"))
            except ObjectExists as exc:
                raise CheckpointExists(f"a checkpoint was committed at {p.url} meanwhile") from exc
    except BaseException as exc:
        error = exc
    channel.agree("save commit", b"", error)
    return SaveResult(url=p.url, bytes_written=total_bytes, objects=total_objects,
                      seconds=time.perf_counter() - p.started, rank_bytes_written=rank_bytes,
                      attempt=p.attempt, plan_cached=p.plan_cached)


def _refuse_existing(url: str, storage) -> None:
    store = shared_store(url, storage)
    try:
        run_coroutine(store.head(layout.MANIFEST_KEY))
    except ObjectNotFound:
        return
    raise CheckpointExists(f"a checkpoint is already committed at {url}")


def _written_chunks(rank: int, locations, values: dict[str, bytes]) -> WrittenChunks:
    keys: dict[str, int] = {}
    for loc in locations:
        keys.setdefault(loc.object_key, len(keys))
    return WrittenChunks(
        rank=rank, object_keys=tuple(keys),
        chunk_ids=[loc.chunk_id for loc in locations],
        object_index=[keys[loc.object_key] for loc in locations],
        byte_offset=[loc.byte_offset for loc in locations],
        byte_length=[loc.byte_length for loc in locations],
        crcs=[c for loc in locations for c in loc.crcs], values=values)
