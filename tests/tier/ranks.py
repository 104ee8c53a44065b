"""Functions the tier tests run on every rank (importable as tests.tier.ranks.*)."""

from __future__ import annotations

import os


def node_of(ranks_per_node: int) -> int:
    import torch.distributed as dist

    return dist.get_rank() // ranks_per_node


def make_state(seed: int, blank: bool = False, group=None) -> dict:
    """This rank's share of a global state that does not depend on the world size (a sharded
    tensor of 240 rows, a replicated one, a value): reshards to any world dividing 240."""
    import torch
    import torch.distributed as dist

    from cloudckpt import GlobalPiece

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    g = torch.Generator().manual_seed(seed)
    full = torch.rand(240, 32, generator=g)
    rows = 240 // world
    part = full.chunk(world)[rank].clone()
    replicated = torch.rand(300, generator=g)
    piece = GlobalPiece(
        torch.zeros_like(part) if blank else part,
        global_shape=tuple(full.shape),
        offsets=(rank * rows, 0),
    )
    return {
        "w": piece,
        "rep": torch.zeros_like(replicated) if blank else replicated,
        "meta": {"seed": 0 if blank else seed},
    }


def _equal(a: dict, b: dict) -> bool:
    import torch

    return (
        torch.equal(a["w"].local, b["w"].local)
        and torch.equal(a["rep"], b["rep"])
        and a["meta"] == b["meta"]
    )


def tier_of(root: str, ranks_per_node: int, **kw):
    from cloudckpt.runs.tier.options import LocalTier

    return LocalTier(path=os.path.join(root, f"node{node_of(ranks_per_node)}"), **kw)


def save_steps(url: str, root: str, ranks_per_node: int, steps: list[int], tier_kw: dict) -> list:
    from cloudckpt import CheckpointManager

    mgr = CheckpointManager(url, local=tier_of(root, ranks_per_node, **tier_kw))
    for step in steps:
        mgr.save(step, make_state(step))
    mgr.close()
    return [(i.step, i.complete, i.tiers) for i in mgr.list()]


def load_latest(url: str, root: str, ranks_per_node: int, tier_kw: dict, step=None) -> dict:
    from cloudckpt import CheckpointManager
    from cloudckpt.storage.peer.tiered import COUNTERS

    before = (COUNTERS.failures, COUNTERS.healed, dict(COUNTERS.reads))
    mgr = CheckpointManager(url, local=tier_of(root, ranks_per_node, **tier_kw))
    state = make_state(0, blank=True)
    loaded = mgr.load(state, step=step)
    reads = {k: v - before[2].get(k, 0) for k, v in COUNTERS.reads.items()}
    return {
        "step": loaded,
        "equal": loaded is not None and _equal(state, make_state(loaded)),
        "failures": COUNTERS.failures - before[0],
        "healed": COUNTERS.healed - before[1],
        "reads": {k: v for k, v in reads.items() if v},
    }


def load_in_world(url: str, root: str, ranks_per_node: int, tier_kw: dict) -> dict:
    """``load_latest`` in whatever world this is (a smaller one than the save's: resharding)."""
    return load_latest(url, root, ranks_per_node, tier_kw)


def train(url: str, root: str, ranks_per_node: int, steps: list[int], tier_kw: dict, pause: float):
    """Save ``steps`` one after the other, ``pause`` seconds apart (a run to kill part-way)."""
    import time

    from cloudckpt import CheckpointManager

    mgr = CheckpointManager(url, local=tier_of(root, ranks_per_node, **tier_kw))
    for step in steps:
        mgr.save(step, make_state(step))
        time.sleep(pause)
    mgr.close()
    return steps[-1]


