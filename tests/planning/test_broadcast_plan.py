"""The broadcast plan (planning/broadcast/plan.py), N ranks simulated in one process: every rank
plans from the same (decoded) load plans; the plans agree on the one global order, every kept
part is sent once by a member of its group, and each rank's read items take exactly one path."""

from __future__ import annotations

import pytest

from cloudckpt.planning.broadcast.groups import select_broadcasts
from cloudckpt.planning.broadcast.plan import BroadcastPlan, plan_broadcasts, split_reads
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.planning.broadcast.rounds import RunBatch, WindowBatch
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from cloudckpt.planning.pieces import PieceSpec
from tests.planning.test_load_plan import manifest_with

KIB = 1024
BLOCK = 4 * KIB
TENSORS = {
    "big": ("float32", (16 * KIB,), [((0,), (16 * KIB,))]),  # 64 KiB, one chunk
    "w": ("float32", (64, 64), [((0, 0), (32, 64)), ((32, 0), (32, 64))]),  # two 8 KiB chunks
    **{f"s{i}": ("float32", (256,), [((0,), (256,))]) for i in range(6)},  # 1 KiB each
}


def _wants(rank: int, world: int) -> list[PieceSpec]:
    """Every rank the whole of "big"; "w" whole on odd ranks, its first rows on even ones (so
    its two chunks have different groups); small tensors to changing subsets."""
    out = [PieceSpec("big", "float32", (16 * KIB,), (0,), (16 * KIB,))]
    rows = 64 if rank % 2 else 32
    out.append(PieceSpec("w", "float32", (64, 64), (0, 0), (rows, 64)))
    for i in range(6):
        if (rank + i) % 3 != 0 or i % world == rank:
            out.append(PieceSpec(f"s{i}", "float32", (256,), (0,), (256,)))
    return out


def _plan_everywhere(world: int, batch_bytes: int, max_read_bytes: int, max_groups: int = 64):
    """Each simulated rank decodes every rank's encoded plan and plans its own share."""
    manifest = manifest_with(TENSORS, block=BLOCK)
    wire = [
        encode_local_load_plan(plan_local_load(manifest, _wants(r, world), rank=r))
        for r in range(world)
    ]
    out = []
    for rank in range(world):
        plans = [decode_local_load_plan(raw) for raw in wire]
        assignment = assign_readers(plans, min_broadcast_bytes=0)
        kept = select_broadcasts(assignment.broadcasts, max_groups)
        reads = split_reads(plans[rank], assignment, kept)
        plan = plan_broadcasts(
            manifest,
            assignment,
            kept,
            reads.items_by_broadcast,
            rank=rank,
            batch_bytes=batch_bytes,
            max_read_bytes=max_read_bytes,
        )
        out.append((plans, assignment, kept, reads, plan))
    return out


CASES = [
    (2, 8 * KIB, 1 << 20),
    (3, 8 * KIB, 64 * KIB),
    (4, 16 * KIB, 1 << 20),
    (5, 1 << 20, 1 << 20),  # no run batches: every region is under min(1 MiB, batch_bytes)
]


@pytest.mark.parametrize("world,batch_bytes,max_read_bytes", CASES)
def test_every_rank_plans_the_same_global_order(world, batch_bytes, max_read_bytes):
    ranks = _plan_everywhere(world, batch_bytes, max_read_bytes)
    plans: list[BroadcastPlan] = [p for *_, p in ranks]
    assert len({p.member_sets for p in plans}) == 1
    assert len({(p.buffer_bytes, p.fetch_budget) for p in plans}) == 1
    for a in plans:
        assert all(a.rank in r.members for r in a.rounds)
        for b in plans:
            # the rounds two ranks share come in the same order on both
            assert [r for r in a.rounds if b.rank in r.members] == [
                r for r in b.rounds if a.rank in r.members
            ]
    # the same inputs plan the same value
    again = _plan_everywhere(world, batch_bytes, max_read_bytes)
    assert [p for *_, p in again] == plans


@pytest.mark.parametrize("world,batch_bytes,max_read_bytes", CASES)
def test_every_kept_part_is_sent_once_by_a_member_of_its_group(world, batch_bytes, max_read_bytes):
    ranks = _plan_everywhere(world, batch_bytes, max_read_bytes)
    _, assignment, kept, _, _ = ranks[0]
    sent: dict[object, int] = {}
    for *_, plan in ranks:
        for pos, round_ in enumerate(plan.rounds):
            srcs = [b.src for b in round_.batches]
            assert srcs == sorted(set(srcs)) and set(srcs) <= set(round_.members)
            mine = [b for b in round_.batches if b.src == plan.rank]
            assert (plan.sends.get(pos),) == tuple(mine) or (not mine and pos not in plan.sends)
            for batch in mine:
                assert batch.nbytes <= plan.buffer_bytes and batch.nbytes <= plan.fetch_budget
                for part in batch.parts:
                    assert part.broadcast in kept
                    assert batch.members == assignment.broadcasts[part.broadcast].group
                    assert part not in sent
                    sent[part] = plan.rank
    assert {p.broadcast for p in sent} == set(kept)
    kinds = {type(b) for *_, p in ranks for b in p.batches}
    assert kinds == ({RunBatch, WindowBatch} if batch_bytes < 64 * KIB else {WindowBatch})


@pytest.mark.parametrize("max_groups", [0, 1, 64])
def test_each_read_item_takes_one_path(max_groups):
    for plans, assignment, kept, reads, plan in _plan_everywhere(4, 8 * KIB, 1 << 20, max_groups):
        items = plans[plan.rank].table.items()
        served = [i for b in sorted(reads.items_by_broadcast) for i in reads.items_by_broadcast[b]]
        assert sorted(map(repr, served + list(reads.own_reads))) == sorted(map(repr, items))
        assert set(reads.items_by_broadcast) <= set(kept)
        for b, its in reads.items_by_broadcast.items():
            assert all(it.region == assignment.broadcasts[b].region for it in its)
        assert plan.items_by_broadcast == reads.items_by_broadcast
        if not kept:
            assert plan.rounds == () and reads.own_reads == tuple(items)
