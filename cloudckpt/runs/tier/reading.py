"""A run's load and listing with a node-local tier (the save side: :mod:`cloudckpt.runs.tier.flow`).

Load (collective): one ``── tier inventory ──`` exchange before the load's own phases: every
rank's tier service (:func:`~cloudckpt.runs.tier.peers.decode_peer`: the map of nodes is
always the one reported now, whatever this process knew before), what each node's tier holds
(the first rank of each node sends it, as untrusted bytes:
:func:`~cloudckpt.runs.tier.node.decode_inventory`; without a map known in this process, each
rank whose ``LOCAL_RANK`` is unset or 0 does, and when a node's first rank did not, one more
exchange, ``── tier inventory (again) ──``, gathers the missing ones); meanwhile the
coordinator starts listing the object store. The step loaded is the one asked for, else the
newest complete somewhere: in the tiers together (the nodes holding one manifest hold all of
its objects between them) or in the object store (a newer step complete in the store only
wins). When the tiers hold a complete step, nobody waits for the listing: the tiers' newest
(or the step asked for) is loaded, and the coordinator checks the listing when it reads the
manifest (:class:`NewerCheck`); a newer complete step there fails that phase on every rank
(:class:`NewerStepInStore`), every rank gets the listing (``── tier listing ──``) and loads
that step. Without a complete step in the tiers, ``── tier listing ──`` comes first. A step is
loaded by ``api.load.load_from``
through a :class:`TieredSource`: the manifest from the nearest holder whose bytes have the
chosen crc32c; each object from this node's tier, then the other nodes nearest first (replica
holders first), then the object store (:class:`~cloudckpt.storage.peer.tiered.TieredStore`: a
holder whose bytes fail their crcs is logged and the next one read; none is ever loaded). The
store serves as a fallback only for the very same checkpoint: :class:`StoreBehind` reads its
manifest when first needed and refuses every read if its crc32c is another. The manifest's
extents are checked against the sizes the inventories give (no request), the store's objects by
a HEAD (:func:`check_extents`).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from cloudckpt.checksum import crc32c
from cloudckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    ManifestError,
    ObjectNotFound,
    ProtocolError,
    StorageError,
)
from cloudckpt.layout import MANIFEST_KEY, step_dir
from cloudckpt.manifest.codec import decode_manifest
from cloudckpt.options import LoadOptions
from cloudckpt.runs.pruning import CheckpointInfo, list_run
from cloudckpt.runs.tier.node import Inventory, complete_steps, decode_inventory, encode_inventory
from cloudckpt.runs.tier.peers import Blob, Nodes, Peer, decode_peer, encode_peer
from cloudckpt.runtime.loop import run_coroutine, shared_store, submit
from cloudckpt.storage.base import ObjectInfo, ReadRange
from cloudckpt.storage.peer.tiered import Holder, TieredStore
from cloudckpt.transport import INLINE_BYTES

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """The step a load reads: ``crc`` of its manifest in the tiers (``None``: not complete
    there), ``in_store``: complete in the object store (``None``: not known, the store's listing
    not waited for: its copy is checked when first read), every rank's inventory; ``newest``:
    the step is the tiers' newest, chosen before the store's listing was in: the coordinator
    checks, when it reads the manifest, that the store has no newer complete step."""

    step: int
    crc: int | None
    in_store: bool | None
    inventories: list[Inventory]
    nodes: Nodes | None
    newest: bool = False


class NewerStepInStore(CheckpointNotFound):
    """The store's listing has a complete step newer than the tiers' newest (raised by the
    coordinator while the load reads the manifest; every rank then chooses again)."""


def load_step(run, state_dict, step: int | None, strict: bool) -> int | None:
    """``CheckpointManager.load`` with a tier (collective)."""
    try:
        choice = choose(run, step)
        if choice is None:
            return None
        try:
            _load(run, state_dict, choice, strict)
        except CheckpointError as exc:
            if not choice.newest or not _newer_in_store(exc):
                raise
            # the store's newest is newer than every step of the tiers: none is the choice
            choice = _choose_with_listing(run, None, choice.inventories, choice.nodes, {})
            if choice is None:  # cannot be: the store had a newer step a moment ago
                raise
            _load(run, state_dict, choice, strict)
        return choice.step
    finally:
        listing, run.store_listing = run.store_listing, None
        if listing is not None:
            listing.cancel()


def _load(run, state_dict, choice: Choice, strict: bool) -> None:
    from cloudckpt.api.load import load_from

    if choice.crc is None and choice.in_store is False:
        raise CheckpointNotFound(
            f"step {choice.step} is complete neither in the local tiers nor at {run.run_url}"
        )
    source = tiered_source(run, choice, run.channel().rank)
    options = run.manager.load_options or LoadOptions()
    load_from(
        state_dict,
        source,
        process_group=run.process_group,
        strict=strict,
        options=replace(
            options,
            join_as=run.step_url(choice.step),
            # a step the tiers hold: each rank reads the manifest from its nearest holder,
            # checked against the crc every rank agreed on (no broadcast of it)
            share_manifest=options.share_manifest and choice.crc is None,
        ),
    )


def _newer_in_store(exc: CheckpointError) -> bool:
    """Whether ``exc`` (every rank's, alike) is the coordinator's :class:`NewerStepInStore`."""
    failures = getattr(exc, "failures", None) or {}
    found = failures.get(0)
    return isinstance(exc, NewerStepInStore) or (
        found is not None and found.error_type == NewerStepInStore.__name__
    )


@dataclass(frozen=True)
class Gathered:
    """One rank's ``tier inventory`` report: its service, its node's inventory (``None``: not
    sent)."""

    peer: Peer
    inventory: Inventory | None


def choose(run, step: int | None) -> Choice | None:
    """The step to load and where it is complete (collective); ``None``: nothing anywhere."""
    channel = run.channel()
    known = run.known_nodes()
    rank = channel.rank
    if known is not None and len(known.node_of) == channel.size:
        sends = known.first_rank[known.node_of[rank]] == rank
    else:  # a guess (torchrun's numbering); a wrong one costs the exchange below
        sends = os.environ.get("LOCAL_RANK", "0") in ("", "0")
    reports = _gather(run, "tier inventory", None, sends, listing=True)
    me = reports[rank].peer
    nodes = run.adopt([r.peer for r in reports])
    if nodes is not None and any(reports[f].inventory is None for f in nodes.first_rank):
        first = nodes.first_rank[nodes.node_of[rank]] == rank
        reports = _gather(run, "tier inventory (again)", me, first, listing=False)
    inventories: list[Inventory] = [{} for _ in reports]
    if nodes is not None:
        for f in nodes.first_rank:
            inventories[f] = reports[f].inventory or {}
    run.last_inventories = inventories
    in_tiers = complete_steps(inventories) if nodes is not None else {}
    if step is not None and step in in_tiers:  # the store: checked when first read, if ever
        return Choice(step, in_tiers[step], None, inventories, nodes)
    if step is None and in_tiers:  # the tiers' newest, the store's listing checked meanwhile
        newest = max(in_tiers)
        return Choice(newest, in_tiers[newest], None, inventories, nodes, newest=True)
    return _choose_with_listing(run, step, inventories, nodes, in_tiers)


def _choose_with_listing(
    run, step: int | None, inventories: list[Inventory], nodes: Nodes | None, in_tiers: dict
) -> Choice | None:
    """The choice once every rank has the store's listing (``── tier listing ──``: the
    coordinator's, taken since the inventory exchange)."""
    channel = run.channel()
    with channel.phase("tier listing", Blob) as sharing:
        if channel.is_coordinator:
            listed = run.store_listing or submit(list_run(run.manager.store, run.run_url))
            stored = [i.step for i in listed.result() if i.complete and i.step is not None]
            sharing.report = Blob(msgpack.packb(stored))
    stored = _decode_steps(sharing.reports[0].raw)
    if step is None:
        if not in_tiers and not stored:
            return None
        step = max(set(in_tiers) | set(stored))
    return Choice(step, in_tiers.get(step), step in stored, inventories, nodes)


def _gather(run, what: str, me: Peer | None, sends: bool, *, listing: bool) -> list[Gathered]:
    """One exchange of every rank's :class:`Gathered` (``me``: this rank's service, ``None``:
    claimed and started here, inside the phase); with ``listing``, the coordinator starts
    listing the object store (``run.store_listing``)."""
    channel = run.channel()
    with channel.phase(what, Blob, inline=inventory_slot_bytes(channel.size)) as gathering:
        if me is None:
            me = run.peer()
        own = encode_inventory(run.node.inventory()) if sends and not me.problem else None
        if listing and channel.is_coordinator and run.store_listing is None:
            # after its own inventory, which every rank waits for; the listing is not waited for
            run.store_listing = submit(list_run(run.manager.store, run.run_url))
        gathering.report = Blob(msgpack.packb([encode_peer(me), own]))
    return [_decode_gathered(r.raw) for r in gathering.reports]


def tiered_source(run, choice: Choice, rank: int) -> TieredSource:
    """How this rank reads the chosen step: each object's holders, nearest first."""
    step = choice.step
    store_url = run.step_url(step)
    holders: dict[str, list[Holder]] = {}
    order: list[Holder] = []
    nodes = choice.nodes
    if choice.crc is not None and nodes is not None:
        me = nodes.node_of[rank]
        for node in [me, *nodes.order(me)]:
            inv = choice.inventories[nodes.first_rank[node]].get(step)
            if inv is None or inv.crc != choice.crc:
                continue
            if node == me:
                store: Any = shared_store(run.node.step_url(step))
                holder = Holder("local tier", store, inv.sizes)
            else:
                store = run.peer_store(nodes, node, step_dir(step))
                holder = Holder(f"node {node}'s tier", store, inv.sizes)
            order.append(holder)
            for key in inv.held:
                holders.setdefault(key, []).append(holder)
    behind: tuple[Holder, ...] = ()
    if choice.in_store is not False:  # True, or not known: its manifest is checked when read
        checked = StoreBehind(shared_store(store_url, run.storage), choice.crc)
        behind = (Holder("object store", checked),)
        order.extend(behind)
        for listed in holders.values():
            listed.extend(behind)
    return TieredSource(
        url=store_url,
        storage=run.storage,
        allow_pickle=run.allow_pickle,
        crc=choice.crc,
        holders=tuple(order),
        tiered=TieredStore(store_url, holders, default=behind),
        newer=(
            NewerCheck(step, run.store_listing)
            if choice.newest and rank == 0 and run.store_listing is not None
            else None
        ),
    )


@dataclass(frozen=True)
class NewerCheck:
    """The coordinator's check, when it reads the manifest, that the store's listing (taken
    since the inventory exchange) has no complete step newer than ``step``, the tiers' newest."""

    step: int
    listing: Any  # a concurrent future of list_run

    def __call__(self) -> None:
        listed = self.listing.result()
        newer = [i.step for i in listed if i.complete and i.step is not None and i.step > self.step]
        if newer:
            raise NewerStepInStore(
                f"step {max(newer)} is complete in the object store, newer than the tiers' "
                f"step {self.step}"
            )


class StoreBehind:
    """The object store's copy of one step, behind the tiers: every read first checks (once,
    when first needed) that the store's manifest is the chosen one (crc32c ``crc``; ``None``:
    the step is read from the store alone, whatever its manifest); another one makes every read
    raise ``StorageError`` (a tiered read then tries no further holder: the store is the last)."""

    remote = True
    local_root = None

    def __init__(self, store, crc: int | None):
        self.unchecked = store
        self.crc = crc
        self._same: bool | None = None if crc is not None else True
        self._lock: asyncio.Lock | None = None

    async def _store(self):
        if self._same is None:
            if self._lock is None:
                self._lock = asyncio.Lock()
            async with self._lock:
                if self._same is None:
                    raw = await self.unchecked.get(MANIFEST_KEY, max_bytes=1 << 30)
                    self._same = crc32c(raw) == self.crc
        if not self._same:
            raise StorageError("the object store holds another save of this step")
        return self.unchecked

    async def head(self, key: str) -> ObjectInfo:
        return await (await self._store()).head(key)

    async def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        return await (await self._store()).get(key, max_bytes=max_bytes)

    async def read_ranges(self, key: str, ranges: Sequence[ReadRange]) -> list[memoryview]:
        return await (await self._store()).read_ranges(key, ranges)


async def check_extents(tiered: TieredStore, manifest) -> None:
    """``api.load.check_object_extents`` of a tiered load: an object whose holder's inventory
    gives a size covering the manifest's extent costs no request (that holder's reads are
    checked against the crcs all the same, and fail over when short); the others are asked, in
    order (a HEAD). ``ManifestError`` names an object no holder has enough bytes of."""
    extents = manifest.object_extents()

    async def check(index: int, key: str) -> None:
        need = extents.get(key, 0)
        if need == 0:
            return
        holders = tiered.holders(key)
        known = [h.sizes[key] for h in holders if h.sizes is not None and key in h.sizes]
        if any(n >= need for n in known):
            return
        best = max(known, default=None)
        last: Exception | None = None
        for holder in holders:
            if holder.sizes is not None and key in holder.sizes:
                continue
            try:
                size = (await holder.store.head(key)).size
            except ObjectNotFound:
                continue
            except (StorageError, OSError) as exc:
                last = exc
                continue
            if size >= need:
                return
            best = max(size, best or 0)
        if best is None and last is not None:
            raise last
        if best is None:
            raise ManifestError(f"data object {key} is missing", path=f"objects[{index}]")
        raise ManifestError(
            f"data object {key} holds {best} bytes, the manifest refers to {need}",
            path=f"objects[{index}]",
        )

    await asyncio.gather(*(check(i, k) for i, k in enumerate(manifest.objects)))


@dataclass(frozen=True)
class TieredSource:
    """The ``ManifestSource`` (``api/load.py``) of a tiered load: the manifest from the nearest
    holder whose bytes have the chosen crc32c, the data through a :class:`TieredStore`."""

    url: str
    storage: Any
    allow_pickle: bool
    crc: int | None
    holders: tuple[Holder, ...]
    tiered: TieredStore
    newer: NewerCheck | None = None

    def read(self, store) -> bytes:
        if self.newer is not None:
            self.newer()
        problems = []
        for holder in self.holders:
            where = getattr(holder.store, "unchecked", holder.store)  # the crc is checked here
            try:
                raw = run_coroutine(where.get(MANIFEST_KEY, max_bytes=1 << 30))
            except (StorageError, OSError) as exc:
                problems.append(f"{holder.name}: {exc}")
                continue
            if self.crc is None or crc32c(raw) == self.crc:
                return raw
            problems.append(f"{holder.name}: another manifest")
            log.warning("cloudckpt: the manifest in %s is not the chosen one", holder.name)
        raise CheckpointNotFound(f"no tier holds the manifest of {self.url}: {problems}"[:500])

    def decode(self, raw: bytes):
        return decode_manifest(raw, allow_pickle=self.allow_pickle)

    def check(self, manifest, store) -> None:
        run_coroutine(check_extents(self.tiered, manifest))

    def data_store(self, store, raw: bytes):
        return self.tiered


def listing(run, listed: list[CheckpointInfo]) -> list[CheckpointInfo]:
    """The object store's listing with each step's ``tiers``, and the steps complete in the
    tiers only (no collective: the peers as this process last saw them)."""
    by_step = {i.step: i for i in listed if i.step is not None}
    inventory = run.node.inventory()
    out = []
    for step in sorted(set(by_step) | set(inventory)):
        info = by_step.get(step) or CheckpointInfo(
            step=step, url=run.step_url(step), complete=False
        )
        found = []
        inv = inventory.get(step)
        if inv is not None and set(inv.listed) <= inv.held:
            found.append("local")
        if inv is not None and (
            step in run.replicated or step in complete_steps([*run.last_inventories, {step: inv}])
        ):
            found.append("peers")
        if info.complete:
            found.append("store")
        out.append(replace(info, tiers=tuple(found), complete=bool(found)))
    return out + [i for i in listed if i.step is None]  # named folders: the store's alone


def inventory_slot_bytes(ranks: int) -> int:
    """Bytes of each rank's slot in the first all-gather of a ``tier inventory`` exchange: a
    node's inventory (two steps of a few objects: about 1 KiB at 8 nodes) fits it, so the
    exchange is one all-gather, up to 128 KiB gathered in all (the slots shrink as the world
    grows; a larger inventory costs a second all-gather, as wide as the largest)."""
    return max(INLINE_BYTES, min(8 << 10, (128 << 10) // max(ranks, 1)))


def _decode_gathered(raw: bytes) -> Gathered:
    """A ``tier inventory`` report from untrusted bytes (``ProtocolError`` unless well-formed)."""
    try:
        peer, own = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - malformed bytes of any kind
        raise ProtocolError(f"malformed tier inventory report: {exc}"[:200]) from exc
    if not isinstance(peer, bytes) or own is not None and not isinstance(own, bytes):
        raise ProtocolError("a tier inventory report is [peer, inventory or nil]")
    return Gathered(decode_peer(peer), None if own is None else decode_inventory(own))


def _decode_steps(raw: bytes) -> list[int]:
    """A ``tier listing`` report (the store's complete steps) from untrusted bytes."""
    try:
        stored = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - malformed bytes of any kind
        raise ProtocolError(f"malformed tier listing report: {exc}"[:200]) from exc
    if not isinstance(stored, list) or not all(type(s) is int and s >= 0 for s in stored):
        raise ProtocolError("a tier listing report lists steps as ints >= 0")
    return stored
