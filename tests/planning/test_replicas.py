"""Replicated boxes cut into row ranges written by different holders (planning/save/replicas.py),
with N simulated ranks in one process."""

from __future__ import annotations

import math
import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.checksum import block_crcs, content_hash
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save.assemble import WrittenChunks, assemble_manifest
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.incremental import match_base
from cloudckpt.planning.save.local_plan import LocalSavePlan
from cloudckpt.planning.save.replicas import REPLICA_PIECE_BYTES
from tests.planning.layouts import DTYPES, layout_boxes

MiB = 1 << 20
# CLOUDCKPT_EXAMPLES=3000 for a long run
SETTINGS = settings(
    max_examples=int(os.environ.get("CLOUDCKPT_EXAMPLES", 40)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def plans_of(per_rank):
    world = len(per_rank)
    return [
        LocalSavePlan(rank=r, world_size=world, pieces=tuple(p), value_names=())
        for r, p in enumerate(per_rank)
    ]


def whole(name, shape, dtype="float32"):
    return PieceSpec(name, dtype, shape, (0,) * len(shape), shape)


def loads(skeleton, world):
    out = np.zeros(world, dtype=np.int64)
    np.add.at(out, skeleton.writer, skeleton.nbytes)
    return out


def ddp_state():
    """The cluster benchmark's shape of state: 4 large tensors hold ~85% of 62 MiB."""
    big = [whole(f"big{i}", (3328, 1024)) for i in range(4)]  # 13 MiB each
    small = [whole(f"small{i}", (96, 256)) for i in range(97)]  # 96 KiB each
    return big + small + [whole("step", (), "int64")]


def test_ddp_state_every_rank_writes_its_share():
    state = ddp_state()
    total = sum(p.nbytes for p in state)
    for world in (2, 4, 8):
        plans = [plan_global_save(plans_of([state] * world), rank=r) for r in range(world)]
        sk = plans[0].skeleton
        assert {p.skeleton.digest() for p in plans} == {sk.digest()}
        per_rank = loads(sk, world)
        assert per_rank.sum() == total
        # within one piece of S/N: every node sends ~S/N (was 14 MiB on 4 nodes, 2 on 4 at N=8)
        assert per_rank.max() <= total / world + REPLICA_PIECE_BYTES, (world, per_rank / MiB)
        assert per_rank.min() >= total / world - REPLICA_PIECE_BYTES, (world, per_rank / MiB)
        assert sum(w.nbytes for p in plans for w in p.writes) == total
        for i in range(4):
            off, size, writer = sk.chunks_of(f"big{i}")
            assert (size[:, 1] == 1024).all() and size[:, 0].sum() == 3328
            assert (np.diff(off[:, 0]) > 0).all() and len(set(writer.tolist())) == len(writer)
            assert (size[:, 0] * 1024 * 4 >= REPLICA_PIECE_BYTES).all()
            assert len(off) >= 2 or world < 8  # cut only where the share asks for it
        for name in ("small0", "step"):
            assert len(sk.chunks_of(name)[0]) == 1


def test_write_items_say_where_the_rows_are_in_the_local_piece():
    state = [whole("w", (4096, 1024)), whole("s", (), "int64")]
    plans = [plan_global_save(plans_of([state] * 2), rank=r) for r in range(2)]
    items = {(w.name, w.offsets): w for p in plans for w in p.writes}
    w0, w1 = items[("w", (0, 0))], items[("w", (2048, 0))]
    assert (w0.within, w0.sizes, w0.nbytes, w0.piece_index) == ((0, 0), (2048, 1024), 8 * MiB, 0)
    assert (w1.within, w1.sizes, w1.nbytes, w1.piece_index) == ((2048, 0), (2048, 1024), 8 * MiB, 0)
    assert {int(plans[0].skeleton.writer[w.chunk_id]) for w in (w0, w1)} == {0, 1}
    assert items[("s", ())].within == ()
    # a leading dimension of 1 is skipped: a (1, n) tensor is cut along its columns
    plans = [
        plan_global_save(plans_of([[whole("one", (1, 4 * MiB))]] * 2), rank=r) for r in range(2)
    ]
    assert sorted((w.offsets, w.within) for p in plans for w in p.writes) == [
        ((0, 0), (0, 0)),
        ((0, 2 * MiB), (0, 2 * MiB)),
    ]


def test_small_unsplittable_and_lowest_rank_boxes_stay_whole():
    state = [
        whole("scalar", (), "float64"),
        whole("single", (1, 1, 1)),
        whole("under", (2 * REPLICA_PIECE_BYTES // 4 - 1,)),  # one element short of 2 pieces
        whole("big", (8 * MiB,), "float32"),
    ]
    sk = plan_global_save(plans_of([state] * 4), rank=0).skeleton
    for name in ("scalar", "single", "under"):
        assert len(sk.chunks_of(name)[0]) == 1, name
    assert len(sk.chunks_of("big")[0]) >= 2
    # 3 rows of 4 MiB on 4 ranks (3 MiB each): one row per piece, never less
    fat = plan_global_save(
        plans_of([[whole("fat_rows", (1, 3, 1, 4 * MiB), "uint8")]] * 4), rank=0
    ).skeleton
    off, size, writer = fat.chunks_of("fat_rows")
    assert size.tolist() == [[1, 1, 1, 4 * MiB]] * 3 and off[:, 1].tolist() == [0, 1, 2]
    assert len(set(writer.tolist())) == 3
    # a box that fits in the least loaded holder's room stays whole
    fits = plan_global_save(
        plans_of([state[:3] + [whole("big", (MiB,), "float64")]] * 2), rank=0
    ).skeleton
    assert len(fits.chunks_of("big")[0]) == 1
    lowest = plan_global_save(plans_of([state] * 4), rank=0, replicas_to_lowest_rank=True).skeleton
    assert lowest.num_chunks == len(state) and (lowest.writer == 0).all()
    off_cut = plan_global_save(plans_of([state] * 4), rank=0, replica_piece_bytes=0).skeleton
    assert off_cut.num_chunks == len(state)


def test_same_layout_same_cut_other_world_matches_only_equal_boxes():
    """Incremental saves match chunks by box: the same layout gives the same cut (every chunk
    matches its base), another world size other boxes (those are written in full)."""
    state = [whole("w", (64, 8)), whole("v", (40,), "int64"), whole("s", (), "int64")]
    eight = [
        plan_global_save(plans_of([state] * 8), rank=r, replica_piece_bytes=64) for r in (1, 5)
    ]
    assert eight[0].skeleton.digest() == eight[1].skeleton.digest()
    sk8 = eight[0].skeleton
    assert len(sk8.chunks_of("w")[0]) > 1
    data = [bytes(int(n)) for n in sk8.nbytes]
    written = WrittenChunks(
        rank=0,
        object_keys=("data/00000000000000aa/r00000-0000.bin",),
        chunk_ids=list(range(sk8.num_chunks)),
        object_index=[0] * sk8.num_chunks,
        byte_offset=np.cumsum([0] + [len(d) for d in data[:-1]]).tolist(),
        byte_length=[len(d) for d in data],
        crcs=[c for d in data for c in block_crcs(d, 16)],
        hashes=b"".join(content_hash(d) for d in data),
    )
    base = assemble_manifest(
        sk8,
        [written],
        world_size=8,
        checksum_block_size=16,
        hashed=True,
        attempt="00000000000000aa",
    )
    again = plan_global_save(plans_of([state] * 8), rank=0, replica_piece_bytes=64).skeleton
    assert (match_base(again, base, checksum_block_size=16) >= 0).all()
    sk3 = plan_global_save(plans_of([state] * 3), rank=0, replica_piece_bytes=64).skeleton
    match = match_base(sk3, base, checksum_block_size=16)
    boxes8 = {
        (sk8.names[int(t)], o.tobytes(), z.tobytes())
        for t, o, z in zip(sk8.chunk_tensor(), sk8.offsets, sk8.sizes)
    }
    for c, (t, o, z) in enumerate(zip(sk3.chunk_tensor(), sk3.offsets, sk3.sizes)):
        assert (match[c] >= 0) == ((sk3.names[int(t)], o.tobytes(), z.tobytes()) in boxes8)
    assert (match < 0).any() and match[sk3.chunk_start[sk3.tensor_index("s")]] >= 0


def test_hsdp_replica_groups_share_each_shard():
    # 2 shards x 4 replicas: ranks 0,2,4,6 hold rows 0:2048, ranks 1,3,5,7 rows 2048:4096
    shape = (4096, 2048)
    per_rank = [
        [PieceSpec("w", "float32", shape, (2048 * (r % 2), 0), (2048, 2048))] for r in range(8)
    ]
    sk = plan_global_save(plans_of(per_rank), rank=0).skeleton
    per = loads(sk, 8)
    assert per.sum() == 32 * MiB and per.max() <= 4 * MiB + REPLICA_PIECE_BYTES
    off, size, writer = sk.chunks_of("w")
    assert all((o[0] < 2048) == (w % 2 == 0) for o, w in zip(off.tolist(), writer.tolist()))


# -- generated layouts --------------------------------------------------------------------------


@st.composite
def specs(draw):
    out = []
    for i in range(draw(st.integers(1, 6))):
        nd = draw(st.integers(0, 3))
        dims = [draw(st.integers(0, 40))] + [draw(st.integers(0, 6)) for _ in range(nd - 1)]
        out.append((f"t{i}", draw(st.sampled_from(DTYPES)), tuple(dims[:nd])))
    return out


@SETTINGS
@given(
    tensors=specs(),
    world=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    piece=st.sampled_from([1, 8, 64, 256, 1024]),
    data=st.data(),
)
def test_generated_layouts_write_every_byte_once_balanced(tensors, world, seed, piece, data):
    rng = np.random.default_rng(seed)
    kinds = [
        data.draw(st.sampled_from(("replicated", "replicated", "shard", "mesh2d", "ragged")))
        for _ in tensors
    ]
    per_rank = [[] for _ in range(world)]
    for (name, dtype, shape), kind in zip(tensors, kinds):
        for r, boxes in enumerate(layout_boxes(kind, shape, world, rng)):
            per_rank[r] += [PieceSpec(name, dtype, shape, o, s) for o, s in boxes]
    plans = [
        plan_global_save(plans_of(per_rank), rank=r, replica_piece_bytes=piece)
        for r in range(world)
    ]
    sk = plans[0].skeleton
    assert len({p.skeleton.digest() for p in plans}) == 1
    again = plan_global_save(plans_of(per_rank), rank=0, replica_piece_bytes=piece).skeleton
    assert again.digest() == sk.digest()

    held = {}  # box -> holders
    for r, pieces in enumerate(per_rank):
        for p in pieces:
            if math.prod(p.sizes):
                held.setdefault((p.name, p.offsets, p.sizes), set()).add(r)
    writes = {w.chunk_id: (r, w) for r, p in enumerate(plans) for w in p.writes}
    rep_chunks = [0]  # bytes of every chunk cut from, or equal to, a replicated box
    cut_writers: dict = {}
    assert sorted(writes) == list(range(sk.num_chunks))
    for name, dtype, shape in tensors:
        off, size, writer = sk.chunks_of(name)
        count = np.zeros(shape, dtype=np.int64)
        for o, s in zip(off.tolist(), size.tolist()):
            count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
        assert (count == 1).all(), name  # every element written exactly once
        start = int(sk.chunk_start[sk.tensor_index(name)])
        for k, (o, s, w) in enumerate(zip(off.tolist(), size.tolist(), writer.tolist())):
            r, item = writes[start + k]
            assert r == w and item.offsets == tuple(o) and item.sizes == tuple(s)
            src = per_rank[r][item.piece_index]  # the writer's own piece holds the chunk
            assert src.name == name and all(
                po + i == co and i + n <= ps
                for po, i, co, n, ps in zip(src.offsets, item.within, o, s, src.sizes)
            )
            parent = (name, src.offsets, src.sizes)
            if len(held[parent]) > 1:
                rep_chunks.append(item.nbytes)
            if (name, tuple(o), tuple(s)) not in held:  # a cut piece of a replicated box
                assert len(held[parent]) > 1
                assert r not in cut_writers.setdefault(parent, set())  # one piece per holder
                cut_writers[parent].add(r)
                assert (
                    item.nbytes >= piece
                    and math.prod(src.sizes) * DTYPE_ITEMSIZE[dtype] >= 2 * piece
                )
                assert sum(d != ps for d, ps in zip(s, src.sizes)) == 1  # cut along one dimension

    # all-holders layouts: every rank within one chunk of its water level
    replicated = [b for b, h in held.items() if len(h) > 1]
    if world > 1 and replicated and all(len(held[b]) == world for b in replicated):
        nb = {
            b: math.prod(b[2]) * DTYPE_ITEMSIZE[dict((n, d) for n, d, _ in tensors)[b[0]]]
            for b in held
        }
        fixed = np.zeros(world)
        for b, h in held.items():
            if len(h) == 1:
                fixed[next(iter(h))] += nb[b]
        total = sum(nb[b] for b in replicated)
        lo, hi = 0.0, fixed.max() + total
        for _ in range(200):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if np.maximum(mid - fixed, 0).sum() < total else (lo, mid)
        target = np.maximum(fixed, hi)
        assert (loads(sk, world) <= target + max(rep_chunks) + 1).all(), (loads(sk, world), target)