def load_in_group(url: str, root: str, ranks_per_node: int, tier_kw: dict, members: list) -> dict:
    """Load the newest step in the subgroup ``members`` (a smaller world after losing nodes);
    ranks outside it return ``None``."""
    import torch.distributed as dist

    from cloudckpt import CheckpointManager
    from cloudckpt.storage.peer.tiered import COUNTERS

    group = dist.new_group(members)
    if dist.get_rank() not in members:
        return None
    before = dict(COUNTERS.reads)
    mgr = CheckpointManager(
        url, local=tier_of(root, ranks_per_node, **tier_kw), process_group=group
    )
    state = make_state(0, blank=True, group=group)
    loaded = mgr.load(state)
    reads = {k: v - before.get(k, 0) for k, v in COUNTERS.reads.items()}
    return {
        "step": loaded,
        "equal": loaded is not None and _equal(state, make_state(loaded, group=group)),
        "reads": {k: v for k, v in reads.items() if v},
    }


_DECOYS: list = []


def restart_service(root: str, ranks_per_node: int, node: int, decoy_root: str):
    """On the ranks of ``node``: stop this process's service of the node's tier (the next
    exchange starts a new one: another port, another token, as a replaced node would have) and
    put a decoy on the old port, with the old token, over an empty directory: a reader that
    used the old address would find nothing there. Returns the old URL (``None`` elsewhere)."""
    from cloudckpt.runs.tier import peers
    from cloudckpt.runtime.loop import run_coroutine
    from cloudckpt.storage.peer.server import PeerServer

    if node_of(ranks_per_node) != node:
        return None
    path = os.path.abspath(os.path.join(root, f"node{node}"))
    _, server = peers._SERVERS.pop(path)
    run_coroutine(server.close())
    os.makedirs(decoy_root, exist_ok=True)
    decoy = PeerServer(decoy_root, token=server.token.decode(), host=server.host, port=server.port)
    try:
        _DECOYS.append(run_coroutine(decoy.start()))
    except OSError:
        pass  # the old port was taken again at once: nothing listens as the old service then
    return server.url


def stop_decoys() -> None:
    from cloudckpt.runtime.loop import run_coroutine

    while _DECOYS:
        run_coroutine(_DECOYS.pop().close())


def known_services(url: str, root: str, ranks_per_node: int, tier_kw: dict):
    """The URL of every node's service in the map this process knows (``None``: none known)."""
    from cloudckpt import CheckpointManager

    mgr = CheckpointManager(url, local=tier_of(root, ranks_per_node, **tier_kw))
    nodes = mgr.tier.known_nodes()
    return None if nodes is None else [nodes.service(n).url for n in range(nodes.count)]


def load_with_a_foreign_rank(
    url: str, root: str, ranks_per_node: int, tier_kw: dict, foreign: int
) -> dict:
    """``load_latest`` where rank ``foreign`` takes its node's tier for another job's (its
    tier is unusable: the marker says so)."""
    import torch.distributed as dist

    if dist.get_rank() == foreign:
        tier_kw = {**tier_kw, "job": "another job"}
    return load_latest(url, root, ranks_per_node, tier_kw)


def save_to_store_only(url: str, steps: list[int]) -> None:
    """Save ``steps`` with a manager without a tier (the object store alone)."""
    from cloudckpt import CheckpointManager

    mgr = CheckpointManager(url)
    for step in steps:
        mgr.save(step, make_state(step))
    mgr.close()


def load_with_a_lying_rank(url: str, root: str, ranks_per_node: int, tier_kw: dict, liar: int):
    """A tiered load where rank ``liar`` sends malformed inventory bytes: what each rank
    raised (type, message)."""
    import torch.distributed as dist

    from cloudckpt.runs.tier import reading

    honest = reading.encode_inventory
    if dist.get_rank() == liar:
        reading.encode_inventory = lambda inventory: b"\xc1 not msgpack"  # type: ignore[assignment]
    try:
        load_latest(url, root, ranks_per_node, tier_kw)
    except Exception as exc:  # noqa: BLE001 - the outcome is the result
        return type(exc).__name__, str(exc)
    finally:
        reading.encode_inventory = honest
    return None
