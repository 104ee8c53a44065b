"""``cloudckpt.save``: the distributed save protocol.

Every rank of the process group calls :func:`save` with its own state dict. Phases (each a
:meth:`~cloudckpt.transport.ControlChannel.phase`: it runs on every rank and ends in a
fail-together exchange, so a failure anywhere raises the same
:class:`~cloudckpt.errors.CheckpointError` on every rank, within the channel's timeout):

1. ``save planning``: ``state_dict()`` on stateful values, flatten, local plan; the coordinator
   refuses an existing checkpoint (``CheckpointExists``) and picks the attempt id. Every rank
   reports its plan's fingerprint and its plan-cache vote
   (:class:`~cloudckpt.api.reports.SavePlanning`).
2. global plan: reused from the cache when every rank holds the plan of these fingerprints
   (each rank its own share). Otherwise the local plans are gathered to the coordinator, which
   alone computes the global plan in ``save global planning`` (its report: the largest share's
   length) and scatters every rank its share (:mod:`cloudckpt.planning.save.share`: its write
   items, the values it owns, the plan's digest); ``save plan share``: each rank decodes its
   share and checks it against its own local plan.
3. ``save base`` (saves given a base only): the coordinator reads the base (a read started
   during phase 1, in the background), pins the folders the save may reference and broadcasts
   the content hashes of the base's matching chunks (:mod:`cloudckpt.api.incremental`). Every
   rank's hashing of its items (the same pass as their block crcs) has already started in the
   background: it runs meanwhile.
4. ``save upload``: each rank uploads the items it owns under ``data/<attempt>/`` (in an
   incremental save: each item as its hash is ready, skipping those whose hash is the base's) and
   reports where they landed and its share's plan digest
   (:class:`~cloudckpt.api.reports.UploadReport`).
5. ``save commit``: every rank's :class:`~cloudckpt.api.reports.SaveWritten` (where its chunks
   landed; its nesting unless a lower rank holds the same) is gathered to the coordinator, which
   assembles the manifest and writes it in ``create`` mode. Its presence is the commit.
   (``if_exists="replace"``: it overwrites the old manifest, then collects the old objects,
   :mod:`cloudckpt.api.commit`.)

:func:`prepare_save` (phases 1-2) and :func:`finish_save` (phases 3-5) are separate so that
``async_save`` can stage data between them and run the rest in the background (hashing included:
it reads the staged copies). The checkpoint's store is opened once, in phase 1, and travels in the
:class:`PreparedSave` (a frozen plan); what the later phases learn is a :class:`SaveProgress`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import msgpack
import numpy as np

from cloudckpt import layout
from cloudckpt.api.commit import refuse_existing, write_manifest
from cloudckpt.api.incremental import PinnedBase, base_folder, open_base, read_base
from cloudckpt.api.prepared import BaseSite, PreparedSave, SaveProgress
from cloudckpt.api.reports import SavePlanning, SaveWritten, UploadReport, distinct_structures
from cloudckpt.api.save_planning import chunk_view, plan_globally, plan_locally
from cloudckpt.checksum import identity_digest
from cloudckpt.dataplane.writer import ItemDigests, KnownItems, WriterOptions, write_chunks
from cloudckpt.errors import CheckpointExists
from cloudckpt.manifest.values import encode_value
from cloudckpt.options import SaveOptions, SaveResult
from cloudckpt.planning.save.assemble import (
    assemble_manifest,
    encode_written_chunks,
    written_chunks,
)
from cloudckpt.planning.save.cache import key_digest, save_plan_cache_key
from cloudckpt.planning.save.global_plan import ManifestSkeleton
from cloudckpt.planning.save.incremental import decode_known, encode_known, reused_chunks
from cloudckpt.planning.save.local_plan import encode_local_save_plan
from cloudckpt.planning.save.rates import WRITE_RATES, replica_weights
from cloudckpt.runtime.context import current
from cloudckpt.runtime.hugepages import without_huge_page_advice
from cloudckpt.runtime.loop import (
    open_in_background,
    run_coroutine,
    shared_store,
    start_task,
    submit,
    wait_for_pending_save,
)
from cloudckpt.statedict.flatten import merge_structures
from cloudckpt.storage.base import ObjectStore
from cloudckpt.transport import ControlChannel


def save(
    state_dict: Mapping[str, Any],
    url: str,
    *,
    process_group=None,
    storage=None,
    allow_pickle: bool = False,
    metadata: Mapping[str, Any] | None = None,
    options: SaveOptions | None = None,
    base: str | None = None,
) -> SaveResult:
    """Save ``state_dict`` (this rank's part) to the checkpoint at ``url``. Collective.

    ``url`` is ``s3://bucket/prefix``, ``file:///path`` or a plain path. ``storage`` is a
    :class:`cloudckpt.storage.StorageOptions`. Non-tensor values must be msgpack-able unless
    ``allow_pickle=True``. Raises :class:`CheckpointExists` if ``url`` already holds a committed
    checkpoint (which stays untouched), and :class:`CheckpointError` (the same on every rank)
    if any rank fails.

    ``process_group``: the ranks that save together (default: the world);
    ``process_group="self"``: this process alone, no collective, even in a distributed job
    (a checkpoint that rank 0 saves by itself, as trainers do for non-sharded state).

    ``base``: the URL of another checkpoint of the same run (a sibling folder; the coordinator's
    value is the one used): an *incremental* save. Every chunk whose bytes equal those of the
    same chunk (tensor, box, dtype) of the base is not uploaded; the manifest points at the
    object that already holds it (see docs/guide.md, "Incremental checkpoints"). A base that is
    gone, changed meanwhile or records no chunk hashes makes a full save (logged). Chunk hashes
    are recorded with a base or ``options.content_hashes``.
    """
    prepared = prepare_save(
        state_dict,
        url,
        process_group=process_group,
        storage=storage,
        allow_pickle=allow_pickle,
        metadata=metadata,
        options=options,
        base=base,
    )
    return finish_save(prepared)


def prepare_save(
    state_dict,
    url,
    *,
    process_group=None,
    storage=None,
    allow_pickle=False,
    metadata=None,
    options=None,
    base=None,
    call: str = "save",
) -> PreparedSave:
    """Phases 1-2: plan the save on every rank, once all joined ``call`` of ``url`` (or of
    ``options.join_as``: a node-local tier saves each node's part to its own directory).
    Collective."""
    wait_for_pending_save()
    options = options or SaveOptions()
    channel = ControlChannel(process_group, timeout=options.timeout)
    channel.join(call, options.join_as or url, options.join_timeout)
    started = time.perf_counter()
    plan_cache = current().save_plans
    # the coordinator can only reuse a plan whose skeleton it holds (it assembles the manifest)
    cached = {
        d: share
        for d, share in (plan_cache.held() if options.use_plan_cache else {}).items()
        if share.skeleton is not None or not channel.is_coordinator
    }

    with channel.phase("save planning", SavePlanning) as planning:
        # the one opening of the checkpoint's store for this save (a malformed URL fails here)
        store = shared_store(url, storage)
        open_in_background(store)  # the first call's client starts while this rank plans
        local = plan_locally(state_dict, channel, allow_pickle)
        attempt = _new_attempt(url, store, options) if channel.is_coordinator else ""
        site, base_read = None, None
        if channel.is_coordinator and base is not None:
            # a base outside the run fails every rank, before any I/O
            run_url, folder, base_name = base_folder(url, base)
            site = BaseSite(run_store=shared_store(run_url, storage), folder=folder, base=base_name)
            # read the base's manifest while the planning goes on (no side effect)
            base_read = submit(read_base(site.run_store, base_name))
        planning.report = SavePlanning(
            fingerprint=local.plan.fingerprint(),
            attempt=attempt,
            cached_plans=tuple(cached),
            incremental=channel.is_coordinator and (base is not None or options.content_hashes),
            with_base=channel.is_coordinator and base is not None,
            write_rate_class=WRITE_RATES.rate_class(),
            plan_bytes=len(encode_local_save_plan(local.plan)),
        )

    weights = replica_weights([r.write_rate_class for r in planning.reports])  # rates differ?
    key = save_plan_cache_key(
        [r.fingerprint for r in planning.reports],
        replicas_to_lowest_rank=options.replicas_to_lowest_rank,
        rate_weights=weights,
    )
    key = key + (msgpack.packb(list(channel.ranks)),)
    digest = key_digest(key)
    # caches can differ between ranks (a restarted rank): reuse only if every rank holds it
    plan_cached = all(digest in r.cached_plans for r in planning.reports)
    if plan_cached:
        share = cached[digest]
    else:
        width = max(r.plan_bytes for r in planning.reports)
        share = plan_globally(channel, local.plan, width, options, weights)
    if options.use_plan_cache:
        plan_cache.put(key, share)

    items = [(c, chunk_view(local.tensors[p], at, sz)) for c, p, at, sz in share.boxes()]
    owned = {name: local.values[name] for name in share.values}
    return PreparedSave(
        url=url,
        store=store,
        channel=channel,
        options=options,
        attempt=planning.reports[0].attempt,
        share=share,
        items=items,
        values=owned,
        structure=local.structure,
        metadata=dict(metadata or {}),
        allow_pickle=allow_pickle,
        plan_cached=plan_cached,
        started=started,
        incremental=planning.reports[0].incremental,
        with_base=planning.reports[0].with_base,
        base=site,
        base_read=base_read,
    )


def finish_save(p: PreparedSave) -> SaveResult:
    """Phases 3-5: pin the base (incremental), upload this rank's items, then commit.
    Collective."""
    channel = p.channel
    progress = SaveProgress()
    pinned: PinnedBase | None = None
    digests: ItemDigests | None = None
    try:
        known: KnownItems = {}
        if p.with_base:  # (hashes without a base: no base phase, the upload hashes)
            # hash (and crc) every item while the coordinator reads and pins the base
            digests = ItemDigests(p.items, _writer_options(p.options))
            run_coroutine(digests.start())
            with channel.phase("save base"):
                if channel.is_coordinator and p.base is not None:
                    pinned = _pin_base(p, p.base)
            table = channel.broadcast_bytes(
                (encode_known(pinned.chunks.known(), pinned.chunks.folder) if pinned else b"")
                if channel.is_coordinator
                else None
            )
            if table:
                mine = set(p.share.chunk_ids.tolist())
                known, progress.base_used = decode_known(table)
                known = {c: h for c, h in known.items() if c in mine}

        with channel.phase("save upload", UploadReport) as upload:
            upload.report, landed = _upload(p, known, digests)

        with channel.phase("save commit"):
            # where the chunks landed: for the coordinator alone (no rank receives every report)
            width = max(r.written_bytes for r in upload.reports)
            nestings = [r.structure_digest for r in upload.reports]
            if nestings.index(nestings[channel.rank]) < channel.rank:  # a lower rank sends it
                landed = replace(landed, structure=b"")
            gathered = channel.gather_bytes(landed.encode(), width=width)
            if channel.is_coordinator:
                _commit(
                    p, progress, upload.reports, [SaveWritten.decode(g) for g in gathered], pinned
                )
    except BaseException as exc:
        if digests is not None:
            run_coroutine(digests.stop())
        if pinned is not None:
            pinned.stop()
            # the pins record the references once the manifest may be there: kept then
            if not progress.manifest_sent or isinstance(exc, CheckpointExists):
                run_coroutine(pinned.release())
        raise
    if pinned is not None:
        pinned.stop()
        if channel.is_coordinator:
            run_coroutine(pinned.drop_unused(progress.used_homes))

    reports = upload.reports
    return SaveResult(
        url=p.url,
        bytes_written=sum(r.bytes_written for r in reports),
        objects=sum(r.objects for r in reports),
        seconds=time.perf_counter() - p.started,
        rank_bytes_written=reports[channel.rank].bytes_written,
        attempt=p.attempt,
        plan_cached=p.plan_cached,
        bytes_reused=sum(r.bytes_reused for r in reports),
        base=progress.base_used,
    )


# -- the work of each phase -------------------------------------------------------------------


def _new_attempt(url: str, store: ObjectStore, options: SaveOptions) -> str:
    """The coordinator's part of planning: refuse a committed checkpoint (unless replacing it),
    pick the attempt id."""
    if options.if_exists != "replace":
        refuse_existing(url, store)
    return layout.new_attempt_id()


def _pin_base(p: PreparedSave, site: BaseSite) -> PinnedBase | None:
    """The coordinator's part of ``save base``: the pinned base, its pins kept fresh."""
    read = p.base_read.result() if p.base_read is not None else None
    pinned = run_coroutine(
        open_base(
            site.run_store,
            folder=site.folder,
            base=site.base,
            attempt=p.attempt,
            skeleton=_skeleton(p),
            checksum_block_size=p.options.checksum_block_size,
            lease=p.options.pin_lease,
            read=read,
        )
    )
    if pinned is not None:
        pinned.task = start_task(pinned.refresh())
    return pinned


def _writer_options(options: SaveOptions) -> WriterOptions:
    return WriterOptions(
        object_size=options.object_size,
        checksum_block_size=options.checksum_block_size,
        max_staging_bytes=options.max_staging_bytes,
    )


def _upload(
    p: PreparedSave, known: KnownItems, digests: ItemDigests | None
) -> tuple[UploadReport, SaveWritten]:
    """This rank's upload: its report (to every rank) and its :class:`SaveWritten` (to the
    coordinator)."""
    rank = p.channel.rank
    run_coroutine(_opened(p.store))  # a rate sample measures the upload, not the client's start
    began = time.perf_counter()
    locations, stats = run_coroutine(
        write_chunks(
            p.store,
            p.items,
            rank=rank,
            attempt=p.attempt,
            options=_writer_options(p.options),
            hashing=p.incremental,
            known=known,
            digests=digests,
        )
    )
    WRITE_RATES.record(stats.bytes_written, time.perf_counter() - began)
    written = written_chunks(rank, locations, p.values, [c for c, _ in stats.reused])
    landed = SaveWritten(
        written=encode_written_chunks(written),
        structure=encode_value(p.structure, key="structure", allow_pickle=False),
    )
    report = UploadReport(
        plan_digest=p.share.plan_digest,
        bytes_written=stats.bytes_written,
        objects=stats.objects,
        bytes_reused=stats.bytes_reused,
        written_bytes=len(landed.encode()),
        structure_digest=identity_digest(landed.structure),
    )
    return report, landed


async def _opened(store: ObjectStore) -> None:
    """Wait for ``store``'s client, opening in the background since phase 1 (if it has one)."""
    opener = getattr(getattr(store, "connection", None), "client", None)
    if callable(opener):
        await opener()


def _commit(
    p: PreparedSave,
    progress: SaveProgress,
    reports: tuple[UploadReport, ...],
    landed: list[SaveWritten],
    pinned: PinnedBase | None,
) -> None:
    """The coordinator's part of the commit: assemble the manifest, write it in create mode
    (without numpy's huge-page advice, as the planning: ``runtime.hugepages``)."""
    with without_huge_page_advice():
        if any(r.plan_digest != p.share.plan_digest for r in reports):
            raise RuntimeError("ranks disagree on the global save plan (plan cache out of sync)")
        written = [r.written_chunks() for r in landed]
        reused = None
        if pinned is not None:
            ids = np.array(sorted(int(c) for w in written for c in w.reused), dtype=np.int64)
            reused = reused_chunks(pinned.chunks, ids)
        manifest = assemble_manifest(
            _skeleton(p),
            written,
            world_size=p.channel.size,
            checksum_block_size=p.options.checksum_block_size,
            metadata=p.metadata,
            allow_pickle=p.allow_pickle,
            # ranks may hold different keys (pipeline stages): the union of their nestings
            structure=merge_structures(distinct_structures(reports, landed)),
            reused=reused,
            hashed=p.incremental,
            attempt=p.attempt if p.with_base else "",  # names its pins (none without a base)
            base=pinned.chunks.folder if pinned is not None else "",
        )
        if pinned is not None:
            pinned.check_lease()
        progress.manifest_sent, progress.used_homes = True, frozenset(manifest.object_homes)
        write_manifest(p.url, p.store, manifest, replace=p.options.if_exists == "replace")


def _skeleton(p: PreparedSave) -> ManifestSkeleton:
    """The whole plan's skeleton: the coordinator's share holds it."""
    if p.share.skeleton is None:
        raise RuntimeError("the coordinator's share of the save plan has no skeleton")
    return p.share.skeleton
