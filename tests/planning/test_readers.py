"""Read-once-broadcast assignment rules."""

from __future__ import annotations

import pytest

from cloudckpt.errors import PlanningError
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.planning.load.plan import Region, plan_local_load
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from cloudckpt.planning.pieces import PieceSpec
from tests.planning.test_load_plan import manifest_with

KIB = 1024
M = manifest_with(
    {
        "big": (
            "float32",
            (64 * KIB,),
            [((0,), (32 * KIB,)), ((32 * KIB,), (32 * KIB,))],
        ),  # 2 x 128 KiB
        "mid": ("float32", (16 * KIB,), [((0,), (16 * KIB,))]),  # 64 KiB
        "small": ("float32", (16,), [((0,), (16,))]),  # 64 bytes
    }
)


def whole(name, n, broadcastable=True):
    return PieceSpec(name, "float32", (n,), (0,), (n,), broadcastable)


def plans_for(*requests):
    return [plan_local_load(M, reqs, rank=r, strict=True) for r, reqs in enumerate(requests)]


def test_shared_regions_are_broadcast_heaviest_first_to_least_loaded():
    everything = [whole("big", 64 * KIB), whole("mid", 16 * KIB), whole("small", 16)]
    plans = plans_for(everything, everything, everything)
    a = assign_readers(plans)
    assert [(b.region.name, b.region.chunk_index, b.src, b.group) for b in a.broadcasts] == [
        ("big", 0, 0, (0, 1, 2)),
        ("big", 1, 1, (0, 1, 2)),
        ("mid", 0, 2, (0, 1, 2)),
    ]
    small = Region("small", 0, (0,), (16,), 64)
    for r in range(3):  # below 32 KiB: every rank reads "small" itself
        assert small in a.fetches_for(r)
    assert a.fetches_for(0) == (small, a.broadcasts[0].region)
    assert a.receives_for(2) == a.broadcasts
    assert a.broadcast_of(1).tolist() == [0, 1, 2, -1]


def test_own_reads_count_towards_the_load():
    only0 = [whole("big", 64 * KIB)]
    plans = plans_for(only0 + [whole("mid", 16 * KIB)], [whole("mid", 16 * KIB)])
    a = assign_readers(plans)
    assert [(b.region.name, b.src, b.group) for b in a.broadcasts] == [("mid", 1, (0, 1))]


def test_ties_go_to_the_lowest_rank_and_threshold_applies():
    reqs = [whole("mid", 16 * KIB)]
    a = assign_readers(plans_for(reqs, reqs, reqs, reqs))
    assert [(b.src, b.group) for b in a.broadcasts] == [(0, (0, 1, 2, 3))]
    assert assign_readers(plans_for(reqs, reqs), min_broadcast_bytes=64 * KIB + 1).broadcasts == ()
    tiny = plans_for([whole("small", 16)], [whole("small", 16)])
    assert len(assign_readers(tiny, min_broadcast_bytes=0).broadcasts) == 1


def test_non_broadcastable_pieces_read_themselves():
    reqs = [whole("mid", 16 * KIB)]
    plans = plans_for(reqs, [whole("mid", 16 * KIB, broadcastable=False)], reqs)
    a = assign_readers(plans)
    assert [(b.src, b.group) for b in a.broadcasts] == [(0, (0, 2))]
    assert a.fetches_for(1) == (Region("mid", 0, (0,), (16 * KIB,), 64 * KIB),)
    assert a.fetches_for(2) == ()


def test_different_regions_of_one_chunk_are_not_merged():
    half = PieceSpec("mid", "float32", (16 * KIB,), (0,), (8 * KIB,))
    other = PieceSpec("mid", "float32", (16 * KIB,), (8 * KIB,), (8 * KIB,))
    a = assign_readers(plans_for([half], [other], [half]))
    assert [(b.region.src_offsets, b.group) for b in a.broadcasts] == [((0,), (0, 2))]
    assert a.fetches_for(1) == (Region("mid", 0, (8 * KIB,), (8 * KIB,), 32 * KIB),)


def test_assignment_identical_from_decoded_plans_and_order_checked():
    everything = [whole("big", 64 * KIB), whole("mid", 16 * KIB)]
    plans = plans_for(everything, [whole("mid", 16 * KIB)], everything)
    wire = [encode_local_load_plan(p) for p in plans]
    a = assign_readers(plans)
    b = assign_readers([decode_local_load_plan(w) for w in wire])
    assert a.broadcasts == b.broadcasts and [a.fetches_for(r) for r in range(3)] == [
        b.fetches_for(r) for r in range(3)
    ]
    with pytest.raises(PlanningError, match=r"load_plans\[0\] is the plan of rank 2"):
        assign_readers(plans[::-1])
    assert assign_readers([]).broadcasts == ()
