"""``process_group="self"``: one process saves and loads alone inside a distributed job (the
rank-0 checkpoint of a trainer), with no collective, on a real 2-rank gloo world."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.groups import group_rank, group_ranks
from cloudckpt.transport import ControlChannel


def _state(fill: float) -> dict:
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * fill,
        "b": torch.full((5,), fill, dtype=torch.bfloat16),
        "meta": {"step": 7, "name": "rank0"},
    }


def rank_save_alone_then_load(url: str) -> dict:
    """Rank 0 saves alone (rank 1 meanwhile does nothing cloudckpt sees); then every rank loads
    it alone, then both load it together (a world-1 checkpoint read by a world of 2)."""
    rank = dist.get_rank()
    out: dict = {"channel": None}
    if rank == 0:
        ch = ControlChannel("self")
        out["channel"] = (ch.size, ch.rank, ch.distributed, ch.ranks)
        result = cloudckpt.save(_state(2.0), url, process_group="self")
        out["saved"] = (result.rank_bytes_written > 0, result.objects)
        # the second save of the same layout reuses the plan, still alone
        again = cloudckpt.save(_state(3.0), url + "-again", process_group="self")
        out["again_cached"] = again.plan_cached
    dist.barrier()  # the test's own sync: rank 1 waits for the commit
    alone = _state(0.0)
    cloudckpt.load(alone, url, process_group="self")
    together = _state(0.0)
    cloudckpt.load(together, url)  # collective: both ranks
    expected = _state(2.0)
    out["alone_ok"] = all(torch.equal(alone[k], expected[k]) for k in ("w", "b"))
    out["together_ok"] = all(torch.equal(together[k], expected[k]) for k in ("w", "b"))
    out["meta"] = (alone["meta"], together["meta"])
    out["full"] = sorted(cloudckpt.load_full(url))
    out["world_size"] = cloudckpt.read_manifest(url).world_size
    out["ranks"] = (group_ranks("self"), group_rank("self"))
    return out


def test_rank0_saves_alone_and_every_rank_loads(world2, s3_url):
    results = world2.run(rank_save_alone_then_load, s3_url)
    assert results[0]["channel"] == (1, 0, False, (0,))
    assert results[0]["saved"] == (True, 1)
    assert results[0]["again_cached"] is True
    for rank, r in enumerate(results):
        assert r["alone_ok"] and r["together_ok"]
        assert r["meta"] == ({"step": 7, "name": "rank0"},) * 2
        assert r["full"] == ["b", "meta", "w"]
        assert r["world_size"] == 1
        assert r["ranks"] == ((rank,), 0)


def rank_async_and_manager_alone(url: str) -> dict:
    """Rank 1 alone: an async save and a CheckpointManager save and load, while rank 0 sleeps
    outside any collective (a rank-0 guard the other way round)."""
    rank = dist.get_rank()
    if rank == 0:
        time.sleep(0.2)
        dist.barrier()
        return {}
    handle = cloudckpt.async_save(_state(5.0), url + "/async", process_group="self")
    handle.result(timeout=60)
    manager = cloudckpt.CheckpointManager(url + "/run", process_group="self", keep_last=1)
    manager.save(1, _state(1.0))
    manager.save(2, _state(4.0))
    sd = _state(0.0)
    step = manager.load(sd)
    back = _state(0.0)
    cloudckpt.load(back, url + "/async", process_group="self")
    steps = [i.step for i in manager.list() if i.complete]
    dist.barrier()
    return {
        "step": step,
        "manager_ok": torch.equal(sd["w"], _state(4.0)["w"]),
        "async_ok": torch.equal(back["w"], _state(5.0)["w"]),
        "steps": steps,
    }


def test_async_save_and_manager_alone(world2, s3_url):
    r = world2.run(rank_async_and_manager_alone, s3_url)[1]
    assert r == {"step": 2, "manager_ok": True, "async_ok": True, "steps": [2]}


def test_self_without_a_job_and_a_bad_name(tmp_path):
    url = str(tmp_path / "ck")
    cloudckpt.save(_state(1.5), url, process_group="self")
    sd = _state(0.0)
    cloudckpt.load(sd, url, process_group="self")
    assert torch.equal(sd["w"], _state(1.5)["w"])
    with pytest.raises(ValueError, match="process_group must be"):
        cloudckpt.save(_state(1.0), str(tmp_path / "other"), process_group="world")
