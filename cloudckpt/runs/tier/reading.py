"""A run's load and listing with a node-local tier (the save side: :mod:`cloudckpt.runs.tier.flow`).

Load (collective): ``── tier peers ──`` (once per world), ``── tier inventory ──`` (what every
node's tier holds, as untrusted bytes: :func:`~cloudckpt.runs.tier.node.decode_inventory`; the
coordinator adds the steps complete in the object store), ``── tier decision ──`` (the
coordinator's crc32c of the chosen step's manifest in the object store, so that the store
serves as a fallback only for the very same checkpoint). The step loaded is the one asked for,
else the newest complete somewhere: in the tiers together (the nodes holding one manifest
hold all of its objects between them) or in the object store. It is loaded by
``api.load.load_from`` through a :class:`TieredSource`: each object from this node's tier, then
the other nodes nearest first (replica holders first), then the object store
(:class:`~cloudckpt.storage.peer.tiered.TieredStore`: a holder whose bytes fail their crcs is
logged and the next one read; none is ever loaded).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import msgpack

from cloudckpt.checksum import crc32c
from cloudckpt.errors import CheckpointNotFound, ProtocolError, StorageError
from cloudckpt.layout import MANIFEST_KEY, step_dir
from cloudckpt.manifest.codec import decode_manifest
from cloudckpt.options import LoadOptions
from cloudckpt.runs.pruning import CheckpointInfo, list_run
from cloudckpt.runs.tier.node import Inventory, complete_steps, decode_inventory, encode_inventory
from cloudckpt.runs.tier.peers import Blob, Nodes
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.storage.peer.tiered import Holder, TieredStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Choice:
    """The step a load reads: ``crc`` of its manifest in the tiers (``None``: not complete
    there), ``store_crc`` in the object store (``None``: not there), every rank's inventory."""

    step: int
    crc: int | None
    store_crc: int | None
    inventories: list[Inventory]
    nodes: Nodes | None


def load_step(run, state_dict, step: int | None, strict: bool) -> int | None:
    """``CheckpointManager.load`` with a tier (collective)."""
    from cloudckpt.api.load import load_from

    choice = choose(run, step)
    if choice is None:
        return None
    if choice.crc is None and choice.store_crc is None:
        raise CheckpointNotFound(
            f"step {choice.step} is complete neither in the local tiers nor at {run.run_url}"
        )
    source = tiered_source(run, choice, run.channel().rank)
    load_from(
        state_dict,
        source,
        process_group=run.process_group,
        strict=strict,
        options=replace(
            run.manager.load_options or LoadOptions(), join_as=run.step_url(choice.step)
        ),
    )
    return choice.step


def choose(run, step: int | None) -> Choice | None:
    """The step to load and where it is complete (collective); ``None``: nothing anywhere."""
    nodes = run.nodes()
    channel = run.channel()
    with channel.phase("tier inventory", Blob) as gathering:
        first = nodes is not None and nodes.first_rank[nodes.node_of[channel.rank]] == channel.rank
        own = encode_inventory(run.node.inventory() if first else {})
        stored: list[int] = []
        if channel.is_coordinator:
            listed = run_coroutine(list_run(run.manager.store, run.run_url))
            stored = [i.step for i in listed if i.complete and i.step is not None]
        gathering.report = Blob(msgpack.packb([own, stored]))
    docs = [_decode_gathered(r.raw) for r in gathering.reports]
    inventories = [d[0] for d in docs]
    run.last_inventories = inventories
    stored = docs[0][1]
    in_tiers = complete_steps(inventories) if nodes is not None else {}
    if step is None:
        if not in_tiers and not stored:
            return None
        step = max(set(in_tiers) | set(stored))
    with channel.phase("tier decision", Blob) as deciding:
        if channel.is_coordinator:
            crc = _manifest_crc(run.step_url(step), run.storage) if step in stored else None
            deciding.report = Blob(msgpack.packb(crc))
    store_crc = msgpack.unpackb(deciding.reports[0].raw)
    return Choice(step, in_tiers.get(step), store_crc, inventories, nodes)


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
                holder = Holder("local tier", shared_store(run.node.step_url(step)))
            else:
                holder = Holder(f"node {node}'s tier", run.peer_store(nodes, node, step_dir(step)))
            order.append(holder)
            for key in inv.held:
                holders.setdefault(key, []).append(holder)
    crc = choice.crc if choice.crc is not None else choice.store_crc
    behind: tuple[Holder, ...] = ()
    if choice.store_crc is not None and choice.store_crc == crc:
        behind = (Holder("object store", shared_store(store_url, run.storage)),)
        order.extend(behind)
        for listed in holders.values():
            listed.extend(behind)
    return TieredSource(
        url=store_url,
        storage=run.storage,
        allow_pickle=run.allow_pickle,
        crc=crc,
        holders=tuple(order),
        tiered=TieredStore(store_url, holders, default=behind),
    )


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

    def read(self, store) -> bytes:
        problems = []
        for holder in self.holders:
            try:
                raw = run_coroutine(holder.store.get(MANIFEST_KEY, max_bytes=1 << 30))
            except (StorageError, OSError) as exc:
                problems.append(f"{holder.name}: {exc}")
                continue
            if crc32c(raw) == self.crc:
                return raw
            problems.append(f"{holder.name}: another manifest")
            log.warning("cloudckpt: the manifest in %s is not the chosen one", holder.name)
        raise CheckpointNotFound(f"no tier holds the manifest of {self.url}: {problems}"[:500])

    def decode(self, raw: bytes):
        return decode_manifest(raw, allow_pickle=self.allow_pickle)

    def check(self, manifest, store) -> None:
        from cloudckpt.api.load import check_object_extents

        run_coroutine(check_object_extents(self.tiered, manifest))

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


def _manifest_crc(url: str, storage) -> int | None:
    try:
        return crc32c(run_coroutine(shared_store(url, storage).get(MANIFEST_KEY)))
    except StorageError:
        return None


def _decode_gathered(raw: bytes) -> tuple[Inventory, list[int]]:
    try:
        own, stored = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - malformed bytes of any kind
        raise ProtocolError(f"malformed tier inventory report: {exc}"[:200]) from exc
    if not isinstance(stored, list) or not all(type(s) is int and s >= 0 for s in stored):
        raise ProtocolError("a tier inventory report lists steps as ints >= 0")
    return decode_inventory(own), stored
