"""The global save plan: a deterministic function of every rank's local plan.

The save protocol runs :func:`plan_global_save` on the coordinator alone, over every rank's
local plan; the plan materialises write items only for the rank it is asked for, and
:mod:`cloudckpt.planning.save.share` cuts every rank's share out of it for the others (any rank
running it on the same local plans would get the same skeleton). Work over other ranks'
pieces is vectorised (numpy over all pieces at once): no per-piece Python objects.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import numpy as np
import xxhash

from cloudckpt.errors import CoverageError, LayoutMismatchError, PlanningError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.planning.coverage import find_cover_defect, slab_segments_ok, sort_boxes
from cloudckpt.planning.pieces import PieceHeader, region_str
from cloudckpt.planning.save import replicas
from cloudckpt.planning.save.local_plan import LocalSavePlan
from cloudckpt.planning.save.replicas import ReplicaBoxes, assign_replicas, cut_dim


@dataclass(frozen=True)
class WriteItem:
    """One chunk this rank writes: the box ``offsets`` / ``sizes`` (global) of its local piece
    ``piece_index``, starting at ``within`` inside that piece: the whole piece when ``sizes``
    are the piece's, otherwise a row range of a replicated piece (see
    :mod:`cloudckpt.planning.save.replicas`)."""

    chunk_id: int
    name: str
    piece_index: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    within: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class ManifestSkeleton:
    """Every tensor of the checkpoint and its chunks, before any byte is written.

    Tensor ``i`` (``names[i]``, ``dtypes[i]``, ``shapes[i]``) owns chunk ids
    ``chunk_start[i]:chunk_start[i+1]``, sorted by offsets. Per chunk id: ``offsets`` / ``sizes``
    (``(num_chunks, width)``, padded past the tensor's ndim with 0 / 1), ``writer`` rank and
    ``nbytes``.
    """

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    chunk_start: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    writer: np.ndarray
    nbytes: np.ndarray

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_start[-1])

    def tensor_index(self, name: str) -> int:
        index: dict[str, int] | None = self.__dict__.get("_index")
        if index is None:
            index = {n: i for i, n in enumerate(self.names)}
            object.__setattr__(self, "_index", index)
        return index[name]

    def chunks_of(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(offsets ``(n, ndim)``, sizes ``(n, ndim)``, writer ranks ``(n,)``) of tensor
        ``name``."""
        i = self.tensor_index(name)
        s, e, nd = int(self.chunk_start[i]), int(self.chunk_start[i + 1]), len(self.shapes[i])
        return self.offsets[s:e, :nd], self.sizes[s:e, :nd], self.writer[s:e]

    def chunk_tensor(self) -> np.ndarray:
        """Tensor index of every chunk id."""
        return np.repeat(np.arange(len(self.names), dtype=np.int64), np.diff(self.chunk_start))

    def flat_coords(self) -> tuple[np.ndarray, np.ndarray]:
        """Chunk offsets and sizes flattened chunk-major, each chunk giving its tensor's ndim
        numbers."""
        ndims = np.array([len(s) for s in self.shapes], dtype=np.int64)[self.chunk_tensor()]
        mask = np.arange(self.offsets.shape[1]) < ndims[:, None]
        return self.offsets[mask], self.sizes[mask]

    def digest(self) -> bytes:
        """16-byte hash of the whole skeleton (ranks may compare it to confirm they agree;
        XXH3-128: a 16,384-rank plan's 100 MB of columns in a few hundredths of a second)."""
        h = xxhash.xxh3_128()
        h.update(repr((self.names, self.dtypes, self.shapes)).encode())
        for arr in (self.chunk_start, self.offsets, self.sizes, self.writer):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).data)
        return bytes(h.digest())


@dataclass(frozen=True, eq=False)
class GlobalSavePlan:
    """The global plan as rank ``rank`` sees it: its ``writes`` (piece order), the whole
    ``skeleton`` and ``value_owner`` (value name -> lowest rank holding it).

    ``writer_piece`` / ``within`` (per chunk id: the writer's piece index, and where the chunk
    starts inside that piece) let :meth:`for_rank` give any other rank's share of the same plan
    without planning again."""

    world_size: int
    rank: int
    writes: tuple[WriteItem, ...]
    skeleton: ManifestSkeleton
    value_owner: dict[str, int]
    writer_piece: np.ndarray
    within: np.ndarray

    def for_rank(self, rank: int) -> GlobalSavePlan:
        """The same plan as rank ``rank`` gets it (its own ``writes``)."""
        if not 0 <= rank < self.world_size:
            raise PlanningError(f"rank {rank} outside world of {self.world_size}")
        writes = _rank_writes(self.skeleton, self.writer_piece, self.within, rank)
        return GlobalSavePlan(
            self.world_size,
            rank,
            writes,
            self.skeleton,
            self.value_owner,
            self.writer_piece,
            self.within,
        )


