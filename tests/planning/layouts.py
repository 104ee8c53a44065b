"""Test helpers: simulated shardings (no torch) and a simulated save/load of numpy arrays.

Box layouts mirror what torch produces: ``shard_boxes`` follows DTensor's Shard/Replicate
semantics on an N-d mesh (torch.chunk sizes: the last ranks get fewer rows or none, an empty
shard sits at offset = the current extent).
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.manifest.model import crc_counts
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save.assemble import WrittenChunks, assemble_manifest
from cloudckpt.planning.save.local_plan import LocalSavePlan

DTYPES = sorted(DTYPE_ITEMSIZE)


def shard_boxes(shape, mesh_shape, placements):
    """Per rank (row-major over the mesh): (offsets, sizes) of its DTensor shard.

    placements: per mesh dim, ``("S", dim)`` or ``("R",)``.
    """
    boxes = []
    for coord in np.ndindex(*mesh_shape):
        off = [0] * len(shape)
        size = list(shape)
        for mesh_dim, pl in enumerate(placements):
            if pl[0] != "S":
                continue
            d, n, k = pl[1], mesh_shape[mesh_dim], coord[mesh_dim]
            full = -(-size[d] // n) if size[d] else 0
            start = full * k
            if start >= size[d]:
                off[d], size[d] = off[d] + size[d], 0
            else:
                off[d], size[d] = off[d] + start, min(full, size[d] - start)
        boxes.append((tuple(off), tuple(size)))
    return boxes


def split_boxes(shape, rng: np.random.Generator, max_boxes: int = 6):
    """A random guillotine partition of ``shape`` into at most ``max_boxes`` boxes."""
    boxes = [((0,) * len(shape), tuple(shape))]
    for _ in range(rng.integers(0, max_boxes)):
        i = int(rng.integers(len(boxes)))
        off, size = boxes[i]
        dims = [d for d in range(len(shape)) if size[d] >= 2]
        if not dims:
            continue
        d = int(rng.choice(dims))
        cut = int(rng.integers(1, size[d]))
        a_size = list(size)
        a_size[d] = cut
        b_off, b_size = list(off), list(size)
        b_off[d] += cut
        b_size[d] -= cut
        boxes[i] = (off, tuple(a_size))
        boxes.append((tuple(b_off), tuple(b_size)))
    return boxes


def layout_boxes(kind: str, shape, world: int, rng: np.random.Generator):
    """Per rank, the list of boxes it holds, for one of several layout kinds."""
    nd = len(shape)
    if kind == "replicated" or nd == 0:
        return [[((0,) * nd, tuple(shape))] for _ in range(world)]
    if kind == "shard":
        per = shard_boxes(shape, (world,), [("S", int(rng.integers(nd)))])
        return [[b] for b in per]
    if kind == "mesh2d":
        divisors = [a for a in range(1, world + 1) if world % a == 0]
        a = int(rng.choice(divisors))
        placements = [
            ("S", int(rng.integers(nd))) if rng.random() < 0.7 else ("R",) for _ in range(2)
        ]
        per = shard_boxes(shape, (a, world // a), placements)
        return [[b] for b in per]
    # ragged: a random partition, each box to one or more random ranks
    holders = [[] for _ in range(world)]
    for box in split_boxes(shape, rng):
        n = 1 if rng.random() < 0.7 else int(rng.integers(1, world + 1))
        for r in rng.choice(world, size=n, replace=False).tolist():
            holders[r].append(box)
    return holders


@st.composite
def tensor_specs(draw, max_tensors: int = 3):
    """A list of (name, dtype, global shape)."""
    n = draw(st.integers(1, max_tensors))
    out = []
    for i in range(n):
        nd = draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=nd, max_size=nd)))
        out.append((f"t{i}", draw(st.sampled_from(DTYPES)), shape))
    return out


KINDS = ("replicated", "shard", "mesh2d", "ragged")


def make_layout(specs, world: int, kinds, rng):
    """Per rank, the list of PieceSpecs (tensors in ``specs`` order, one layout kind each)."""
    per_rank = [[] for _ in range(world)]
    for (name, dtype, shape), kind in zip(specs, kinds):
        for r, boxes in enumerate(layout_boxes(kind, shape, world, rng)):
            for off, size in boxes:
                per_rank[r].append(PieceSpec(name, dtype, shape, off, size))
    return per_rank


def global_data(shape, seed: int) -> np.ndarray:
    return (
        np.random.default_rng(seed).integers(0, 1 << 40, size=shape, dtype=np.int64)
        if shape
        else np.array(seed, dtype=np.int64)
    )


def slices(offsets, sizes):
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes))


def simulate_save(
    per_rank_pieces,
    data: dict,
    *,
    block: int = 64,
    values=None,
    replicas_to_lowest_rank=False,
    replica_piece_bytes=None,
):
    """Run the save protocol in one process. Returns (manifest, {chunk_id: ndarray}, global plans).

    Each chunk's bytes are taken from its writer's local piece at the write item's ``within``
    (as the real save does), and the write item must lie inside that piece."""
    from cloudckpt.planning.save.global_plan import plan_global_save
    from cloudckpt.planning.save.local_plan import decode_local_save_plan, encode_local_save_plan

    world = len(per_rank_pieces)
    local = [
        LocalSavePlan(rank=r, world_size=world, pieces=p, value_names=tuple(values or ()))
        for r, p in enumerate(per_rank_pieces)
    ]
    decoded = [decode_local_save_plan(encode_local_save_plan(p)) for p in local]
    extra = {} if replica_piece_bytes is None else {"replica_piece_bytes": replica_piece_bytes}
    plans = [
        plan_global_save(decoded, rank=r, replicas_to_lowest_rank=replicas_to_lowest_rank, **extra)
        for r in range(world)
    ]
    stored: dict[int, np.ndarray] = {}
    written = []
    for r, plan in enumerate(plans):
        ids, lens, offs, pos = [], [], [], 0
        for w in plan.writes:
            piece = per_rank_pieces[r][w.piece_index]
            assert piece.name == w.name
            assert all(
                p + i == o and i + s <= ps
                for p, i, o, s, ps in zip(piece.offsets, w.within, w.offsets, w.sizes, piece.sizes)
            ), (piece, w)
            assert w.chunk_id not in stored, "a chunk written twice"
            local = data[w.name][slices(piece.offsets, piece.sizes)]
            stored[w.chunk_id] = local[slices(w.within, w.sizes)].copy()
            ids.append(w.chunk_id)
            lens.append(w.nbytes)
            offs.append(pos)
            pos += w.nbytes
        ncrc = crc_counts(np.array(lens, dtype=np.int64), block)
        vals = {v: b"\xc0" for v, owner in plan.value_owner.items() if owner == r}
        written.append(
            WrittenChunks(
                rank=r,
                object_keys=(f"data/a/r{r}.bin",),
                chunk_ids=ids,
                object_index=[0] * len(ids),
                byte_offset=offs,
                byte_length=lens,
                crcs=np.arange(int(ncrc.sum())),
                values=vals,
            )
        )
    manifest = assemble_manifest(
        plans[0].skeleton, written, world_size=world, checksum_block_size=block, created_at=1.0
    )
    return manifest, stored, plans


def apply_reads(manifest, plan, requests, stored, chunk_ids):
    """Fill one numpy array per request from stored chunks; returns (arrays, coverage counts)."""
    out = [np.zeros(r.sizes, dtype=np.int64) for r in requests]
    count = [np.zeros(r.sizes, dtype=np.int64) for r in requests]
    for item in plan.reads:
        src = stored[chunk_ids[item.name][item.chunk_index]]
        dest = slices(item.dest_offsets, item.lengths)
        out[item.request_index][dest] = src[slices(item.src_offsets, item.lengths)]
        count[item.request_index][dest] += 1
        assert (
            item.nbytes
            == math.prod(item.lengths) * DTYPE_ITEMSIZE[manifest.tensors[item.name].dtype]
        )
    return out, count
