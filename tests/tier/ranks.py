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
