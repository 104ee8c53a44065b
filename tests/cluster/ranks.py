"""Functions the cluster tests run on every rank (importable as tests.cluster.ranks.*)."""

from __future__ import annotations

import os
import time

MiB = 1 << 20


def whereami() -> dict:
    """This rank's node, network namespace and view of the world (an all-reduce over gloo)."""
    import torch
    import torch.distributed as dist

    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "node": int(os.environ["CLOUDCKPT_CLUSTER_NODE"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "netns": os.readlink("/proc/self/ns/net"),
        "sum": float(total),
        "gloo_if": os.environ["GLOO_SOCKET_IFNAME"],
        "endpoint": os.environ["AWS_ENDPOINT_URL"],
    }


def make_state(seed: int, rows_per_rank: int, blank: bool = False) -> dict:
    """An FSDP-like state of this rank: DTensor shards (Shard(0)) in several dtypes, a
    replicated tensor, a per-rank tensor and non-tensor values; `blank`: zeros of the same
    layout (the destination of a load)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(seed)
    full = {
        "w.f32": torch.rand(rows_per_rank * world, 256, generator=g),
        "w.bf16": torch.rand(rows_per_rank * world, 128, generator=g).to(torch.bfloat16),
        "w.i64": torch.randint(-(1 << 40), 1 << 40, (world * 7, 3), generator=g),
    }
    state: dict = {}
    for name, t in full.items():
        part = t.chunk(world)[rank].clone()
        state[name] = DTensor.from_local(
            torch.zeros_like(part) if blank else part, mesh, [Shard(0)], run_check=False
        )
    replicated = torch.rand(1000, generator=g)
    own = torch.full((5,), float(rank + seed))
    state["replicated"] = torch.zeros_like(replicated) if blank else replicated
    state[f"rank{rank}.own"] = torch.zeros_like(own) if blank else own
    state["meta"] = {"step": 0 if blank else seed, "note": "" if blank else f"seed {seed}"}
    return state


def _equal(a: dict, b: dict) -> bool:
    import torch
    from torch.distributed.tensor import DTensor

    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, DTensor):
            x, y = x.to_local(), y.to_local()
        if isinstance(x, torch.Tensor):
            if x.dtype != y.dtype or not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


def save_state(url: str, seed: int, rows_per_rank: int) -> int:
    import cloudckpt

    return cloudckpt.save(make_state(seed, rows_per_rank), url).bytes_written


def load_and_compare(url: str, seed: int, rows_per_rank: int) -> dict:
    """Load into a blank state; whether it equals the saved one bit for bit."""
    import cloudckpt

    dest = make_state(seed, rows_per_rank, blank=True)
    result = cloudckpt.load(dest, url)
    return {
        "equal": _equal(dest, make_state(seed, rows_per_rank)),
        "fetched": result.bytes_fetched,
        "received": result.bytes_received,
    }


def save_expecting_failure(
    url: str, seed: int, rows_per_rank: int, retry: dict, timeout: float
) -> dict:
    """A save with the given retry limits (RetryOptions fields) and collective timeout that is
    expected to fail: the exception's type and text, and the seconds it took."""
    import cloudckpt
    from cloudckpt.storage import RetryOptions, StorageOptions

    storage = StorageOptions(retry=RetryOptions(**retry))
    state = make_state(seed, rows_per_rank)
    start = time.monotonic()
    try:
        cloudckpt.save(state, url, storage=storage, options=cloudckpt.SaveOptions(timeout=timeout))
    except Exception as exc:  # the point: every rank gets one
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "seconds": time.monotonic() - start,
            "failed_ranks": sorted(getattr(exc, "failures", {}) or {}),
        }
    return {"raised": None, "seconds": time.monotonic() - start}


def try_load(url: str, seed: int, rows_per_rank: int) -> str | None:
    """Load `url`; the exception's type name, or None when it loaded."""
    import cloudckpt

    try:
        cloudckpt.load(make_state(seed, rows_per_rank, blank=True), url)
    except Exception as exc:
        return type(exc).__name__
    return None
