"""The exact-cover check against a brute-force oracle (hypothesis), on adversarial layouts, and
the chunk lookup tree: results, and work measured (boxes in flight, chunks tested), never time."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.errors import CoverageError
from cloudckpt.planning import cover_sweep
from cloudckpt.planning.coverage import find_cover_defect
from cloudckpt.planning.load.chunk_index import LEAF_CHUNKS, ChunkIndex, manifest_index
from cloudckpt.planning.load.plan import plan_local_load
from cloudckpt.planning.pieces import PieceSpec
from tests.reliability import hostile_layouts as hl


def coverage_counts(shape, off, size) -> np.ndarray:
    """The oracle: how many boxes cover each element."""
    count = np.zeros(shape, dtype=np.int64)
    for o, s in zip(off.tolist(), size.tolist()):
        count[tuple(slice(a, a + b) for a, b in zip(o, s))] += 1
    return count


def check_against_oracle(shape, off, size, result) -> None:
    count = coverage_counts(shape, off, size)
    exact = bool((count == 1).all())
    assert (result is None) == exact, (shape, off.tolist(), size.tolist(), result)
    if result is not None:
        kind, o, s = result
        assert kind in ("gap", "overlap")
        region = count[tuple(slice(a, a + b) for a, b in zip(o, s))]
        assert region.size > 0, result
        assert (region == 0).all() if kind == "gap" else (region >= 2).all(), (result, region)


@st.composite
def tilings(draw, max_dims: int = 4, max_side: int = 5):
    """An exact tiling of a small shape, built by growing random boxes over free cells (so not
    only guillotine cuts: pinwheels and staircases come out too), in a coordinate system whose
    cell edges are random (chunks of uneven sizes)."""
    d = draw(st.integers(1, max_dims))
    cells = tuple(draw(st.lists(st.integers(1, max_side), min_size=d, max_size=d)))
    widths = [draw(st.lists(st.integers(1, 3), min_size=c, max_size=c)) for c in cells]
    edges = [np.concatenate(([0], np.cumsum(w))) for w in widths]
    free = np.ones(cells, dtype=bool)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    boxes = []
    for cell in rng.permutation(np.argwhere(free)):
        if not free[tuple(cell)]:
            continue
        hi = cell + 1
        for axis in rng.permutation(d).tolist():  # grow along each axis while the slab is free
            limit = int(rng.integers(hi[axis], cells[axis] + 1))
            while hi[axis] < limit:
                probe = [slice(a, b) for a, b in zip(cell, hi)]
                probe[axis] = slice(hi[axis], hi[axis] + 1)
                if not free[tuple(probe)].all():
                    break
                hi[axis] += 1
        free[tuple(slice(a, b) for a, b in zip(cell, hi))] = False
        boxes.append([(int(edges[k][cell[k]]), int(edges[k][hi[k]])) for k in range(d)])
    shape = tuple(int(e[-1]) for e in edges)
    off = np.array([[a for a, _ in b] for b in boxes], dtype=np.int64).reshape(-1, d)
    size = np.array([[b - a for a, b in bx] for bx in boxes], dtype=np.int64).reshape(-1, d)
    return shape, off, size


@st.composite
def damaged(draw):
    """A tiling with one gap (a box dropped or shrunk) or one overlap (a box grown, duplicated or
    added anywhere)."""
    shape, off, size = draw(tilings())
    how = draw(st.sampled_from(["drop", "shrink", "grow", "duplicate", "add"]))
    i = draw(st.integers(0, len(off) - 1))
    off, size = off.copy(), size.copy()
    if how == "drop":
        off, size = np.delete(off, i, 0), np.delete(size, i, 0)
    elif how == "duplicate":
        off, size = np.concatenate((off, off[i : i + 1])), np.concatenate((size, size[i : i + 1]))
    elif how == "add":
        o = [draw(st.integers(0, s - 1)) for s in shape]
        s = [draw(st.integers(1, n - a)) for a, n in zip(o, shape)]
        off, size = np.concatenate((off, [o])), np.concatenate((size, [s]))
    else:
        axis = draw(st.integers(0, len(shape) - 1))
        if how == "shrink" and size[i, axis] > 1:
            size[i, axis] -= 1
        elif how == "grow" and off[i, axis] + size[i, axis] < shape[axis]:
            size[i, axis] += 1
        elif how == "grow" and off[i, axis] > 0:
            off[i, axis] -= 1
            size[i, axis] += 1
        else:
            off, size = np.delete(off, i, 0), np.delete(size, i, 0)
    return shape, off, size


SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(tilings())
def test_valid_tilings_pass(layout):
    shape, off, size = layout
    assert cover_sweep.find_defect(shape, off, size) is None
    assert find_cover_defect(shape, off, size) is None


@SETTINGS
@given(damaged())
def test_damaged_tilings_are_found_and_located(layout):
    shape, off, size = layout
    if not len(off):
        return
    check_against_oracle(shape, off, size, cover_sweep.find_defect(shape, off, size))
    check_against_oracle(shape, off, size, find_cover_defect(shape, off, size))


# -- adversarial layouts: right answers, bounded work ---------------------------------------------


def _product(a, b):
    """The layout of ``a`` times the layout of ``b`` (axes of ``a`` then ``b``)."""
    (sa, oa, za), (sb, ob, zb) = a, b
    na, nb = len(oa), len(ob)
    off = np.concatenate([np.repeat(oa, nb, 0), np.tile(ob, (na, 1))], axis=1)
    size = np.concatenate([np.repeat(za, nb, 0), np.tile(zb, (na, 1))], axis=1)
    return tuple(sa) + tuple(sb), off, size


FAMILIES = {
    "column-split": lambda: hl.column_split(3000),
    "row-split": lambda: hl.row_split(3000),
    "staircase-64d": lambda: hl.staircase(64),
    "spiral-2d": lambda: hl.spiral(2000),
    "spiral-4d": lambda: hl.spiral(30, 4),
    "unit-cells-12d": lambda: hl.tiny_cubes(12),
    "brick-wall": lambda: hl.brick_wall(200, 200),
    "walls-product-8d": lambda: _product(
        _product(hl.brick_wall(3, 3, 3, seed=1), hl.brick_wall(3, 3, 3, seed=2)),
        _product(hl.brick_wall(3, 3, 3, seed=3), hl.brick_wall(3, 3, 3, seed=4)),
    ),
}


def covered_times(off, size, point) -> int:
    p = np.asarray(point, dtype=np.int64)
    return int(((off <= p) & (p < off + size)).all(axis=1).sum())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_adversarial_layouts_take_bounded_work(family):
    """Valid: accepted with at most 4 signed boxes in flight per chunk (the bound refuses past
    16); damaged: found, and the region really is a gap / an overlap (checked at its corners)."""
    shape, off, size = FAMILIES[family]()
    stats: dict = {}
    assert cover_sweep.find_defect(shape, off, size, stats=stats) is None
    assert find_cover_defect(shape, off, size) is None
    assert stats.get("max_entries", 0) <= 4 * stats["rows"], stats
    for kind in ("gap", "overlap"):
        bad_shape, bad_off, bad_size = hl.with_defect((shape, off, size), kind)
        found = find_cover_defect(bad_shape, bad_off, bad_size)
        assert found is not None and found[0] == kind, (kind, found)
        o, s = np.array(found[1]), np.array(found[2])
        for corner in (o, o + s - 1):
            times = covered_times(bad_off, bad_size, corner)
            assert (times == 0) if kind == "gap" else (times >= 2), (kind, found, times)


def test_the_work_bound_refuses_instead_of_running_away(monkeypatch):
    shape, off, size = hl.brick_wall(50, 50)
    monkeypatch.setattr(cover_sweep, "WORK_FACTOR", 0)
    monkeypatch.setattr(cover_sweep, "WORK_FLOOR", 10)
    assert find_cover_defect(shape, off, size) == ("irregular", (0, 0), shape)
    manifest = hl.layout_manifest({"w": (shape, off, size)})
    with pytest.raises(CoverageError, match="too irregular"):
        plan_local_load(manifest, [PieceSpec("w", "uint8", shape, (0, 0), (1, 1))], rank=0)


# -- the lookup tree ------------------------------------------------------------------------------


@SETTINGS
@given(tilings(), st.data())
def test_lookup_finds_exactly_the_overlapping_chunks(layout, data):
    shape, off, size = layout
    manifest = hl.layout_manifest({"w": (shape, off, size)})
    index = ChunkIndex(manifest.tensors["w"])
    queries = []
    for _ in range(3):
        o = [data.draw(st.integers(0, s - 1)) for s in shape]
        queries.append((o, [data.draw(st.integers(1, s - a)) for a, s in zip(o, shape)]))
    q_off = np.array([q[0] for q in queries], dtype=np.int64)
    q_end = q_off + np.array([q[1] for q in queries], dtype=np.int64)
    req, chunk = index.overlapping_many(q_off, q_end)
    got = sorted(zip(req.tolist(), chunk.tolist()))
    ends = off + size
    want = sorted(
        (r, c)
        for r in range(len(queries))
        for c in range(len(off))
        if ((np.minimum(ends[c], q_end[r]) > np.maximum(off[c], q_off[r])).all())
    )
    assert got == want


@pytest.mark.parametrize(
    "family", ["column-split", "row-split", "brick-wall", "spiral-2d", "unit-cells-12d"]
)
def test_one_element_lookups_test_few_chunks(family):
    """Every one-element request of a sample tests at most a few leaves of chunks, not all."""
    shape, off, size = FAMILIES[family]()
    manifest = hl.layout_manifest({"w": (shape, off, size)})
    plan_local_load(
        manifest, [PieceSpec("w", "uint8", shape, (0,) * len(shape), (1,) * len(shape))], rank=0
    )
    index = manifest_index(manifest).general(0)
    rng = np.random.default_rng(0)
    points = np.stack([rng.integers(0, s, 200) for s in shape], axis=1)
    before = index.tested
    req, chunk = index.overlapping_many(points, points + 1)
    assert sorted(req.tolist()) == list(range(200))  # each point lies in exactly one chunk
    assert index.tested - before <= 200 * 4 * LEAF_CHUNKS < len(off) * 200 / 4, (
        index.tested - before
    )


@pytest.mark.parametrize("scan_chunks", [1024, 0], ids=["scan", "tree"])
@SETTINGS
@given(layout=tilings(), data=st.data())
def test_plans_read_each_requested_element_once(scan_chunks, layout, data):
    """plan_local_load through the scan of small tensors and through the tree (forced): for
    random requests, the read items are exactly the overlaps with the chunks that meet them."""
    import cloudckpt.planning.load.plan as load_plan

    shape, off, size = layout
    manifest = hl.layout_manifest({"w": (shape, off, size)})
    requests = []
    for _ in range(data.draw(st.integers(1, 3))):
        o = [data.draw(st.integers(0, s - 1)) for s in shape]
        requests.append(
            PieceSpec(
                "w",
                "uint8",
                shape,
                tuple(o),
                tuple(data.draw(st.integers(1, s - a)) for a, s in zip(o, shape)),
            )
        )
    saved = load_plan.SCAN_CHUNKS
    load_plan.SCAN_CHUNKS = scan_chunks
    try:
        plan = plan_local_load(manifest, requests, rank=0)
    finally:
        load_plan.SCAN_CHUNKS = saved
    got = sorted((it.request_index, it.chunk_index) for it in plan.reads)
    ends = off + size
    want = sorted(
        (r, c)
        for r, req in enumerate(requests)
        for c in range(len(off))
        if (
            np.minimum(ends[c], np.add(req.offsets, req.sizes)) > np.maximum(off[c], req.offsets)
        ).all()
    )
    assert got == want
    for r, req in enumerate(requests):
        assert sum(int(np.prod(it.lengths)) for it in plan.reads if it.request_index == r) == int(
            np.prod(req.sizes)
        )