def _rank_writes(
    sk: ManifestSkeleton, writer_piece: np.ndarray, within: np.ndarray, rank: int
) -> tuple[WriteItem, ...]:
    """Rank ``rank``'s write items, in piece order."""
    mine = np.flatnonzero(sk.writer == rank)
    mine = mine[np.argsort(writer_piece[mine], kind="stable")]
    if not len(mine):
        return ()
    tensor = np.searchsorted(sk.chunk_start, mine, side="right") - 1
    ndims = [len(sk.shapes[g]) for g in tensor.tolist()]
    offs, sizes, ins = sk.offsets[mine].tolist(), sk.sizes[mine].tolist(), within[mine].tolist()
    return tuple(
        WriteItem(c, sk.names[g], p, tuple(o[:nd]), tuple(z[:nd]), nb, tuple(w[:nd]))
        for c, g, p, o, z, nb, w, nd in zip(
            mine.tolist(),
            tensor.tolist(),
            writer_piece[mine].tolist(),
            offs,
            sizes,
            sk.nbytes[mine].tolist(),
            ins,
            ndims,
        )
    )


def _union_names(
    plans: Sequence[LocalSavePlan],
) -> tuple[list[str], list[str], list[tuple[int, ...]], dict[str, int], list[np.ndarray]]:
    names: list[str] = []
    dtypes: list[str] = []
    shapes: list[tuple[int, ...]] = []
    index: dict[str, int] = {}
    maps: list[np.ndarray] = []
    prev_header: PieceHeader | None = None
    prev_map = np.empty(0, dtype=np.int64)
    for p in plans:
        h = p.table.header
        if prev_header is not None and h.same_as(prev_header):
            maps.append(prev_map)
            continue
        m = np.empty(len(h.names), dtype=np.int64)
        for i, (n, d, s) in enumerate(zip(h.names, h.dtypes, h.shapes)):
            g = index.get(n)
            if g is None:
                g = index[n] = len(names)
                names.append(n)
                dtypes.append(d)
                shapes.append(s)
            elif dtypes[g] != d or shapes[g] != s:
                _raise_layout_mismatch(plans, n)
            m[i] = g
        prev_header, prev_map = h, m
        maps.append(m)
    return names, dtypes, shapes, index, maps


def _raise_layout_mismatch(plans: Sequence[LocalSavePlan], name: str) -> NoReturn:
    groups: dict[tuple[str, tuple[int, ...]], list[int]] = {}
    for p in plans:
        i = p.table.header.index.get(name)
        if i is not None:
            h = p.table.header
            groups.setdefault((h.dtypes[i], h.shapes[i]), []).append(p.rank)
    detail = "; ".join(f"ranks {rs} have {d} {s}" for (d, s), rs in groups.items())
    raise LayoutMismatchError(f"tensor {name!r}: ranks disagree on dtype or global shape: {detail}")


def _value_owner(plans: Sequence[LocalSavePlan], tensor_index: dict[str, int]) -> dict[str, int]:
    owner: dict[str, int] = {}
    prev = None
    for p in plans:
        if prev is not None and p.value_names == prev:
            continue
        for v in p.value_names:
            if v not in owner:
                if v in tensor_index:
                    holders = [q.rank for q in plans if v in q.table.header.index]
                    raise LayoutMismatchError(
                        f"{v!r} is a tensor on ranks {holders} and a value on rank {p.rank}"
                    )
                owner[v] = p.rank
        prev = p.value_names
    return owner


