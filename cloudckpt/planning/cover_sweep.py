"""Exact-cover check of any box layout by a signed sweep, one axis at a time.

The question "do boxes ``B_1 .. B_n`` cover box ``C`` exactly once" is asked as "is the signed
sum ``F = 1_B1 + ... + 1_Bn - 1_C`` zero everywhere". Sweeping axis 0, ``F`` is zero everywhere
iff every *jump* of ``F`` across a hyperplane ``x_0 = x`` is zero, and the jump at ``x`` is again a
signed sum of boxes one dimension down: the projections of the boxes starting at ``x`` (with
their sign) and of those ending at ``x`` (sign flipped). Each jump is checked the same way along
the next axis, and so on; after the last axis a jump is a plain sum of weights. Three things keep
this near ``O(n log n)`` (times the number of axes along which boxes differ):

- equal projections with opposite signs cancel when a jump is formed (a chunk ending where the
  next one starts, above a common cross-section, disappears at once);
- a group whose boxes all share the same interval along the axis is not split (that axis is a
  common factor);
- the jumps of one group sum to zero by construction, so the largest of them is never checked.

Exactness does not depend on any of them. The work is bounded: a layout needing more than
``WORK_FACTOR * (n + 1) + WORK_FLOOR`` signed boxes in flight after any axis raises
:class:`TooIrregular` rather than being checked (valid layouts measured, random guillotine
splits up to 64 dims, staircases, spirals, brick walls and products of them included, stay
under ``4 * (n + 1)``).

:func:`find_defect` also locates a defect: it follows the first failing jump along each axis,
which yields a box on which ``F`` is a non-zero constant (``< 0``: a gap, ``> 0``: an overlap).
Pure numpy, no recursion in Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import SupportsInt

import numpy as np

#: At most this many signed boxes in flight per axis, times the number of boxes (plus a floor).
WORK_FACTOR = 16
WORK_FLOOR = 1 << 16


def stable_order(columns: Sequence[np.ndarray], *, stable: bool = True) -> np.ndarray:
    """Stable lexicographic order of rows given non-negative int columns, most significant first.

    Packs the columns into one int64 key when their bit widths fit (one stable argsort, several
    times faster than ``np.lexsort``), else falls back to ``np.lexsort``. ``stable=False``: rows
    with equal keys may come in any order (a faster sort when they fit).
    """
    columns = [np.asarray(c, dtype=np.int64) for c in columns]
    bits = [max(1, int(c.max(initial=0)).bit_length()) for c in columns]
    if sum(bits) <= 62 and all(int(c.min(initial=0)) >= 0 for c in columns):
        key = columns[0].copy()
        for c, b in zip(columns[1:], bits[1:]):
            key <<= b
            key |= c
        return np.argsort(key, kind="stable" if stable else "quicksort")
    return np.lexsort(tuple(reversed(columns)))


class TooIrregular(Exception):
    """The layout needs more work than the bound allows (see :data:`WORK_FACTOR`)."""


class _Boxes:
    """The boxes (rows ``0..n-1``, weight +1) and the target box (row ``n``, weight -1), with,
    per axis, the rank of each start/end among that axis's coordinates and an id per distinct
    projection onto the axes after it (``sid[j]``: equal ids <=> equal boxes over axes ``j..``)."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray):
        self.lo, self.hi = lo, hi
        rows, d = lo.shape
        self.d = d
        self.rank_lo = np.empty((d, rows), dtype=np.int64)
        self.rank_hi = np.empty((d, rows), dtype=np.int64)
        self.n_coords = np.empty(d, dtype=np.int64)
        self.sid = np.zeros((d + 1, rows), dtype=np.int64)
        for j in range(d - 1, -1, -1):
            _, inv = np.unique(np.concatenate((lo[:, j], hi[:, j])), return_inverse=True)
            inv = inv.reshape(-1).astype(np.int64)
            r = int(inv.max()) + 1
            self.rank_lo[j], self.rank_hi[j] = inv[:rows], inv[rows:]
            self.n_coords[j] = r
            if j == 0:
                break  # sid[0] is never used (axis 0 is always swept)
            pair = inv[:rows] * r + inv[rows:]  # < r**2 <= 4 rows**2
            if j < d - 1:
                if 4 * rows**3 < 1 << 62:  # one key: (pair, sid of the axes after j)
                    pair = pair * rows + self.sid[j + 1]
                else:
                    pair = (
                        np.unique(pair, return_inverse=True)[1].reshape(-1) * rows + self.sid[j + 1]
                    )
            self.sid[j] = np.unique(pair, return_inverse=True)[1].reshape(-1)


