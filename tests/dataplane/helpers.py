"""Shared by the data plane tests: tensors written with the real writer into a LocalStore,
and the manifest that describes them (world 1, in process, no collective)."""

from __future__ import annotations

import torch

from cloudckpt import layout
from cloudckpt.dataplane.writer import WriterOptions, write_chunks
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.runtime.loop import run_coroutine
from cloudckpt.storage import open_store

ATTEMPT = "0123456789abcdef"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def store_at(path):
    return open_store(str(path))


def write_tensors(
    store, tensors: dict[str, torch.Tensor], *, rows: int, block: int, object_size: int = 1 << 20
):
    """Write each tensor as chunks of ``rows`` rows (dim 0) through the writer; return the
    manifest describing them and the writer's locations."""
    items, boxes = [], []
    for name, t in tensors.items():
        starts = range(0, t.shape[0], rows) if t.dim() and t.shape[0] else [0]
        for r0 in starts:
            n = min(rows, t.shape[0] - r0) if t.dim() else 0
            piece = t[r0 : r0 + n] if t.dim() else t
            offsets = (r0,) + (0,) * (t.dim() - 1) if t.dim() else ()
            sizes = tuple(piece.shape)
            boxes.append((name, offsets, sizes))
            items.append((len(items), piece))
    opts = WriterOptions(object_size=object_size, checksum_block_size=block)
    locations, stats = run_coroutine(
        write_chunks(store, items, rank=0, attempt=ATTEMPT, options=opts)
    )
    b = ManifestBuilder(world_size=1, checksum_block_size=block, created_at=0.0)
    for name, t in tensors.items():
        b.add_tensor(name, dtype_name(t.dtype), tuple(t.shape))
    for (name, offsets, sizes), loc in zip(boxes, locations):
        b.add_chunk(
            name, offsets, sizes, loc.object_key, loc.byte_offset, loc.byte_length, loc.crcs
        )
    return b.build(), locations, stats, items


def piece(name: str, t: torch.Tensor, offsets, sizes, dtype=None) -> PieceSpec:
    return PieceSpec(
        name=name,
        dtype=dtype_name(dtype or t.dtype),
        global_shape=tuple(t.shape),
        offsets=tuple(offsets),
        sizes=tuple(sizes),
    )


def plan(manifest, requests):
    return plan_local_load(manifest, requests, rank=0)


def box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for dim, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(dim, o, n)
    return t


def data_path(root, key: str):
    assert layout.data_key_attempt(key) == ATTEMPT
    return root / key