def plan_global_save(
    local_plans: Sequence[LocalSavePlan],
    *,
    rank: int,
    replicas_to_lowest_rank: bool = False,
    replica_piece_bytes: int | None = None,
    rate_weights: Sequence[float] | None = None,
) -> GlobalSavePlan:
    """Merge every rank's local plan into this rank's :class:`GlobalSavePlan` (see module doc).

    ``local_plans[i]`` must be rank ``i``'s plan. Validates that ranks agree on each tensor's
    dtype and global shape (:class:`~cloudckpt.errors.LayoutMismatchError` naming the tensor and
    ranks) and that the pieces cover every tensor exactly, identical replicas aside
    (:class:`~cloudckpt.errors.CoverageError` naming the tensor and region). Each distinct box
    becomes one chunk written by one holder, except large replicated boxes, cut into row ranges
    of at least ``replica_piece_bytes`` (default
    :data:`~cloudckpt.planning.save.replicas.REPLICA_PIECE_BYTES`) written by different holders so
    that every rank writes about its fair share: in proportion to ``rate_weights`` (one per rank,
    :func:`cloudckpt.planning.save.rates.replica_weights`) when given, else evenly
    (:mod:`cloudckpt.planning.save.replicas`); with ``replicas_to_lowest_rank``
    every replicated box goes whole to its lowest holder. Empty pieces are not written.
    """
    world = len(local_plans)
    if world == 0:
        raise PlanningError("no local plans")
    for i, p in enumerate(local_plans):
        if p.rank != i or p.world_size != world:
            raise PlanningError(
                f"local_plans[{i}] is rank {p.rank} of {p.world_size}; expected rank {i} of {world}"
            )
    if not 0 <= rank < world:
        raise PlanningError(f"rank {rank} outside world of {world}")
    names, dtypes, shapes, index, maps = _union_names(local_plans)
    value_owner = _value_owner(local_plans, index)
    n_names = len(names)
    width = max([len(s) for s in shapes], default=0) or 1
    gshape = np.ones((n_names, width), dtype=np.int64)
    ndims = np.zeros(n_names, dtype=np.int64)
    for i, s in enumerate(shapes):
        gshape[i, : len(s)] = s
        ndims[i] = len(s)
    itemsizes = np.array([DTYPE_ITEMSIZE[d] for d in dtypes], dtype=np.int64)

    tables = [p.table for p in local_plans]
    counts = np.array([len(t) for t in tables], dtype=np.int64)
    gname = (
        np.concatenate([m[t.name_index] for m, t in zip(maps, tables)])
        if n_names
        else np.zeros(0, np.int64)
    )
    rows = len(gname)
    row_rank = np.repeat(np.arange(world, dtype=np.int64), counts)
    row_piece = np.arange(rows, dtype=np.int64) - np.repeat(
        np.concatenate(([0], np.cumsum(counts)[:-1])), counts
    )
    off = np.zeros((rows, width), dtype=np.int64)
    size = np.ones((rows, width), dtype=np.int64)
    mask = np.arange(width) < ndims[gname][:, None]
    off[mask] = np.concatenate([t.offsets for t in tables]) if rows else []
    size[mask] = np.concatenate([t.sizes for t in tables]) if rows else []
    row_shape = gshape[gname]
    bad = ((off < 0) | (size < 0) | (off + size > row_shape)).any(axis=1)
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        g, nd = int(gname[r]), int(ndims[gname[r]])
        raise CoverageError(
            f"tensor {names[g]!r}: piece {region_str(off[r, :nd], size[r, :nd])} of rank "
            f"{int(row_rank[r])} is outside the global shape {shapes[g]}"
        )
    nonempty = (size > 0).all(axis=1)
    if nonempty.all():  # the common case: nothing to drop, sort the rows as they are
        order = sort_boxes(gname, off, n_names)
    else:
        keep = np.flatnonzero(nonempty)
        order = keep[sort_boxes(gname[keep], off[keep], n_names)]
    s_g, s_off, s_size, s_rank, s_piece = (
        gname[order],
        off[order],
        size[order],
        row_rank[order],
        row_piece[order],
    )
    same = (s_g[1:] == s_g[:-1]) & (s_off[1:] == s_off[:-1]).all(axis=1)
    clash = same & (s_size[1:] != s_size[:-1]).any(axis=1)
    if clash.any():
        r = int(np.flatnonzero(clash)[0]) + 1
        g, nd = int(s_g[r]), int(ndims[s_g[r]])
        inter = np.minimum(s_size[r], s_size[r - 1])
        raise CoverageError(
            f"tensor {names[g]!r}: pieces overlap at {region_str(s_off[r, :nd], inter[:nd])} "
            f"(ranks {int(s_rank[r - 1])} and {int(s_rank[r])} hold different boxes there; "
            "only identical replicas may overlap)"
        )
    run_start = (
        np.flatnonzero(np.concatenate(([True], ~same))) if len(s_g) else np.zeros(0, np.int64)
    )
    run_len = np.diff(np.concatenate((run_start, [len(s_g)])))
    u_g, u_off, u_size = s_g[run_start], s_off[run_start], s_size[run_start]
    u_nbytes = u_size.prod(axis=1) * itemsizes[u_g]
    chunk_start = np.searchsorted(u_g, np.arange(n_names + 1)).astype(np.int64)
    _check_coverage(names, shapes, ndims, gshape, chunk_start, u_g, u_off, u_size)

    writer = s_rank[run_start].copy()
    writer_piece = s_piece[run_start].copy()
    within = np.zeros_like(u_off)
    if not replicas_to_lowest_rank:
        boxes = ReplicaBoxes(
            run_start=run_start,
            run_len=run_len,
            nbytes=u_nbytes,
            size=u_size,
            ndim=ndims[u_g],
            hold_rank=s_rank,
            hold_piece=s_piece,
        )
        piece_bytes = (
            replicas.REPLICA_PIECE_BYTES if replica_piece_bytes is None else replica_piece_bytes
        )
        assigned = assign_replicas(
            boxes,
            world_size=world,
            piece_bytes=piece_bytes,
            weights=rate_weights,
        )
        writer, writer_piece = assigned.writer, assigned.writer_piece
        if assigned.cuts:
            u_g, u_off, u_size, u_nbytes, writer, writer_piece, within = _apply_cuts(
                assigned.cuts,
                u_g,
                u_off,
                u_size,
                u_nbytes,
                writer,
                writer_piece,
                itemsizes,
                ndims,
                run_start,
                s_rank,
                s_piece,
                n_names,
            )
            chunk_start = np.searchsorted(u_g, np.arange(n_names + 1)).astype(np.int64)
    skeleton = ManifestSkeleton(
        tuple(names), tuple(dtypes), tuple(shapes), chunk_start, u_off, u_size, writer, u_nbytes
    )
    for arr in (chunk_start, u_off, u_size, writer, u_nbytes, writer_piece, within):
        arr.flags.writeable = False
    writes = _rank_writes(skeleton, writer_piece, within, rank)
    return GlobalSavePlan(world, rank, writes, skeleton, value_owner, writer_piece, within)


