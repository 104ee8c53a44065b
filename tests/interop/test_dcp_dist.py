"""cloudckpt.dcp on real gloo worlds against SeaweedFS: ``dcp.save`` on 2 ranks with DTensors
(uneven shards), replicated tensors and values, loaded by 3 ranks with another sharding
(resharding: boxes of stored chunks, some read through buffers); ``dcp.async_save`` with the
state mutated while the upload runs."""

from __future__ import annotations

import torch
import torch.distributed as dist

SHAPES = {"emb": (37, 16), "proj": (20, 33), "norm": (33,)}


def _full(name: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + sorted(SHAPES).index(name))
    t = torch.randn(SHAPES[name], generator=g)
    return t.to(torch.bfloat16) if name == "proj" else t


def _sharded_state(seed: int, dim_of: dict, *, blank: bool = False) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name in SHAPES:
        full = _full(name, seed)
        if blank:
            full = torch.zeros_like(full)
        dim = dim_of.get(name)
        out[name] = distribute_tensor(full, mesh, [Shard(dim) if dim is not None else Replicate()])
    out["optim"] = {
        "step": torch.tensor(5 if not blank else 0),
        "param_groups": [
            {"lr": 0.0 if blank else 3e-4, "betas": (0.0, 0.0) if blank else (0.9, 0.95)}
        ],
    }
    out["plain"] = torch.zeros(4) if blank else torch.arange(4.0) + seed
    return out


def _check(state: dict, seed: int) -> list[str]:
    bad = [name for name in SHAPES if not torch.equal(state[name].full_tensor(), _full(name, seed))]
    if int(state["optim"]["step"]) != 5 or state["optim"]["param_groups"] != [
        {"lr": 3e-4, "betas": (0.9, 0.95)}
    ]:
        bad.append("optim")
    if not torch.equal(state["plain"], torch.arange(4.0) + seed):
        bad.append("plain")
    return bad


def rank_save(url: str, seed: int) -> None:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import DCPOptions, StorageWriter

    state = _sharded_state(seed, {"emb": 0, "proj": 0})
    dcp.save(
        state,
        storage_writer=StorageWriter(
            url, options=DCPOptions(object_size=1024, checksum_block_size=512)
        ),
    )


def rank_load_resharded(url: str, seed: int) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import DCPOptions, StorageReader

    # another world size and another sharding: emb by rows over 3 ranks (boxes of the stored
    # row shards), proj by columns (strided boxes: through buffers), norm sharded now
    state = _sharded_state(seed, {"emb": 0, "proj": 1, "norm": 0}, blank=True)
    dcp.load(
        state,
        storage_reader=StorageReader(
            url, options=DCPOptions(read_batch_bytes=700, max_read_bytes=2048)
        ),
    )
    return _check(state, seed)


def test_save_on_two_ranks_load_resharded_on_three(world2, world3, s3_url):
    world2.run(rank_save, s3_url, 1)
    results = world3.run(rank_load_resharded, s3_url, 1)
    assert results == [[], [], []]


def rank_async_save_then_mutate(url: str, seed: int) -> list[str]:
    import torch.distributed.checkpoint as dcp

    from cloudckpt.dcp import StorageReader, StorageWriter

    state = _sharded_state(seed, {"emb": 0, "norm": 0})
    future = dcp.async_save(state, storage_writer=StorageWriter(url))
    for name in SHAPES:  # training goes on at once
        state[name].to_local().mul_(-2)
    state["plain"].add_(100)
    future.result(timeout=120)
    out = _sharded_state(seed, {"emb": 0, "norm": 0}, blank=True)
    dcp.load(out, storage_reader=StorageReader(url))
    return _check(out, seed)


def test_async_save_keeps_the_values_of_the_call(world2, s3_url):
    assert world2.run(rank_async_save_then_mutate, s3_url, 2) == [[], []]
