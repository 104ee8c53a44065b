"""The save protocol's plan shares, on real gloo worlds against SeaweedFS.

- Without a cached plan the local plans go to the coordinator alone (one gather), which plans
  and sends every rank its share (one scatter); with one, the planning phase's exchange is
  the only collective before the upload. Where the chunks landed goes to the coordinator alone
  too (one gather at the commit): no rank receives every rank's plan or chunk locations.
- A share that does not decode on one rank (garbled in transit, or one that does not fit the
  rank's pieces), a plan whose shares the coordinator cannot cut, or a rank's chunk locations
  garbled on their way to the coordinator, fails every rank with the same CheckpointError;
  nothing is committed, and the next save works.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.errors import CheckpointError, CheckpointNotFound

_OPS = (
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "barrier",
    "gather",
    "scatter",
    "all_reduce",
    "batch_isend_irecv",
    "send",
    "recv",
)


def _state(rank: int, world: int) -> dict:
    # a tensor each rank holds a row range of, a replicated one and a value: 60 tensors, so
    # that a local plan (about 1.5 KiB) is more than an exchange's first slot carries
    state = {f"layer{i}.w": torch.full((2, 3), float(rank * 100 + i)) for i in range(60)}
    state["shared"] = torch.arange(8.0)
    state["epoch"] = 3
    return state


def rank_count_save_collectives(root: str) -> dict:
    from cloudckpt.runtime.context import current

    rank, world = dist.get_rank(), dist.get_world_size()
    current().save_plans.clear()
    counts: list[Counter] = []
    originals = {op: getattr(dist, op) for op in _OPS if hasattr(dist, op)}
    for i in range(2):
        count: Counter = Counter()

        def counted(op, fn, count=count):
            def wrapper(*args, **kwargs):
                count[op] += 1
                return fn(*args, **kwargs)

            return wrapper

        try:
            for op, fn in originals.items():
                setattr(dist, op, counted(op, fn))
            result = cloudckpt.save(_state(rank, world), f"{root}/{i}")
        finally:
            for op, fn in originals.items():
                setattr(dist, op, fn)
        assert result.plan_cached == (i == 1)
        counts.append(count)
    return {"counts": [dict(c) for c in counts]}


def test_only_the_coordinator_receives_the_local_plans(world2, s3_url, s3_env):
    got = world2.run(rank_count_save_collectives, s3_url)
    for rank in range(2):
        first, second = got[rank]["counts"]
        # planning, global planning, share check, upload, commit: one all-gather each (the
        # upload's carries no chunk locations); gathers: the local plans and where the chunks
        # landed, to the coordinator alone; one scatter of the shares
        assert first == {"all_gather": 5, "gather": 2, "scatter": 1}, first
        # the cached save: planning, upload, commit; the chunk locations' gather
        assert second == {"all_gather": 3, "gather": 1}, second
    for i in range(2):
        full = cloudckpt.load_full(f"{s3_url}/{i}")
        assert full["epoch"] == 3 and torch.equal(full["shared"], torch.arange(8.0))


def rank_save_with_a_bad_share(url: str, how: str) -> tuple[str, dict]:
    from cloudckpt.api import save_planning as save_module
    from cloudckpt.transport import ControlChannel

    rank, world = dist.get_rank(), dist.get_world_size()
    scatter, encode = ControlChannel.scatter_bytes, save_module.encode_shares

    def garbled(self, payloads, *, width):
        mine = scatter(self, payloads, width=width)
        return mine[: len(mine) // 2] if self.rank == 1 else mine

    def failing(plan, **kwargs):
        raise MemoryError("no memory for the shares")

    gather = ControlChannel.gather_bytes

    def garbled_locations(self, payload, *, width):
        # rank 1's chunk locations arrive cut short at the coordinator's commit
        if self.rank == 1 and payload[:1] == b"\x83":  # a SaveWritten map, not a local plan
            payload = payload[: len(payload) // 2]
        return gather(self, payload, width=width)

    if how == "garbled":
        ControlChannel.scatter_bytes = garbled
    elif how == "garbled locations":
        ControlChannel.gather_bytes = garbled_locations
    else:
        save_module.encode_shares = failing
    try:
        with pytest.raises(CheckpointError) as info:
            cloudckpt.save(
                _state(rank, world), url, options=cloudckpt.SaveOptions(use_plan_cache=False)
            )
    finally:
        ControlChannel.scatter_bytes, save_module.encode_shares = scatter, encode
        ControlChannel.gather_bytes = gather
    # the next save of the same layout works (nothing cached, nothing left behind)
    cloudckpt.save(_state(rank, world), f"{url}-next")
    failures = {r: f.error_type for r, f in info.value.failures.items()}
    return f"{type(info.value).__name__}: {info.value}", failures


@pytest.mark.parametrize("how", ["garbled", "cannot cut", "garbled locations"])
def test_a_share_that_cannot_be_decoded_or_cut_fails_every_rank_the_same(
    world2, s3_url, s3_env, how
):
    url = f"{s3_url}/{how.replace(' ', '-')}"
    got = world2.run(rank_save_with_a_bad_share, url, how)
    assert got[0] == got[1], got  # the same error, the same failures, on every rank
    message, failures = got[0]
    if how == "garbled":
        assert "saving failed on rank 1" in message and failures == {1: "ProtocolError"}, got
    elif how == "garbled locations":
        # the coordinator finds it while committing: nothing is written
        assert "writing the manifest) failed on rank 0" in message, got
        assert failures == {0: "ProtocolError"}, got
    else:
        assert "saving failed on rank 0" in message and failures == {0: "MemoryError"}, got
    with pytest.raises(CheckpointNotFound):
        cloudckpt.read_manifest(url)
    assert cloudckpt.load_full(f"{url}-next")["epoch"] == 3