class _Entries:
    """Signed boxes in flight: row ``b`` of :class:`_Boxes` with weight ``w`` in group ``gid``
    (sorted by group); ``root`` is the group's root (see :func:`_failing_roots`)."""

    __slots__ = ("gid", "b", "w", "root")

    def __init__(self, gid: np.ndarray, b: np.ndarray, w: np.ndarray, root: np.ndarray):
        self.gid, self.b, self.w, self.root = gid, b, w, root

    def __len__(self) -> int:
        return len(self.b)


def _group_starts(gid: np.ndarray) -> np.ndarray:
    if not len(gid):
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(np.concatenate(([True], gid[1:] != gid[:-1])))


def _split(bx: _Boxes, j: int, e: _Entries, *, skip: bool) -> tuple[_Entries, np.ndarray]:
    """Replace every group that differs along axis ``j`` by its jumps along ``j`` (cancelled,
    zero-weight entries dropped; the largest jump of each group dropped when ``skip``); groups
    whose entries all share one interval along ``j`` pass unchanged. Returns the new entries
    (groups numbered in (old group, coordinate) order) and, per new group, its coordinate rank
    along ``j`` (-1 for a group passed unchanged)."""
    starts = _group_starts(e.gid)
    lens = np.diff(np.concatenate((starts, [len(e)])))
    lo_r, hi_r = bx.rank_lo[j][e.b], bx.rank_hi[j][e.b]
    same = (np.minimum.reduceat(lo_r, starts) == np.maximum.reduceat(lo_r, starts)) & (
        np.minimum.reduceat(hi_r, starts) == np.maximum.reduceat(hi_r, starts)
    )
    same_e = np.repeat(same, lens)
    keep, cut = np.flatnonzero(same_e), np.flatnonzero(~same_e)
    sentinel = int(bx.n_coords[j])
    gid = np.concatenate((e.gid[keep], e.gid[cut], e.gid[cut]))
    coord = np.concatenate((np.full(len(keep), sentinel, np.int64), lo_r[cut], hi_r[cut]))
    b = np.concatenate((e.b[keep], e.b[cut], e.b[cut]))
    w = np.concatenate((e.w[keep], e.w[cut], -e.w[cut]))
    root = np.concatenate((e.root[keep], e.root[cut], e.root[cut]))
    group_key = gid * (sentinel + 1) + coord  # < (entries) * (2n + 3): no overflow below ~5e8 boxes
    order = stable_order([group_key, bx.sid[j + 1][b]], stable=False)  # equal keys merge anyway
    group_key, b, w, root, coord = group_key[order], b[order], w[order], root[order], coord[order]
    sid = bx.sid[j + 1][b]
    run = np.flatnonzero(
        np.concatenate(([True], (group_key[1:] != group_key[:-1]) | (sid[1:] != sid[:-1])))
    )
    w = np.add.reduceat(w, run) if len(run) else w
    live = run[w != 0]
    w = w[w != 0]
    group_key, b, root, coord = group_key[live], b[live], root[live], coord[live]
    parent = gid[order][live]
    new_group = (
        np.concatenate(([True], group_key[1:] != group_key[:-1]))
        if len(live)
        else np.zeros(0, bool)
    )
    if skip and len(live):
        g_start = np.flatnonzero(new_group)
        g_len = np.diff(np.concatenate((g_start, [len(live)])))
        g_parent, g_coord = parent[g_start], coord[g_start]
        jumps = np.flatnonzero(g_coord != sentinel)
        if len(jumps):
            # per parent, its largest jump (first in order of (parent, -size))
            pick = jumps[np.lexsort((-g_len[jumps], g_parent[jumps]))]
            first = np.concatenate(([True], g_parent[pick][1:] != g_parent[pick][:-1]))
            drop_group = np.zeros(len(g_start), dtype=bool)
            drop_group[pick[first]] = True
            alive = ~np.repeat(drop_group, g_len)
            b, w, root, coord, group_key = (
                b[alive],
                w[alive],
                root[alive],
                coord[alive],
                group_key[alive],
            )
            new_group = (
                np.concatenate(([True], group_key[1:] != group_key[:-1]))
                if len(b)
                else new_group[:0]
            )
    gid_new = np.cumsum(new_group) - 1
    g_coord = coord[new_group]
    g_coord = np.where(g_coord == sentinel, -1, g_coord)
    return _Entries(gid_new.astype(np.int64), b, w, root), g_coord


