"""Read once, broadcast: which rank fetches each stored region that several ranks need.

:func:`assign_readers` is a pure function of every rank's load plan (given in rank order), so
every rank computes the same :class:`ReadAssignment`. A region (a box inside one stored chunk)
needed identically by two or more ranks is fetched by one member of that group and broadcast to
the others, unless it is smaller than ``min_broadcast_bytes`` or a rank's piece is not
``broadcastable`` (that rank then reads it itself and is left out of the group). Fetchers are
chosen heaviest region first, each to the group member with the fewest bytes assigned so far
(its own reads included), ties to the lowest rank. Broadcasts are listed in that order, the one
global order every rank plans from. A load then cuts each region in windows and spreads their
sources over the group (:func:`~cloudckpt.planning.broadcast.rounds.balance_sources`); ``src``
is the whole-region choice, used where nothing spreads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloudckpt.errors import PlanningError
from cloudckpt.planning.cover_sweep import stable_order
from cloudckpt.planning.load.plan import LocalLoadPlan, Region, shared_tuples

DEFAULT_MIN_BROADCAST_BYTES = 32 * 1024


@dataclass(frozen=True, slots=True)
class Broadcast:
    """``src`` fetches ``region`` and broadcasts it to ``group`` (sorted ranks, src included)."""

    region: Region
    src: int
    group: tuple[int, ...]


class ReadAssignment:
    """The outcome of :func:`assign_readers` (see module doc)."""

    def __init__(
        self,
        broadcasts: tuple[Broadcast, ...],
        plans: Sequence[LocalLoadPlan],
        item_broadcast: list[np.ndarray],
    ):
        self.broadcasts = broadcasts
        self._plans = plans
        self._item_broadcast = item_broadcast  # per rank, per read item: broadcast index or -1

    def broadcast_of(self, rank: int) -> np.ndarray:
        """Per read item of ``rank``'s plan: index into ``broadcasts`` it is served by, or -1
        (the rank fetches it itself)."""
        return self._item_broadcast[rank]

    def fetches_for(self, rank: int) -> tuple[Region, ...]:
        """Regions ``rank`` fetches from the store: its own non-broadcast reads (each distinct
        region once, plan order), then the broadcasts it is the source of (global order)."""
        table = self._plans[rank].table
        own = np.flatnonzero(self._item_broadcast[rank] < 0)
        seen: dict[Region, None] = {}
        for i in own.tolist():
            seen.setdefault(table[i].region, None)
        for b in self.broadcasts:
            if b.src == rank:
                seen.setdefault(b.region, None)
        return tuple(seen)

    def own_bytes(self, kept: Sequence[int] | None = None) -> list[int]:
        """Per rank (rank order): bytes of its read items it fetches itself, those served by no
        broadcast or (given ``kept``) by a broadcast not in ``kept``."""
        keep = np.asarray(sorted(kept), dtype=np.int64) if kept is not None else None
        out = []
        for plan, served in zip(self._plans, self._item_broadcast):
            mine = served < 0 if keep is None else ~np.isin(served, keep)
            out.append(int(np.asarray(plan.table.nbytes)[mine].sum()))
        return out

    def receives_for(self, rank: int) -> tuple[Broadcast, ...]:
        """Broadcasts ``rank`` takes part in (as source or receiver), in global order."""
        return tuple(b for b in self.broadcasts if rank in b.group)


def _unify_names(plans: Sequence[LocalLoadPlan]) -> tuple[list[str], list[np.ndarray]]:
    names: list[str] = []
    index: dict[str, int] = {}
    maps: list[np.ndarray] = []
    prev_names: tuple[str, ...] | None = None
    prev_map = np.empty(0, dtype=np.int64)
    for p in plans:
        t = p.table
        if prev_names is not None and t.names == prev_names:
            maps.append(prev_map)
            continue
        if not index and len(set(t.names)) == len(t.names):  # the first plan: all new
            names.extend(t.names)
            index.update(zip(t.names, range(len(t.names))))
            m = np.arange(len(t.names), dtype=np.int64)
            prev_names, prev_map = t.names, m
            maps.append(m)
            continue
        try:  # usual case: every name already known (a C-speed loop)
            m = np.fromiter(map(index.__getitem__, t.names), dtype=np.int64, count=len(t.names))
        except KeyError:
            m = np.empty(len(t.names), dtype=np.int64)
            for i, n in enumerate(t.names):
                g = index.get(n)
                if g is None:
                    g = index[n] = len(names)
                    names.append(n)
                m[i] = g
        prev_names, prev_map = t.names, m
        maps.append(m)
    return names, maps


def assign_readers(
    load_plans: Sequence[LocalLoadPlan], *, min_broadcast_bytes: int = DEFAULT_MIN_BROADCAST_BYTES
) -> ReadAssignment:
    """Choose, for every region several ranks need, one fetcher and the broadcast group.

    ``load_plans[i]`` must be rank ``i``'s plan (e.g. decoded from the all-gathered bytes).
    """
    for i, p in enumerate(load_plans):
        if p.rank != i:
            raise PlanningError(f"load_plans[{i}] is the plan of rank {p.rank}")
    world = len(load_plans)
    tables = [p.table for p in load_plans]
    names, maps = _unify_names(load_plans)
    counts = np.array([len(t) for t in tables], dtype=np.int64)
    item_broadcast = [np.full(len(t), -1, dtype=np.int64) for t in tables]
    rows = int(counts.sum())
    if rows == 0:
        return ReadAssignment((), load_plans, item_broadcast)
    row_rank = np.repeat(np.arange(world, dtype=np.int64), counts)
    gname = np.concatenate([m[t.name_index] for m, t in zip(maps, tables)])
    chunk = np.concatenate([t.chunk_index for t in tables])
    nbytes = np.concatenate([t.nbytes for t in tables])
    eligible = np.concatenate([t.broadcastable for t in tables]) & (nbytes >= min_broadcast_bytes)
    loads = np.zeros(world, dtype=np.int64)
    np.add.at(loads, row_rank[~eligible], nbytes[~eligible])

    # Only regions of a (tensor, chunk) that two eligible items touch can be shared.
    cand = np.flatnonzero(eligible)
    pair = gname[cand] * (int(chunk.max()) + 1) + chunk[cand]
    _, inverse, pair_count = np.unique(pair, return_inverse=True, return_counts=True)
    lonely = cand[pair_count[inverse] < 2]
    np.add.at(loads, row_rank[lonely], nbytes[lonely])
    shared = cand[pair_count[inverse] >= 2]
    broadcasts: list[Broadcast] = []
    if len(shared):
        width = max(int(t.ndims.max(initial=0)) for t in tables) or 1
        ndim_row = np.concatenate([t.ndims[t.name_index] for t in tables])
        mask = np.arange(width) < ndim_row[:, None]
        src_all = np.zeros((rows, width), dtype=np.int64)
        len_all = np.zeros((rows, width), dtype=np.int64)
        src_all[mask] = np.concatenate([t.src_offsets for t in tables])
        len_all[mask] = np.concatenate([t.lengths for t in tables])
        src, length = src_all[shared], len_all[shared]
        pair_id = inverse[
            pair_count[inverse] >= 2
        ]  # dense (tensor, chunk) id, in (tensor, chunk) order
        order = stable_order(
            [pair_id] + [src[:, j] for j in range(width)] + [length[:, j] for j in range(width)]
        )
        s_rows = shared[order]
        s_src, s_len = src[order], length[order]
        same = (
            (gname[s_rows[1:]] == gname[s_rows[:-1]])
            & (chunk[s_rows[1:]] == chunk[s_rows[:-1]])
            & (s_src[1:] == s_src[:-1]).all(axis=1)
            & (s_len[1:] == s_len[:-1]).all(axis=1)
        )
        run_start = np.flatnonzero(np.concatenate(([True], ~same)))
        run_end = np.concatenate((run_start[1:], [len(s_rows)]))
        # rows of a run keep rank order (stable sort of rank-major rows): a run is shared by
        # several ranks iff the rank changes inside it
        s_rank = row_rank[s_rows]
        run_id = np.cumsum(np.concatenate(([0], ~same)))
        multi = np.zeros(len(run_start), dtype=bool)
        multi[run_id[1:][same & (s_rank[1:] != s_rank[:-1])]] = True
        alone = s_rows[~multi[run_id]]
        np.add.at(loads, row_rank[alone], nbytes[alone])
        runs = np.flatnonzero(multi)
        runs = runs[
            np.argsort(-nbytes[s_rows[run_start[runs]]], kind="stable")
        ]  # heaviest first, then key order
        load_list = loads.tolist()
        # each run's region, from its first row (columns read once, no ReadItem made)
        first = s_rows[run_start[runs]]
        rank_list, starts, ends = s_rank.tolist(), run_start.tolist(), run_end.tolist()
        firsts = zip(
            runs.tolist(),
            nbytes[first].tolist(),
            gname[first].tolist(),
            chunk[first].tolist(),
            ndim_row[first].tolist(),
            src_all[first].tolist(),
            len_all[first].tolist(),
        )
        groups: dict[
            tuple[int, ...], tuple[int, ...]
        ] = {}  # a run's rows' ranks -> its group (a few distinct)
        same = shared_tuples()
        for run, nb, g, c, nd, src_off, lengths in firsts:
            rows_ranks = tuple(rank_list[starts[run] : ends[run]])
            ranks = groups.get(rows_ranks)
            if ranks is None:
                ranks = groups[rows_ranks] = tuple(sorted(set(rows_ranks)))
            src_rank = min(ranks, key=load_list.__getitem__)
            load_list[src_rank] += nb
            region = Region(names[g], c, same(src_off[:nd]), same(lengths[:nd]), nb)
            broadcasts.append(Broadcast(region, src_rank, ranks))
        run_broadcast = np.full(len(run_start), -1, dtype=np.int64)
        run_broadcast[runs] = np.arange(len(runs), dtype=np.int64)
        row_broadcast = np.full(rows, -1, dtype=np.int64)
        row_broadcast[s_rows] = run_broadcast[run_id]
        item_broadcast = np.split(row_broadcast, np.cumsum(counts)[:-1])
    return ReadAssignment(tuple(broadcasts), load_plans, item_broadcast)
