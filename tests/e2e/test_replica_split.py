"""Large replicated tensors are written by several ranks (row ranges, planning/save/replicas.py)
and read back exactly through every reader, on real gloo worlds against SeaweedFS.

The fast test lowers the piece size (``replicas.REPLICA_PIECE_BYTES``, read at each planning
call) in the workers to 64 KiB, so that 256 KiB tensors are cut; the slow one keeps the default
(4 MiB) with 8 MiB tensors."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

import cloudckpt
from cloudckpt.export.file import export
from cloudckpt.planning.save import replicas

SMALL_PIECE = 64 << 10


@contextlib.contextmanager
def _piece_bytes(n: int | None):
    saved = replicas.REPLICA_PIECE_BYTES
    replicas.REPLICA_PIECE_BYTES = saved if n is None else n
    try:
        yield
    finally:
        replicas.REPLICA_PIECE_BYTES = saved


def _tensors(piece: int | None) -> dict[str, torch.Tensor]:
    """A transposed (non-contiguous) bfloat16 view, cut along its rows, and a (1, n) float32
    tensor, cut along its second dimension: two pieces each, so that 3 ranks write a third
    each."""
    rows = 2 * (piece or replicas.REPLICA_PIECE_BYTES) // 4096  # 4 KiB rows
    g = torch.Generator().manual_seed(19)
    return {
        "transposed": torch.randn(2048, rows, generator=g).to(torch.bfloat16).t(),
        "one_row": torch.randn(1, rows * 1024, generator=g),
        "step": torch.tensor(7),
    }


def rank_save(url: str, piece: int | None) -> int:
    state = _tensors(piece)
    assert not state["transposed"].is_contiguous()
    options = cloudckpt.SaveOptions(use_plan_cache=False)
    with _piece_bytes(piece):
        written = cloudckpt.save(state, url, options=options).rank_bytes_written
        # an async save stages the same views (a copy of each piece, not of the whole tensor)
        assert (
            cloudckpt.async_save(state, f"{url}-async", options=options).result().rank_bytes_written
            == written
        )
    return written


def rank_load(url: str, piece: int | None) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = _tensors(piece)
    plain = {k: torch.zeros_like(t) for k, t in state.items()}
    sharded = {
        k: distribute_tensor(torch.zeros_like(t), mesh, [Shard(t.dim() - 1)])
        for k, t in state.items()
        if t.dim()
    }
    cloudckpt.load(plain, url)
    cloudckpt.load(sharded, url, strict=False)
    return [f"{k} (plain)" for k, t in state.items() if not torch.equal(plain[k], t)] + [
        f"{k} (sharded)" for k, t in sharded.items() if not torch.equal(t.full_tensor(), state[k])
    ]


def _check(world3, world2, url: str, piece: int | None, tmp=None) -> None:
    written = world3.run(rank_save, url, piece)
    state = _tensors(piece)
    total = sum(t.numel() * t.element_size() for t in state.values())
    # every rank writes at least one piece (all of it went to one rank before the cut)
    assert sum(written) == total and min(written) >= (piece or replicas.REPLICA_PIECE_BYTES), (
        written
    )
    manifest = cloudckpt.read_manifest(url)
    for name in ("transposed", "one_row"):
        assert len(manifest.tensors[name].chunks) == 2, name
    for u in (url, f"{url}-async"):
        full = cloudckpt.load_full(u)
        assert all(torch.equal(full[k], t) for k, t in state.items()), u
    assert cloudckpt.verify(url).ok
    assert world2.run(rank_load, url, piece) == [[], []]
    if tmp is None:
        return
    # the exports and the conversion to DCP assemble each tensor from its pieces
    cloudckpt.export_safetensors(url, str(tmp / "hf"))
    hf = {}
    for f in sorted((tmp / "hf").glob("*.safetensors")):
        hf.update(load_file(f))
    assert hf.keys() == state.keys() and all(torch.equal(hf[k], t) for k, t in state.items())
    export(url, str(tmp / "one.safetensors"))
    one = load_file(tmp / "one.safetensors")
    assert all(torch.equal(one[k], t) for k, t in state.items())
    cloudckpt.convert(url, str(tmp / "dcp"), to="dcp")
    out = {k: torch.zeros_like(t) for k, t in state.items()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(str(tmp / "dcp")))
    assert all(torch.equal(out[k], t) for k, t in state.items())


def test_replicated_tensors_cut_and_written_by_every_rank_read_back_exactly(
    world3, world2, s3_url, s3_env, tmp_path
):
    _check(world3, world2, s3_url, SMALL_PIECE, tmp_path)


@pytest.mark.slow
def test_default_piece_size_8_mib_tensors(world3, world2, s3_url, s3_env):
    _check(world3, world2, s3_url, None)
