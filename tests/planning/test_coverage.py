"""find_cover_defect on slabs, grids, ragged and high-dimensional layouts."""

from __future__ import annotations

import numpy as np
import pytest

from cloudckpt.planning.coverage import find_cover_defect


def boxes(*pairs):
    off = np.array([p[0] for p in pairs], dtype=np.int64).reshape(len(pairs), -1)
    size = np.array([p[1] for p in pairs], dtype=np.int64).reshape(len(pairs), -1)
    return off, size


@pytest.mark.parametrize(
    "shape,pairs,expected",
    [
        ((6,), [((0,), (3,)), ((3,), (3,))], None),
        ((6,), [((3,), (3,)), ((0,), (2,))], ("gap", (2,), (1,))),
        ((6,), [((0,), (4,)), ((3,), (3,))], ("overlap", (3,), (1,))),
        ((6,), [((1,), (5,))], ("gap", (0,), (1,))),
        ((6,), [((0,), (5,))], ("gap", (5,), (1,))),
        ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 4))], None),
        ((4, 4), [((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2))], ("gap", (2, 2), (2, 2))),
        # both cells of the reported (1, 2) region are covered twice (boxes 1+2 and 2+3)
        (
            (4, 4),
            [((0, 0), (3, 3)), ((2, 2), (2, 2)), ((0, 3), (4, 1)), ((3, 0), (1, 3))],
            ("overlap", (2, 2), (1, 2)),
        ),
        ((4, 4), [((0, 0), (4, 4)), ((0, 0), (1, 1))], ("overlap", (0, 0), (1, 1))),
        ((), [((), ())], None),
        ((), [], ("gap", (), ())),
        ((0, 3), [], None),
        ((3, 2), [((0, 0), (0, 2)), ((0, 0), (3, 2))], None),
    ],
)
def test_defects(shape, pairs, expected):
    off, size = boxes(*pairs) if pairs else (np.zeros((0, len(shape)), np.int64),) * 2
    assert find_cover_defect(shape, off, size) == expected


def test_high_dimensional_ragged_layouts():
    shape = (2,) * 7
    halves = boxes(((0,) * 7, (1,) + (2,) * 6), ((1,) + (0,) * 6, (1,) + (2,) * 6))
    assert find_cover_defect(shape, *halves) is None
    # ragged split along two dims (not slabs), in 7-d
    pieces = boxes(
        ((0,) * 7, (1, 1) + (2,) * 5),
        ((0, 1) + (0,) * 5, (1, 1) + (2,) * 5),
        ((1,) + (0,) * 6, (1,) + (2,) * 6),
        ((1, 1) + (0,) * 5, (1, 1) + (2,) * 5),
    )
    kind, off, size = find_cover_defect(shape, *pieces)
    assert kind == "overlap" and off[:2] == (1, 1)
    gap = boxes(((0,) * 7, (1, 1) + (2,) * 5), ((1,) + (0,) * 6, (1,) + (2,) * 6))
    assert find_cover_defect(shape, *gap)[0] == "gap"


def _grid(shape, rows, cols):
    """Boxes of a (rows x cols) grid over ``shape`` (torch.chunk sizes), as (offsets, sizes)."""
    r_per, c_per = -(-shape[0] // rows), -(-shape[1] // cols)
    off, size = [], []
    for i in range(rows):
        for j in range(cols):
            o = (min(i * r_per, shape[0]), min(j * c_per, shape[1]))
            s = (min(r_per, shape[0] - o[0]), min(c_per, shape[1] - o[1]))
            if s[0] > 0 and s[1] > 0:
                off.append(o)
                size.append(s)
    return np.array(off), np.array(size)


def test_regular_grids_tp_by_fsdp():
    from cloudckpt.planning import coverage

    for shape, rows, cols in (((1024, 512), 128, 8), ((1000, 77), 9, 4), ((5, 3), 5, 3)):
        off, size = _grid(shape, rows, cols)
        order = np.random.default_rng(0).permutation(len(off))
        off, size = off[order], size[order]
        assert coverage._is_exact_grid(shape, off, size)
        assert find_cover_defect(shape, off, size) is None
        # a missing cell, a doubled cell, a cell one row too tall: not a grid, and a defect
        assert find_cover_defect(shape, off[1:], size[1:])[0] == "gap"
        assert not coverage._is_exact_grid(shape, off[1:], size[1:])
        doubled_off, doubled_size = np.concatenate([off, off[:1]]), np.concatenate([size, size[:1]])
        assert not coverage._is_exact_grid(shape, doubled_off, doubled_size)
        assert find_cover_defect(shape, doubled_off, doubled_size)[0] == "overlap"
        tall = size.copy()
        tall[0, 0] += 1
        if off[0, 0] + tall[0, 0] <= shape[0]:
            assert not coverage._is_exact_grid(shape, off, tall)
            assert find_cover_defect(shape, off, tall)[0] == "overlap"
    # interval lists that tile each dim but boxes that are not all the combinations
    off = np.array([[0, 0], [0, 2], [2, 0], [2, 0]])
    size = np.array([[2, 2], [2, 2], [2, 2], [2, 2]])
    assert not coverage._is_exact_grid((4, 4), off, size)
    assert find_cover_defect((4, 4), off, size) is not None