def _failing_roots(
    bx: _Boxes,
    j0: int,
    e: _Entries,
    budget: np.ndarray,
    *,
    stop_at_first: bool,
    stats: dict[str, int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(roots whose signed sum is not zero, roots past their work bound), checking axes ``j0..``.

    ``budget[r]``: the most entries root ``r`` may have in flight after any axis; a root past it
    is dropped and reported as irregular (the accounting is per root, so checking tensors
    together gives each the verdict it gets alone). ``stop_at_first``: return as soon as one
    failing root is known (any one)."""
    irregular = np.zeros(0, dtype=np.int64)
    for j in range(j0, bx.d):
        if not len(e):
            return np.zeros(0, dtype=np.int64), irregular
        starts = _group_starts(e.gid)
        single = np.diff(np.concatenate((starts, [len(e)]))) == 1  # one non-zero box: fails
        if stop_at_first and single.any():
            return e.root[starts[single][:1]], irregular
        e, _ = _split(bx, j, e, skip=True)
        if stats is not None:
            stats["max_entries"] = max(stats.get("max_entries", 0), len(e))
        count = np.bincount(e.root, minlength=len(budget))
        over = np.flatnonzero(count > budget)
        if len(over):
            irregular = np.union1d(irregular, over)
            keep = ~np.isin(e.root, over)
            e = _Entries(e.gid[keep], e.b[keep], e.w[keep], e.root[keep])
    return np.unique(e.root), irregular


def covers_many(
    lo: np.ndarray, hi: np.ndarray, group: np.ndarray, shapes: np.ndarray
) -> np.ndarray:
    """Exact-cover verdicts of several tensors at once, each exactly what :func:`find_defect`
    decides alone: per group ``1`` covered exactly once, ``0`` not, ``-1`` too irregular.

    ``lo``/``hi``: ``(n, width)`` non-empty boxes (padded with ``0``/``1``), ``group``: each box's
    tensor, ``0..G-1`` ascending; ``shapes``: ``(G, width)`` (padded with 1).
    """
    n_groups, width = shapes.shape
    counts = np.bincount(group, minlength=n_groups)
    axes = (
        np.flatnonzero(((lo != 0) | (hi != shapes[group])).any(axis=0))
        if len(lo)
        else np.zeros(0, np.int64)
    )
    verdict = np.ones(n_groups, dtype=np.int64)
    if not len(axes):  # every box is its whole tensor: exact iff alone
        verdict[counts != 1] = 0
        return verdict
    rows_lo = np.concatenate((lo[:, axes], np.zeros((n_groups, len(axes)), np.int64)))
    rows_hi = np.concatenate((hi[:, axes], shapes[:, axes]))
    bx = _Boxes(rows_lo, rows_hi)
    gid = np.concatenate((group, np.arange(n_groups, dtype=np.int64)))
    order = np.argsort(gid, kind="stable")
    w = np.concatenate((np.ones(len(lo), np.int64), np.full(n_groups, -1, np.int64)))
    e = _Entries(gid[order], order.astype(np.int64), w[order], gid[order])
    budget = WORK_FACTOR * (counts + 1) + WORK_FLOOR
    failing, irregular = _failing_roots(bx, 0, e, budget, stop_at_first=False)
    verdict[failing] = 0
    verdict[irregular] = -1
    return verdict


def _prepare(
    shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Axes along which some box is not whole (the others are a common factor), and the boxes
    restricted to them with the target box appended."""
    shape_a = np.asarray(shape, dtype=np.int64)
    ends = offsets + sizes
    axes = np.flatnonzero(((offsets != 0) | (ends != shape_a)).any(axis=0))
    lo = np.concatenate((offsets[:, axes], np.zeros((1, len(axes)), np.int64)))
    hi = np.concatenate((ends[:, axes], shape_a[axes][None, :]))
    return axes, lo, hi


def _initial(rows: int) -> _Entries:
    w = np.ones(rows, dtype=np.int64)
    w[-1] = -1
    zeros = np.zeros(rows, dtype=np.int64)
    return _Entries(zeros, np.arange(rows, dtype=np.int64), w, zeros.copy())


def find_defect(
    shape: Iterable[SupportsInt],
    offsets: np.ndarray,
    sizes: np.ndarray,
    *,
    stats: dict[str, int] | None = None,
) -> tuple[str, tuple[int, ...], tuple[int, ...]] | None:
    """None if the (non-empty, in-bounds) boxes cover ``shape`` exactly once, else
    ``(kind, offsets, sizes)`` with kind ``"gap"`` or ``"overlap"`` and a box of the defect.
    Raises :class:`TooIrregular` past the work bound. ``stats`` (a dict), if given, receives
    ``rows`` (boxes + 1) and ``max_entries`` (the most signed boxes in flight after any axis)."""
    shape_ = tuple(int(s) for s in shape)
    axes, lo, hi = _prepare(shape_, offsets, sizes)
    rows = len(lo)
    if not len(axes):  # every box is the whole tensor
        return None if rows == 2 else ("overlap", (0,) * len(shape_), shape_)
    bx = _Boxes(lo, hi)
    budget = np.array([WORK_FACTOR * rows + WORK_FLOOR])
    if stats is not None:
        stats["rows"] = rows
    failing, irregular = _failing_roots(
        bx, 0, _initial(rows), budget, stop_at_first=True, stats=stats
    )
    if len(irregular):
        raise TooIrregular(rows)
    if not len(failing):
        return None
    region_lo, region_hi = list(lo[-1]), list(hi[-1])
    e = _initial(rows)
    for j in range(bx.d):
        lo_r, hi_r = bx.rank_lo[j][e.b], bx.rank_hi[j][e.b]
        if (lo_r == lo_r[0]).all() and (hi_r == hi_r[0]).all():
            region_lo[j], region_hi[j] = int(lo[e.b[0], j]), int(hi[e.b[0], j])
            continue
        coords = np.unique(np.concatenate((lo[e.b, j], hi[e.b, j])))
        jumps, g_coord = _split(bx, j, e, skip=False)
        jumps.root = jumps.gid.copy()
        failing, irregular = _failing_roots(
            bx, j + 1, jumps, np.full(int(jumps.gid.max()) + 1, budget[0]), stop_at_first=False
        )
        if len(irregular):
            raise TooIrregular(rows)
        g = int(failing.min())  # groups are numbered by coordinate: the first failing jump
        x = _coord_value(bx, j, int(g_coord[g]))
        region_lo[j], region_hi[j] = x, int(coords[np.searchsorted(coords, x, side="right")])
        mine = np.flatnonzero(jumps.gid == g)
        e = _Entries(
            np.zeros(len(mine), np.int64),
            jumps.b[mine],
            jumps.w[mine],
            np.zeros(len(mine), np.int64),
        )
    value = int(e.w.sum())
    region = _unproject(shape_, axes, region_lo, region_hi)
    return ("gap" if value < 0 else "overlap", *region)


def _coord_value(bx: _Boxes, j: int, rank: int) -> int:
    """The coordinate of rank ``rank`` along axis ``j``."""
    where = np.flatnonzero(bx.rank_lo[j] == rank)
    if len(where):
        return int(bx.lo[where[0], j])
    return int(bx.hi[np.flatnonzero(bx.rank_hi[j] == rank)[0], j])


def _unproject(
    shape: tuple[int, ...], axes: np.ndarray, region_lo: list[int], region_hi: list[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    off, size = [0] * len(shape), list(shape)
    for k, a in enumerate(axes.tolist()):
        off[a], size[a] = region_lo[k], region_hi[k] - region_lo[k]
    return tuple(off), tuple(size)
