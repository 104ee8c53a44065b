"""The default process group destroyed and created again in the same processes: cloudckpt's own
gloo groups (control lanes, broadcast subgroups) belong to the world they were created in and are
created anew for the next one; saves and loads work after every change, without any process
group in between too.

Fresh worlds of 1 and 3 real processes (created and closed here: the shared worlds keep their
group). With 3 ranks a tensor held by ranks 0 and 1 only is read once and broadcast over a
subgroup of two, so both kinds of cached group are exercised.
"""

from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.runtime import context
from cloudckpt.testing.ranks.world import ProcessWorld
from cloudckpt.transport import ControlChannel

PAIR = (128, 128)  # 64 KiB of float32: above the 32 KiB read-once-broadcast threshold


def _state(rank: int, stage: str) -> dict:
    seed = sum(stage.encode())
    state = {
        "w": torch.randn(96, 64, generator=torch.Generator().manual_seed(seed)),
        f"own{rank}": torch.full((50,), float(rank)),
        "stage": stage,
    }
    if rank in (0, 1):  # held by two ranks: a subgroup broadcast when the world has three
        state["pair"] = torch.randn(PAIR, generator=torch.Generator().manual_seed(seed + 1))
    return state


def _save_and_load(url: str, stage: str, how: str) -> dict:
    distributed = dist.is_initialized()
    rank = int(os.environ["RANK"])  # the harness's rank, also each new group's
    expected = _state(rank, stage)
    sd = dict(expected)
    if how == "async":
        result = cloudckpt.async_save(sd, url).result(timeout=120)
    else:
        result = cloudckpt.save(sd, url)
    blank = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else "" for k, v in sd.items()}
    loaded = cloudckpt.load(blank, url)
    same = all(
        torch.equal(blank[k], v) if isinstance(v, torch.Tensor) else blank[k] == v
        for k, v in expected.items()
    )
    held = context.current().groups.snapshot(dist.group.WORLD) if distributed else {}
    return {
        "stage": stage,
        "rank": rank,
        "same": same,
        "bytes": result.bytes_written,
        "broadcasts": loaded.broadcasts,
        "live_groups": _groups_are_live(),
        "group_kinds": sorted({key[0] for key in held}),
    }


def _groups_are_live() -> bool:
    """Every group cloudckpt holds for the current world is one torch knows (not destroyed)."""
    if not dist.is_initialized():
        return True
    channel = ControlChannel(timeout=60)
    groups = [channel.group, *context.current().groups.snapshot(dist.group.WORLD).values()]
    try:
        for g in groups:
            dist.get_process_group_ranks(g)
    except (ValueError, RuntimeError, KeyError):
        return False
    return True


def _init(store_dir: str, n: int) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.path.join(store_dir, f"pg-{n}"), world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )


def rank_reinit_cycle(url: str, store_dir: str) -> list[dict]:
    """Runs on every rank of a fresh world whose default group the harness created."""
    rank = dist.get_rank()
    results = [_save_and_load(f"{url}/harness", "harness", "sync")]
    dist.destroy_process_group()
    _init(store_dir, 1)
    results.append(_save_and_load(f"{url}/again", "again", "async"))
    results.append(_save_and_load(f"{url}/again-sync", "again-sync", "sync"))
    dist.destroy_process_group()
    results.append(_save_and_load(f"{url}/solo-r{rank}", "solo", "sync"))  # a world of one
    results.append(_save_and_load(f"{url}/solo-async-r{rank}", "solo-async", "async"))
    _init(store_dir, 2)
    results.append(_save_and_load(f"{url}/third", "third", "async"))
    results.append(_save_and_load(f"{url}/third-sync", "third-sync", "sync"))
    return results


@pytest.mark.parametrize("world_size", [1, 3])
def test_saves_and_loads_work_after_the_default_group_is_destroyed_and_created_again(
    world_size, s3_server, s3_url, tmp_path
):
    with ProcessWorld(world_size, env=s3_server.env(), timeout=240) as world:
        per_rank = world.run(rank_reinit_cycle, s3_url, str(tmp_path))
    stages = [r["stage"] for r in per_rank[0]]
    assert stages == ["harness", "again", "again-sync", "solo", "solo-async", "third", "third-sync"]
    for results in per_rank:
        for r in results:
            assert r["same"] and r["live_groups"], r
    if world_size == 3:
        for results in per_rank:
            for r in results:
                # the pair's read-once broadcast ran over the subgroup of ranks 0 and 1
                if r["stage"] not in ("solo", "solo-async"):
                    assert r["group_kinds"] == ["broadcast", "control"], r
                    if r["rank"] in (0, 1):
                        assert r["broadcasts"] >= 1, r
