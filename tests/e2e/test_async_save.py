"""async_save on a real 2-rank gloo world against SeaweedFS."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.storage import StorageOptions


def _state(rank: int) -> dict:
    g = torch.Generator().manual_seed(100 + rank)
    return {
        "w": torch.randn(64, 64, generator=torch.Generator().manual_seed(0)),  # replicated
        f"r{rank}": torch.randn(300, generator=g),  # per rank
        "shared": torch.arange(100.0),
        "step": 5,
    }


def rank_async_then_mutate(url: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    sd = _state(rank)
    handle = cloudckpt.async_save(sd, url)
    for v in sd.values():  # training goes on right away and mutates every tensor
        if isinstance(v, torch.Tensor):
            v.mul_(-3).add_(1)
    sd["step"] = 6
    result = handle.result(timeout=120)
    expected = {}
    for r in range(world):
        expected.update(_state(r))
    blank = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in expected.items()
    }
    cloudckpt.load(blank, url)
    same = all(
        torch.equal(blank[k], v) if isinstance(v, torch.Tensor) else blank[k] == v
        for k, v in expected.items()
    )
    return {
        "done": handle.done(),
        "same": same,
        "bytes": result.bytes_written,
        "blocked": handle.blocked_seconds,
    }


def test_async_save_keeps_values_from_before_the_mutation(world2, s3_url):
    results = world2.run(rank_async_then_mutate, s3_url)
    assert all(r["done"] and r["same"] for r in results), results
    assert results[0]["bytes"] == 64 * 64 * 4 + 2 * 300 * 4 + 100 * 4


def rank_failing_upload_then_retry(url_bad: str, url_good: str) -> dict:
    rank = dist.get_rank()
    sd = {f"t{rank}": torch.randn(1000), "x": torch.ones(10)}
    storage = (
        StorageOptions(
            access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key="definitely-wrong"
        )
        if rank == 1
        else None
    )
    handle = cloudckpt.async_save(sd, url_bad, storage=storage)
    err = handle.exception(timeout=120)
    second = cloudckpt.async_save(sd, url_good).result(timeout=120)
    return {
        "error": " ".join(c.__name__ for c in type(err).__mro__) if err else None,
        "message": str(err),
        "second_bytes": second.bytes_written,
    }


def test_upload_failure_on_one_rank_fails_every_rank_and_next_save_works(world2, s3_url):
    results = world2.run(rank_failing_upload_then_retry, s3_url + "/bad", s3_url + "/good")
    for r in results:
        assert r["error"] and "CheckpointError" in r["error"], r
        assert "rank 1" in r["message"], r
        assert r["second_bytes"] == 2 * 1000 * 4 + 10 * 4
    assert results[0]["message"] == results[1]["message"]


def rank_two_saves_reuse_buffers(url: str) -> list[int]:
    rank = dist.get_rank()
    sd = {"w": torch.randn(256, 256), f"own{rank}": torch.randn(128)}
    counts = []
    for i in range(3):
        sd["w"].add_(1)
        cloudckpt.async_save(sd, f"{url}/step-{i}").result(timeout=120)
        counts.append(cloudckpt.api.async_save.staging_allocations())
    return counts


def test_consecutive_async_saves_reuse_staging_buffers(world2, s3_url):
    for counts in world2.run(rank_two_saves_reuse_buffers, s3_url):
        assert counts[0] > 0
        assert counts[1] == counts[0] and counts[2] == counts[0], counts