def _apply_cuts(
    cut: Mapping[int, tuple[tuple[int, int, int], ...]],
    u_g: np.ndarray,
    u_off: np.ndarray,
    u_size: np.ndarray,
    u_nbytes: np.ndarray,
    writer: np.ndarray,
    writer_piece: np.ndarray,
    itemsizes: np.ndarray,
    ndims: np.ndarray,
    run_start: np.ndarray,
    s_rank: np.ndarray,
    s_piece: np.ndarray,
    n_names: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Replace each cut box by its row-range pieces; returns the chunk arrays (re-sorted by
    tensor and offsets) and each chunk's offsets inside its writer's piece."""
    counts = np.ones(len(u_g), dtype=np.int64)
    for u, pieces in cut.items():
        counts[u] = len(pieces)
    parent = np.repeat(np.arange(len(u_g), dtype=np.int64), counts)
    first = np.concatenate(([0], np.cumsum(counts)[:-1]))
    g, off, size = u_g[parent], u_off[parent], u_size[parent].copy()
    nbytes, wr, wp = u_nbytes[parent], writer[parent], writer_piece[parent]
    within = np.zeros_like(off)
    for u, pieces in cut.items():
        d = cut_dim(u_size[u], int(ndims[u_g[u]]))
        for k, (start, rows, pos) in enumerate(pieces):
            c = int(first[u]) + k
            off[c, d] += start
            size[c, d] = rows
            within[c, d] = start
            wr[c], wp[c] = s_rank[run_start[u] + pos], s_piece[run_start[u] + pos]
    nbytes = size.prod(axis=1) * itemsizes[g]
    order = sort_boxes(g, off, n_names)
    return g[order], off[order], size[order], nbytes[order], wr[order], wp[order], within[order]


def _check_coverage(
    names: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    ndims: np.ndarray,
    gshape: np.ndarray,
    chunk_start: np.ndarray,
    u_g: np.ndarray,
    u_off: np.ndarray,
    u_size: np.ndarray,
) -> None:
    seg_len = np.diff(chunk_start)
    nonempty = np.flatnonzero(seg_len > 0)
    for g in np.flatnonzero(seg_len == 0).tolist():
        if int(np.prod(shapes[g], dtype=np.int64)) > 0:
            whole = region_str((0,) * len(shapes[g]), shapes[g])
            raise CoverageError(
                f"tensor {names[g]!r}: pieces leave a gap at {whole} (no rank holds any of it)"
            )
    if not len(nonempty):
        return
    seg = np.concatenate(
        (chunk_start[nonempty], [chunk_start[nonempty[-1] + 1]])
    )  # tensors without rows skipped
    ok = slab_segments_ok(seg, gshape[u_g], u_off, u_size)
    for g in nonempty[~ok].tolist():
        s, e, nd = int(chunk_start[g]), int(chunk_start[g + 1]), int(ndims[g])
        defect = find_cover_defect(shapes[g], u_off[s:e, :nd], u_size[s:e, :nd])
        if defect is not None:
            kind, o, sz = defect
            if kind == "irregular":
                raise CoverageError(
                    f"tensor {names[g]!r}: pieces are laid out too irregularly to check "
                    "that they cover it exactly once; use a regular sharding"
                )
            what = (
                "leave a gap" if kind == "gap" else "overlap (only identical replicas may overlap)"
            )
            raise CoverageError(f"tensor {names[g]!r}: pieces {what} at {region_str(o, sz)}")
