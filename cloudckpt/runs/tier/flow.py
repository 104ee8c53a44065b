"""A run's saves, loads and listing with a node-local tier (``CheckpointManager(local=...)``).

Save of a tier step (collective; each ``── name ──`` is one ``ControlChannel.phase``):

1. ``── tier peers ──`` (only when no manager of this process learnt the job's nodes for this
   tier in this world yet): every rank claims its node's tier directory and starts its
   service; a tier that cannot be used anywhere makes the save go to the object store only
   (a warning).
2. ``── tier space ──``: the coordinator refuses a step complete in the object store
   (``CheckpointExists``); each node drops a stale copy of the step (a killed earlier
   incarnation's) and says whether the save fits (``max_bytes``, free disk), and every rank
   its service as it is now: a map of nodes that changed since it was learnt (a node's service
   replaced) is replaced and the phase runs once more with it. A node without room, or a tier
   that cannot be used: the save goes to the object store only, with a warning.
3. ``cloudckpt.save`` to each rank's own node directory (the same protocol, manifest last); a
   failure there (disk full...) -> the save goes to the object store, with a warning.
4. ``── tier manifest ──`` + a broadcast of the manifest bytes; every node writes it: the step
   is now complete in the tiers (each node holds its own objects) and ``save`` returns.
5. In the background (``background=True``; else before ``save`` returns), on a lane of its own,
   one step at a time (the next tier save waits for the previous step's): ``── tier replicate
   ──``: every rank sends its objects, then the manifest, to the ``replicas`` nodes after its
   own; then, every ``store_every`` steps, ``── tier drain objects ──`` / ``── tier drain
   manifest ──``: every rank uploads its own objects, checked against the manifest's crcs first,
   to the object store, then the coordinator puts the same manifest bytes there in create
   mode: the commit rule of every save. A failure is a warning (the step stays complete where
   it is).
6. Each node's first rank prunes its tier: the newest ``keep`` steps, never one whose replicas
   or copy are still due.

Load and listing: :mod:`cloudckpt.runs.tier.reading`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import shutil
from collections.abc import Callable
from dataclasses import replace

import msgpack
import torch.distributed as dist

from cloudckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    ObjectExists,
    ProtocolError,
    StorageError,
)
from cloudckpt.layout import MANIFEST_KEY, join_url, step_dir
from cloudckpt.options import SaveOptions
from cloudckpt.runs.tier.node import (
    Inventory,
    NodeTier,
    damaged_blocks,
    object_blocks,
)
from cloudckpt.runs.tier.options import LocalTier
from cloudckpt.runs.tier.peers import (
    Blob,
    Nodes,
    Peer,
    advertised_host,
    decode_peer,
    encode_peer,
    known_nodes,
    peer_client,
    remember_nodes,
)
from cloudckpt.runs.tier.peers import serve as serve_tier
from cloudckpt.runtime.context import current
from cloudckpt.runtime.loop import finish_before_exit, run_coroutine, shared_store
from cloudckpt.storage.peer.client import PeerStore
from cloudckpt.stored import decode_manifest_without_pickle
from cloudckpt.transport import ControlChannel

log = logging.getLogger(__name__)


class TierRun:
    """The tier side of one ``CheckpointManager`` (see the module docstring)."""

    def __init__(self, tier: LocalTier, manager):
        if manager.incremental:
            raise ValueError("local= (a LocalTier) does not combine with incremental=True")
        self.tier = tier
        self.manager = manager
        self.run_url = manager.url
        self.storage = manager.storage
        self.process_group = manager.process_group
        self.allow_pickle = manager.allow_pickle
        self.node = NodeTier(tier.path, tier.job or manager.url)
        self._unusable: int | None = None  # the runtime generation a node's tier was unusable in
        self._drain_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._drains: list[concurrent.futures.Future] = []
        self._pending: set[int] = set()  # steps whose replicas or copy to the store are due
        self.replicated: set[int] = set()  # steps this process saw replicated
        self.last_inventories: list[Inventory] = []  # as of the last load
        self.store_listing: concurrent.futures.Future | None = None  # a load's (coordinator)

    def channel(self, lane: str = "protocol") -> ControlChannel:
        """The control channel of the tier's phases: the save protocol's timeout (its group is
        then the protocol's own: no group of its own to create on the "protocol" lane)."""
        timeout = getattr(self.manager.save_options, "timeout", 600.0)
        return ControlChannel(self.process_group, timeout=timeout, lane=lane)

    # -- the job's nodes ------------------------------------------------------------------------

    def peer(self) -> Peer:
        """This rank's tier service (started on first use) and node key; its ``problem`` says
        why the node's tier directory cannot be used (claimed again at every exchange that
        carries it: a wiped directory is marked anew)."""
        problem = self.node.claim()
        host = advertised_host(self.tier.host)
        url, token = "http://-", "-"
        if problem is None:
            server = serve_tier(self.node.path, host)
            url, token = server.url, server.token.decode()
        return Peer(f"{host}|{self.node.path}", url, token, problem)

    def _nodes_key(self, channel: ControlChannel) -> tuple:
        return (current().generation, channel.ranks, self.node.path, self.node.job, self.tier.host)

    def known_nodes(self) -> Nodes | None:
        """The job's nodes as a manager of this process last learnt them in this world
        (``None``: not known; see :func:`~cloudckpt.runs.tier.peers.known_nodes`)."""
        return known_nodes(self._nodes_key(self.channel()), _world())

    def adopt(self, found: list[Peer]) -> Nodes | None:
        """The nodes of every rank's ``found`` service (rank order, as every rank received
        them), kept for later exchanges of this process; ``None`` (warned) when some node's
        tier cannot be used."""
        channel = self.channel()
        problems = sorted({p.problem for p in found if p.problem})
        if problems:
            if channel.is_coordinator:
                log.warning(
                    "cloudckpt: local tier not used (object store only): %s", "; ".join(problems)
                )
            self._unusable = current().generation
            return None
        nodes = Nodes.of(found)
        remember_nodes(self._nodes_key(channel), _world(), nodes)
        self._unusable = None
        return nodes

    def nodes(self) -> Nodes | None:
        """The job's nodes for a save: as known in this process, else from a ``tier peers``
        exchange (collective; the ``tier space`` exchange of each save then checks them);
        ``None`` when some node's tier cannot be used (warned)."""
        known = self.known_nodes()
        if known is not None:
            return known
        if self._unusable == current().generation:
            return None
        with self.channel().phase("tier peers", Blob) as peers:
            peers.report = Blob(encode_peer(self.peer()))
        return self.adopt([decode_peer(r.raw) for r in peers.reports])

    def step_url(self, step: int) -> str:
        return join_url(self.run_url, step_dir(step))

    # -- save -------------------------------------------------------------------------------------

    def save(self, step: int, state_dict, kwargs: dict, store_save: Callable[[], object]):
        """Save ``step`` to the tier (and the object store when due); ``store_save()`` is the
        plain save to the object store, used for steps off the tier and as the fallback."""
        from cloudckpt.api.save import save

        if step % self.tier.every:
            return store_save()
        nodes = self.nodes()
        if nodes is None:
            return store_save()
        self.wait()  # the previous step's replicas and copy: at most one step in flight
        nodes = self._space(step, nodes)
        if nodes is None:
            return store_save()
        try:
            options = replace(kwargs.get("options") or SaveOptions(), join_as=self.step_url(step))
            local = {**kwargs, "storage": None, "options": options}  # per-node URLs, one save
            result = save(state_dict, self.node.step_url(step), **local)
        except CheckpointExists:
            raise
        except CheckpointError as exc:
            log.warning(
                "cloudckpt: saving step %d to the local tier failed (%s): saving it to %s only",
                step,
                exc,
                self.run_url,
            )
            self.node.remove_step(step)
            return store_save()
        raw = self._share_manifest(step)
        try:  # this node's copy of the manifest: its objects are complete here now
            run_coroutine(self.node.store.put(step_dir(step) + MANIFEST_KEY, raw, mode="create"))
        except ObjectExists:
            pass  # another rank of this node wrote it (the same bytes: one save)
        drain = step % self.tier.store_every == 0
        self._pending.add(step)
        lane = self.channel(lane="tier")  # its group made here, in every rank's main order
        if self.tier.background:
            future = self._pool().submit(self._copies, step, raw, nodes, lane, drain)
            finish_before_exit(future, self.step_url(step))
            self._drains.append(future)
        else:
            self._copies(step, raw, nodes, lane, drain)
        self._prune(nodes)
        return result

    def _space(self, step: int, nodes: Nodes, again: bool = True) -> Nodes | None:
        """The ``tier space`` exchange: the nodes of this save (every rank's service, as
        reported now: a node that restarted its service since ``nodes`` were learnt makes the
        exchange run once more with the new map), or ``None`` (warned): the save goes to the
        object store only."""
        channel = self.channel()
        with channel.phase("tier space", Blob) as space:
            if channel.is_coordinator and _has_manifest(self.step_url(step), self.storage):
                raise CheckpointExists(f"step {step} is already saved at {self.step_url(step)}")
            first = nodes.first_rank[nodes.node_of[channel.rank]] == channel.rank
            if first and self.node.manifest_bytes(step) is not None:
                self.node.remove_step(step)  # a killed incarnation's copy: this save replaces it
            space.report = Blob(msgpack.packb([self._fits(), encode_peer(self.peer())]))
        fits, found = zip(*(_decode_space(r.raw) for r in space.reports))
        now = self.adopt(list(found))
        if now is None:
            return None
        if now != nodes:  # the copies of a stale step above were removed by the old map's ranks
            if again:
                return self._space(step, now, again=False)
            if channel.is_coordinator:
                log.warning(
                    "cloudckpt: the tier services keep changing: step %d goes to %s only",
                    step,
                    self.run_url,
                )
            return None
        short = [r for r, ok in enumerate(fits) if not ok]
        if short and channel.is_coordinator:
            log.warning(
                "cloudckpt: the local tier of ranks %s is full: step %d goes to %s only",
                short,
                step,
                self.run_url,
            )
        return None if short else nodes

    def _fits(self) -> bool:
        steps = sorted(self.node.inventory())
        estimate = self.node.step_bytes(steps[-1]) if steps else 0
        try:
            free = shutil.disk_usage(self.node.path).free
        except OSError:
            return False
        if free < estimate:
            return False
        limit = self.tier.max_bytes
        return limit is None or self.node.held_bytes() + estimate <= limit

    def _share_manifest(self, step: int) -> bytes:
        channel = self.channel()
        raw = b""
        with channel.phase("tier manifest", Blob) as reading:
            if channel.is_coordinator:
                raw = self.node.manifest_bytes(step) or b""
                if not raw:
                    raise CheckpointNotFound(f"step {step}'s manifest is not in the local tier")
                reading.report = Blob(msgpack.packb(len(raw)))
        length = msgpack.unpackb(reading.reports[0].raw)
        return channel.broadcast_bytes(raw if channel.is_coordinator else None, length=length)

    def _copies(self, step: int, raw: bytes, nodes: Nodes, lane: ControlChannel, drain: bool):
        """The replicas of ``step``, then (``drain``) its copy to the object store; failures are
        logged (the step stays where it is complete)."""
        try:
            self._replicate(step, raw, nodes, lane)
            if drain:
                self._drain(step, raw, lane)
        finally:
            self._pending.discard(step)

    def _replicate(self, step: int, raw: bytes, nodes: Nodes, channel: ControlChannel) -> None:
        try:
            with channel.phase("tier replicate"):
                own = self.node.own_keys(step, channel.rank)
                run_coroutine(self._replicate_own(step, raw, nodes, channel.rank, own))
            self.replicated.add(step)
        except CheckpointError as exc:
            if channel.is_coordinator:
                log.warning("cloudckpt: step %d has fewer replicas than asked: %s", step, exc)

    async def _replicate_own(
        self, step: int, raw: bytes, nodes: Nodes, rank: int, own: list[str]
    ) -> None:
        prefix = step_dir(step)
        targets = nodes.targets(nodes.node_of[rank], self.tier.replicas)
        if not targets:
            return
        for key in own:  # just written; every reader checks the crcs, this copy's included
            data = await self.node.store.get(prefix + key)
            for target in targets:
                await _create(self.peer_store(nodes, target, prefix), key, data)
        for target in targets:
            await _create(self.peer_store(nodes, target, prefix), MANIFEST_KEY, raw)

    def peer_store(self, nodes: Nodes, node: int, prefix: str) -> PeerStore:
        service = nodes.service(node)
        return peer_client(service.url, service.token, self.tier.timeout).child(prefix)

    def _pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._drain_pool is None:
            self._drain_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cloudckpt-tier-drain"
            )
        return self._drain_pool

    def _drain(self, step: int, raw: bytes, channel: ControlChannel) -> None:
        """Copy step ``step`` from the tiers to the object store (collective, lane "tier")."""
        store = shared_store(self.step_url(step), self.storage)
        try:
            with channel.phase("tier drain objects"):
                manifest, _ = decode_manifest_without_pickle(raw)
                blocks = object_blocks(manifest)
                for key in self.node.own_keys(step, channel.rank):
                    data = run_coroutine(self.node.store.get(step_dir(step) + key))
                    if damaged_blocks(data, blocks.get(key, [])):
                        raise StorageError(f"{key} of step {step} is damaged in the local tier")
                    run_coroutine(store.put(key, data))
            with channel.phase("tier drain manifest"):
                if channel.is_coordinator:
                    run_coroutine(store.put(MANIFEST_KEY, raw, mode="create"))
        except CheckpointError as exc:
            if channel.is_coordinator:
                log.warning("cloudckpt: copying step %d to %s failed: %s", step, self.run_url, exc)

    def wait(self) -> None:
        """Wait for the background replicas and copies (their failures were logged)."""
        drains, self._drains = self._drains, []
        concurrent.futures.wait(drains)

    def _prune(self, nodes: Nodes) -> None:
        rank = self.channel().rank
        if nodes.first_rank[nodes.node_of[rank]] == rank:
            removed = self.node.prune(self.tier.keep, set(self._pending))
            if removed:
                log.info("cloudckpt: local tier pruned steps %s", removed)

    def managed_save(self, step: int, state_dict, kwargs: dict, after):
        """``CheckpointManager.save`` with a tier: the tier save blocks (briefly); its copy to
        the object store may not. ``after(step, leftovers, result)``: the manager's clean-up
        (``None``: none)."""
        from cloudckpt.api.save import save

        url = self.step_url(step)
        result = self.save(step, state_dict, kwargs, lambda: save(state_dict, url, **kwargs))
        return result if after is None else after(step, False, result)

    # -- load and listing: cloudckpt/runs/tier/reading.py -----------------------------------------

    def load(self, state_dict, step: int | None, strict: bool) -> int | None:
        """Load ``step`` (default: the newest complete anywhere) into ``state_dict``."""
        from cloudckpt.runs.tier.reading import load_step

        self.wait()
        return load_step(self, state_dict, step, strict)

    def listing(self, listed: list) -> list:
        from cloudckpt.runs.tier.reading import listing

        return listing(self, listed)


async def _create(store: PeerStore, key: str, data: bytes) -> None:
    try:
        await store.put(key, data, mode="create")
    except ObjectExists:
        pass  # already there (a retried replication): the reader checks its crcs all the same


def _world() -> object | None:
    """The default process group object (what a known map of nodes belongs to)."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _decode_space(raw: bytes) -> tuple[bool, Peer]:
    """A ``tier space`` report (untrusted bytes): whether the save fits, the rank's service."""
    try:
        fits, peer = msgpack.unpackb(raw, raw=False)
    except Exception as exc:  # noqa: BLE001 - malformed bytes of any kind
        raise ProtocolError(f"malformed tier space report: {exc}"[:200]) from exc
    if type(fits) is not bool or not isinstance(peer, bytes):
        raise ProtocolError("a tier space report is [fits, peer]")
    return fits, decode_peer(peer)


def _has_manifest(url: str, storage) -> bool:
    try:
        run_coroutine(shared_store(url, storage).head(MANIFEST_KEY))
        return True
    except StorageError:
        return False
