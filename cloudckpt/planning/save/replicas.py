"""Who writes each replicated box, and which large ones are cut into row ranges.

Part of :func:`cloudckpt.planning.save.global_plan.plan_global_save`; pure and deterministic
(integer arithmetic, every tie broken by rank), so every rank derives the same result.

Contract of :func:`assign_replicas`:

- A box held by one rank is written by it.
- *Targets*: each rank's fair write load, as if replicated bytes were divisible at will:
  replicated boxes grouped by their set of holders, heaviest group first, each group's bytes
  poured onto its holders so that the least loaded are raised to one level (water-filling).
  When every rank holds every replicated box this is ``S / N`` (sharded bytes permitting).
- Replicated boxes, heaviest first (stable), each whole to the holder with the fewest bytes so
  far (ties: lowest rank) when it fits in that holder's room left below its target. Otherwise a
  box of at least ``2 * piece_bytes`` whose first dimension of size above 1 (its *rows*) allows
  two pieces of at least ``piece_bytes`` is cut into row ranges: holders take, in order of
  smallest positive room left below their target (ties: lowest rank), as many whole rows as fit in
  that room; a holder whose room is less than
  ``piece_bytes`` takes none; a piece that would leave a tail shorter than ``piece_bytes``
  takes the tail too or leaves exactly ``piece_bytes``, whichever is nearer its room; rows left
  when every holder is full go, at least ``piece_bytes`` at a time, to the holders not yet used
  with the most room (the last such piece grows when none is left). Every piece of a cut box
  therefore has at least ``piece_bytes`` bytes, each holder writes at most one piece of it, and
  each holder ends within about one piece of its target. A box not cut goes whole to the holder
  with the fewest bytes so far. (A state whose boxes fit is therefore assigned as without
  cutting, and a read-once load, which picks its sources by the same rule, reads each box from
  the object its source wrote.)
- ``piece_bytes <= 0`` disables cutting (each box whole, as above).
- ``weights`` (one per rank, from :func:`cloudckpt.planning.save.rates.replica_weights`): the
  same rules in time instead of bytes: the water-filling raises the holders to one level of
  ``bytes / weight`` (a holder of weight 1/4 gets a quarter of the bytes of one of weight 1 at
  the same level), and "fewest bytes so far" becomes "lowest ``bytes / weight`` so far".
  ``None``: every weight 1 (exactly the rules above, in integers).

A piece's rows are a contiguous range of the box's row-major bytes: cut from a contiguous local
tensor it is a view, no copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Smallest piece a replicated box is cut into (bytes); boxes under twice this stay whole.
#: Read at each planning call that passes none.
REPLICA_PIECE_BYTES = 4 << 20


def cut_dim(size: np.ndarray, ndim: int) -> int:
    """The dimension a box is cut along: its first of size above 1 (``-1``: none)."""
    big = np.flatnonzero(size[:ndim] > 1)
    return int(big[0]) if len(big) else -1


def _water_fill(levels: list[int], amount: int) -> list[int]:
    """Integer amounts adding up to ``amount`` that raise the lowest ``levels`` to one level
    (the remainder, one each, to the lowest levels first, ties by position)."""
    n = len(levels)
    order = sorted(range(n), key=lambda i: (levels[i], i))
    prefix, k, level = 0, 0, 0
    for k in range(1, n + 1):
        prefix += levels[order[k - 1]]
        level = (amount + prefix) // k
        if k == n or level <= levels[order[k]]:
            break
    add = [0] * n
    rest = amount
    for i in order[:k]:
        add[i] = max(0, level - levels[i])
        rest -= add[i]
    for i in order[:k]:
        if rest <= 0:
            break
        add[i] += 1
        rest -= 1
    return add


def _weighted_fill(levels: list[int], weights: list[float], amount: int) -> list[int]:
    """Integer amounts adding up to ``amount`` that raise the lowest ``levels[i] / weights[i]``
    to one level ``T`` (holder ``i`` then holds about ``T * weights[i]``)."""
    n = len(levels)
    order = sorted(range(n), key=lambda i: (levels[i] / weights[i], i))
    lsum, wsum, k, level = 0.0, 0.0, 0, 0.0
    for k in range(1, n + 1):
        lsum += levels[order[k - 1]]
        wsum += weights[order[k - 1]]
        level = (amount + lsum) / wsum
        if k == n or level <= levels[order[k]] / weights[order[k]]:
            break
    add = [0] * n
    rest = amount
    for i in order[:k]:
        add[i] = min(rest, max(0, math.floor(level * weights[i] - levels[i])))
        rest -= add[i]
    while rest > 0:
        for i in order[:k]:
            if rest <= 0:
                break
            add[i] += 1
            rest -= 1
    return add


def _targets(
    load: list[int],
    multi: list[int],
    holders_of: Callable[[int], tuple[int, ...]],
    nbytes: list[int],
    weights: list[float] | None = None,
) -> list[int]:
    groups: dict[tuple[int, ...], int] = {}
    for u, nb in zip(multi, nbytes):
        key = holders_of(u)
        groups[key] = groups.get(key, 0) + nb
    target = list(load)
    for key, total in sorted(groups.items(), key=lambda kv: -kv[1]):  # stable: first seen first
        levels = [target[r] for r in key]
        add = (
            _water_fill(levels, total)
            if weights is None
            else _weighted_fill(levels, [weights[r] for r in key], total)
        )
        for r, a in zip(key, add):
            target[r] += a
    return target


def _cut(
    holders: tuple[int, ...], rows: int, row_bytes: int, min_rows: int, room: list[int]
) -> list[tuple[int, int]]:
    """``(holder position, row count)`` per piece, in row order (see module doc)."""
    order = sorted(
        range(len(holders)), key=lambda i: (room[holders[i]] <= 0, room[holders[i]], holders[i])
    )
    pieces: list[tuple[int, int]] = []
    left = rows
    for i in order:
        fit = max(room[holders[i]], 0) // row_bytes
        take = min(left, fit)
        if take < min_rows:
            continue
        if left - take < min_rows:  # no tail under min_rows: take it, or leave min_rows
            most = left - min_rows
            take = most if most >= min_rows and fit - most < left - fit else left
        pieces.append((i, take))
        room[holders[i]] -= take * row_bytes
        left -= take
        if left == 0:
            return pieces
    used = {i for i, _ in pieces}
    while left:  # every holder full: the rest to the holders with the most room, still >= min_rows
        free = [i for i in range(len(holders)) if i not in used] or [pieces[-1][0]]
        i = min(free, key=lambda k: (-room[holders[k]], holders[k]))
        take = min(left, max(min_rows, max(room[holders[i]], 0) // row_bytes))
        if left - take < min_rows:
            take = left
        if pieces and pieces[-1][0] == i:
            pieces[-1] = (i, pieces[-1][1] + take)
        else:
            pieces.append((i, take))
        used.add(i)
        room[holders[i]] -= take * row_bytes
        left -= take
    return pieces


@dataclass(frozen=True, kw_only=True)
class ReplicaBoxes:
    """A save's distinct boxes and their holders, as columns.

    Per distinct box ``u``: ``nbytes[u]``, ``size[u]`` (padded past its tensor's ``ndim[u]``)
    and its holders: rows ``run_start[u] .. run_start[u] + run_len[u] - 1`` of ``hold_rank``
    (ascending ranks) and ``hold_piece`` (the holder's piece index of the box).
    """

    run_start: np.ndarray
    run_len: np.ndarray
    nbytes: np.ndarray
    size: np.ndarray
    ndim: np.ndarray
    hold_rank: np.ndarray
    hold_piece: np.ndarray


@dataclass(frozen=True, kw_only=True)
class ReplicaAssignment:
    """Who writes each distinct box (see module doc).

    ``writer[u]`` / ``writer_piece[u]``: the rank writing box ``u`` whole and its piece index
    there (for a cut box, its lowest holder's: unused); ``cuts``: the boxes that are cut, box
    index -> ``((row start, row count, holder position), ...)`` in row order (holder position
    ``i``: rank ``hold_rank[run_start[u] + i]``).
    """

    writer: np.ndarray
    writer_piece: np.ndarray
    cuts: Mapping[int, tuple[tuple[int, int, int], ...]]


def assign_replicas(
    boxes: ReplicaBoxes,
    *,
    world_size: int,
    piece_bytes: int,
    weights: Sequence[float] | None = None,
) -> ReplicaAssignment:
    """Choose the writer of every distinct box of ``boxes`` among its holders, cutting large
    replicated ones into row ranges of at least ``piece_bytes``, spread by ``weights`` (one per
    rank; ``None``: evenly) (see the module doc)."""
    rate_w = None if weights is None else [float(w) for w in weights]
    if rate_w is not None and (
        len(rate_w) != world_size or not all(math.isfinite(w) and w > 0 for w in rate_w)
    ):
        raise ValueError(f"need {world_size} positive finite weights, got {rate_w!r}")
    speed = rate_w or [1] * world_size  # "fewest bytes so far" is "least time so far"
    run_start, run_len, u_nbytes = boxes.run_start, boxes.run_len, boxes.nbytes
    u_size, u_ndim, s_rank, s_piece = boxes.size, boxes.ndim, boxes.hold_rank, boxes.hold_piece
    writer = s_rank[run_start].copy()  # the lowest holder, until chosen
    writer_piece = s_piece[run_start].copy()
    single = run_len == 1
    load = np.zeros(world_size, dtype=np.int64)
    np.add.at(load, writer[single], u_nbytes[single])
    multi = np.flatnonzero(~single)
    multi = multi[np.argsort(-u_nbytes[multi], kind="stable")]
    loads = load.tolist()
    multi_l = multi.tolist()
    starts, lens, nbytes = (
        run_start[multi].tolist(),
        run_len[multi].tolist(),
        u_nbytes[multi].tolist(),
    )
    holders = [tuple(s_rank[s : s + n].tolist()) for s, n in zip(starts, lens)]  # ascending ranks
    cut: dict[int, tuple[tuple[int, int, int], ...]] = {}
    room = None
    if piece_bytes > 0 and multi_l and max(nbytes) >= 2 * piece_bytes:
        by_box = dict(zip(multi_l, holders))
        target = _targets(loads, multi_l, by_box.__getitem__, nbytes, rate_w)
        room = [t - lo for t, lo in zip(target, loads)]
    for u, s, nb, hs in zip(multi_l, starts, nbytes, holders):
        i = min(range(len(hs)), key=lambda k: loads[hs[k]] / speed[hs[k]])
        if room is not None and nb >= 2 * piece_bytes and room[hs[i]] < nb:
            d = cut_dim(u_size[u], int(u_ndim[u]))
            rows = int(u_size[u, d]) if d >= 0 else 1
            row_bytes = nb // rows
            min_rows = -(-piece_bytes // row_bytes)
            if rows >= 2 * min_rows:
                pieces = _cut(hs, rows, row_bytes, min_rows, room)
                if len(pieces) > 1:
                    start, out = 0, []
                    for i, n in pieces:
                        out.append((start, n, i))
                        loads[hs[i]] += n * row_bytes
                        start += n
                    cut[u] = tuple(out)
                    continue
                i = pieces[0][0]  # one piece: the box whole (room already charged)
                loads[hs[i]] += nb
                writer[u], writer_piece[u] = hs[i], s_piece[s + i]
                continue
        loads[hs[i]] += nb
        if room is not None:
            room[hs[i]] -= nb
        writer[u], writer_piece[u] = hs[i], s_piece[s + i]
    return ReplicaAssignment(writer=writer, writer_piece=writer_piece, cuts=cut)
