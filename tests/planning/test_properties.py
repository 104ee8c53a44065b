"""Property tests: save with W1 simulated ranks, load with W2, on numpy arrays (no torch)."""

from __future__ import annotations

import os

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.manifest.codec import decode_manifest, encode_manifest
from cloudckpt.planning.broadcast.readers import assign_readers
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.load.plan_codec import decode_local_load_plan, encode_local_load_plan
from tests.planning.layouts import (
    KINDS,
    apply_reads,
    global_data,
    make_layout,
    simulate_save,
    tensor_specs,
)

# CLOUDCKPT_EXAMPLES=3000 for a long run
SETTINGS = settings(
    max_examples=int(os.environ.get("CLOUDCKPT_EXAMPLES", 150)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def chunk_ids_by_name(plan):
    sk = plan.skeleton
    return {
        n: list(range(int(sk.chunk_start[i]), int(sk.chunk_start[i + 1])))
        for i, n in enumerate(sk.names)
    }


@SETTINGS
@given(
    specs=tensor_specs(),
    w1=st.integers(1, 8),
    w2=st.integers(1, 8),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_save_then_load_rebuilds_every_destination(specs, w1, w2, seed, data):
    rng = np.random.default_rng(seed)
    save_kinds = [data.draw(st.sampled_from(KINDS)) for _ in specs]
    load_kinds = [data.draw(st.sampled_from(KINDS)) for _ in specs]
    lowest = data.draw(st.booleans())
    piece_bytes = data.draw(st.sampled_from([None, 1, 8, 40]))  # None: the default (no cut here)
    arrays = {name: global_data(shape, seed + i) for i, (name, _, shape) in enumerate(specs)}

    saved = make_layout(specs, w1, save_kinds, rng)
    manifest, stored, plans = simulate_save(
        saved, arrays, replicas_to_lowest_rank=lowest, replica_piece_bytes=piece_bytes
    )

    # every stored element is written exactly once, and holds the right data
    sk = plans[0].skeleton
    for name, _, shape in specs:
        i = sk.tensor_index(name)
        count = np.zeros(shape, dtype=np.int64)
        for c in range(int(sk.chunk_start[i]), int(sk.chunk_start[i + 1])):
            off, size = sk.offsets[c, : len(shape)], sk.sizes[c, : len(shape)]
            box = tuple(slice(o, o + s) for o, s in zip(off, size))
            count[box] += 1
            np.testing.assert_array_equal(stored[c], arrays[name][box])
        assert (count == 1).all()
    # every rank derived the same skeleton; writes partition the chunks
    assert len({p.skeleton.digest() for p in plans}) == 1
    written = sorted(w.chunk_id for p in plans for w in p.writes)
    assert written == list(range(sk.num_chunks))

    decoded = decode_manifest(encode_manifest(manifest))
    chunk_ids = chunk_ids_by_name(plans[0])
    requests = make_layout(specs, w2, load_kinds, rng)
    load_plans = []
    for r in range(w2):
        plan = plan_local_load(decoded, requests[r], rank=r)
        assert set(plan.unexpected) == {n for n, _, _ in specs} - {q.name for q in requests[r]}
        out, count = apply_reads(decoded, plan, requests[r], stored, chunk_ids)
        for req, arr, cnt in zip(requests[r], out, count):
            assert (cnt == 1).all(), f"{req} covered {cnt}"
            box = tuple(slice(o, o + s) for o, s in zip(req.offsets, req.sizes))
            np.testing.assert_array_equal(arr, arrays[req.name][box])
        load_plans.append(plan)

    threshold = data.draw(st.sampled_from([0, 1, 64, 32 * 1024]))
    # each simulated rank decodes every plan from bytes and assigns readers on its own
    wire = [encode_local_load_plan(p) for p in load_plans]
    per_rank = [
        assign_readers([decode_local_load_plan(b) for b in wire], min_broadcast_bytes=threshold)
        for _ in range(min(w2, 3))
    ]
    reference = assign_readers(load_plans, min_broadcast_bytes=threshold)
    for a in per_rank:
        assert a.broadcasts == reference.broadcasts
        assert [a.fetches_for(r) for r in range(w2)] == [
            reference.fetches_for(r) for r in range(w2)
        ]
    check_assignment(reference, load_plans, threshold)


def check_assignment(assignment, load_plans, threshold):
    """Every read item is fetched by its rank or delivered by a broadcast from a group member."""
    needed: dict = {}
    for p in load_plans:
        for item in p.reads:
            needed.setdefault(item.region, set()).add(p.rank)
    seen = set()
    for b in assignment.broadcasts:
        assert b.region not in seen
        seen.add(b.region)
        assert b.src in b.group and len(b.group) >= 2 and list(b.group) == sorted(set(b.group))
        assert set(b.group) <= needed[b.region]
        assert b.region.nbytes >= threshold
    for p in load_plans:
        fetches = set(assignment.fetches_for(p.rank))
        which = assignment.broadcast_of(p.rank)
        for i, item in enumerate(p.reads):
            if which[i] >= 0:
                b = assignment.broadcasts[which[i]]
                assert b.region == item.region and p.rank in b.group
                assert (item.region in fetches) == (b.src == p.rank)
            else:
                assert item.region in fetches
                regional = [b for b in assignment.broadcasts if b.region == item.region]
                assert not regional or p.rank not in regional[0].group
