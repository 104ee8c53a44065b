"""Broadcast parts (planning/broadcast/parts.py): run parts for large regions stored as one run,
tiling the region's bytes in order; window parts otherwise; buffer layout aligned."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.planning.batching import WINDOW_ALIGN
from cloudckpt.planning.broadcast.parts import (
    MIN_PART_WINDOW,
    ROUNDS_PER_SOURCE,
    RunPart,
    WindowPart,
    part_window_bytes,
    plan_parts,
)
from cloudckpt.planning.broadcast.readers import Broadcast
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import layout_windows, plan_windows
from tests.planning.test_load_plan import manifest_with

ITEMSIZE = {"float32": 4, "int64": 8, "bfloat16": 2, "bool": 1}


@st.composite
def cases(draw):
    dtype = draw(st.sampled_from(sorted(ITEMSIZE)))
    sizes = (draw(st.integers(1, 40)), draw(st.integers(1, 12)))
    m = manifest_with(
        {"t": (dtype, sizes, [((0, 0), sizes)])}, block=draw(st.sampled_from([8, 16, 24, 64]))
    )
    broadcasts = []
    for _ in range(draw(st.integers(1, 4))):
        r0 = draw(st.integers(0, sizes[0] - 1))
        rows = draw(st.integers(1, sizes[0] - r0))
        c0 = draw(st.sampled_from([0, draw(st.integers(0, sizes[1] - 1))]))
        cols = sizes[1] - c0 if c0 == 0 else draw(st.integers(1, sizes[1] - c0))
        n = rows * cols * ITEMSIZE[dtype]
        broadcasts.append(Broadcast(Region("t", 0, (r0, c0), (rows, cols), n), 0, (0, 1)))
    return m, broadcasts


@settings(max_examples=200, deadline=None)
@given(cases(), st.integers(1, 200), st.integers(0, 400), st.data())
def test_parts_follow_the_rule_and_tile_each_region(case, window_bytes, run_min, data):
    m, bs = case
    indices = data.draw(st.permutations(range(len(bs))))
    parts = plan_parts(m, bs, indices, window_bytes, run_min)
    # broadcasts in the order given, each one's parts together
    order = [p.broadcast for p in parts]
    assert order == sorted(order, key=indices.index)
    for i in indices:
        region = bs[i].region
        mine = [p for p in parts if p.broadcast == i]
        one_run = (
            math.prod(region.lengths) == region.lengths[0] * m.tensors["t"].shape[1]
            or region.lengths[0] == 1
        )
        if region.nbytes >= run_min and one_run:
            assert mine and all(isinstance(p, RunPart) for p in mine)
            assert [(p.run.lo, p.run.hi) for p in mine][0][0] == 0
            assert all(a.run.hi == b.run.lo for a, b in zip(mine, mine[1:]))
            assert mine[-1].run.hi == region.nbytes
            assert (
                sum(p.payload_bytes for p in mine) == region.nbytes == sum(p.nbytes for p in mine)
            )
            assert all(p.fetch_bytes >= p.nbytes for p in mine)
        else:
            assert all(isinstance(p, WindowPart) for p in mine)
            assert [p.window for p in mine] == plan_windows(m, region, window_bytes)
            assert all(
                p.nbytes % WINDOW_ALIGN == 0
                and p.nbytes - WINDOW_ALIGN < p.fetch_bytes == p.payload_bytes <= p.nbytes
                for p in mine
            )


def test_layout_windows_aligns_every_window():
    m = manifest_with({"t": ("float32", (100,), [((0,), (100,))])}, block=12)
    ws = plan_windows(m, Region("t", 0, (0,), (100,), 400), 36)
    offsets, total = layout_windows(ws)
    assert all(o % WINDOW_ALIGN == 0 for o in offsets)
    assert all(b - a >= w.length for a, b, w in zip(offsets, offsets[1:] + [total], ws))
    assert total == sum(-(-w.length // WINDOW_ALIGN) * WINDOW_ALIGN for w in ws)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(0, 1 << 34), st.integers(1, 4096), st.integers(1, 64 << 20), st.integers(0, 1 << 31)
)
def test_part_windows_are_bounded_by_the_cap_and_the_read_budget(total, ranks, cap, budget):
    w = part_window_bytes(total, ranks, cap, budget)
    assert 1 <= w <= cap
    memory = budget // (4 * ranks)
    # an exchange of one window per rank stays within a quarter of the read budget, whenever
    # that is at least a byte per rank
    assert w <= max(memory, 1)
    # a share in ROUNDS_PER_SOURCE windows, never cut below MIN_PART_WINDOW for that alone
    share = -(-total // (ranks * ROUNDS_PER_SOURCE))
    assert w >= min(cap, memory, max(MIN_PART_WINDOW, share))
    assert w <= max(min(cap, share), min(cap, MIN_PART_WINDOW), 1)


def test_part_window_examples():
    mib = 1 << 20
    # the cluster benchmark's 62 MiB state: four rounds per source, 16 MiB at most
    assert part_window_bytes(62 * mib, 2, 16 * mib, 192 * mib) == -(-62 * mib // 8)
    assert part_window_bytes(62 * mib, 8, 16 * mib, 192 * mib) == -(-62 * mib // 32)
    assert part_window_bytes(1 << 30, 2, 16 * mib, 192 * mib) == 16 * mib
    assert part_window_bytes(1 << 30, 16, 16 * mib, 192 * mib) == 3 * mib  # the budget
    assert part_window_bytes(10_000, 4, 16 * mib, 192 * mib) == mib  # the floor
    assert part_window_bytes(10_000, 4, 2048, 192 * mib) == 2048  # the cap
