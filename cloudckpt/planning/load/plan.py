"""Load planning: which stored bytes fill which requested pieces.

For every requested piece and every stored chunk of the same name, their N-d overlap becomes a
:class:`ReadItem`. A manifest's chunks are indexed once (see
:mod:`cloudckpt.planning.load.chunk_index`), so requests find their chunks by binary search, not by
scanning them all. Plans are columnar
(:class:`ReadTable`); :class:`ReadItem` objects are made on access.

dtype: a request may ask for another dtype than the stored one; the reader converts (values
cast like ``torch.Tensor.to``). Read sizes (``nbytes``) are always in the stored dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import overload

import numpy as np
import numpy.typing as npt

from cloudckpt.errors import MissingKeysError, PlanningError, ShapeMismatchError
from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.load.chunk_index import SCAN_CHUNKS, manifest_index, padded_rows
from cloudckpt.planning.load.hints import missing_names_message
from cloudckpt.planning.pieces import PieceSpec


def shared_tuples() -> Callable[[Iterable[int]], tuple[int, ...]]:
    """``same(ints)``: a tuple of ``ints``, the one made before for equal ints (boxes repeat a
    lot: whole tensors at offset 0, shards of equal sizes); fewer live objects means fewer
    collections by Python's garbage collector, whose full passes over a process holding torch
    cost tens of milliseconds."""
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}

    def same(ints: Iterable[int]) -> tuple[int, ...]:
        t = tuple(ints)
        return seen.setdefault(t, t)

    return same


@dataclass(frozen=True, slots=True)
class Region:
    """A box inside one stored chunk (offsets relative to the chunk's own origin)."""

    name: str
    chunk_index: int
    src_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class ReadItem:
    """Copy the stored box ``src_offsets`` + ``lengths`` of chunk ``chunk_index`` of ``name`` into
    request ``request_index`` at ``dest_offsets`` (both relative to their own origin)."""

    request_index: int
    name: str
    chunk_index: int
    dest_offsets: tuple[int, ...]
    src_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int
    broadcastable: bool

    @property
    def region(self) -> Region:
        return Region(self.name, self.chunk_index, self.src_offsets, self.lengths, self.nbytes)


class ReadTable(Sequence[ReadItem]):
    """Read items as columns; a read-only ``Sequence[ReadItem]``.

    ``names`` / ``ndims``: the distinct tensor names; per item ``name_index``, ``request_index``,
    ``chunk_index``, ``nbytes``, ``broadcastable``; ``dest_offsets``, ``src_offsets``, ``lengths``
    flat (each item contributes its tensor's ndim numbers).
    """

    __slots__ = (
        "names",
        "ndims",
        "name_index",
        "request_index",
        "chunk_index",
        "dest_offsets",
        "src_offsets",
        "lengths",
        "nbytes",
        "broadcastable",
        "__dict__",
    )

    def __init__(
        self,
        names: Sequence[str],
        ndims: npt.ArrayLike,
        name_index: npt.ArrayLike,
        request_index: npt.ArrayLike,
        chunk_index: npt.ArrayLike,
        dest_offsets: npt.ArrayLike,
        src_offsets: npt.ArrayLike,
        lengths: npt.ArrayLike,
        nbytes: npt.ArrayLike,
        broadcastable: npt.ArrayLike,
    ):
        self.names = names if type(names) is tuple else tuple(names)
        self.ndims = np.asarray(ndims, dtype=np.int64).reshape(-1)
        cols = [
            np.asarray(c, dtype=np.int64).reshape(-1)
            for c in (
                name_index,
                request_index,
                chunk_index,
                dest_offsets,
                src_offsets,
                lengths,
                nbytes,
            )
        ]
        (
            self.name_index,
            self.request_index,
            self.chunk_index,
            self.dest_offsets,
            self.src_offsets,
            self.lengths,
            self.nbytes,
        ) = cols
        self.broadcastable = np.asarray(broadcastable, dtype=bool).reshape(-1)
        n = len(self.name_index)
        if len(self.ndims) != len(self.names) or any(
            len(c) != n
            for c in (self.request_index, self.chunk_index, self.nbytes, self.broadcastable)
        ):
            raise PlanningError("read table columns differ in length")
        if n and (self.name_index.min() < 0 or self.name_index.max() >= len(self.names)):
            raise PlanningError("read table refers to an unknown name")
        ncoords = int(self.ndims[self.name_index].sum()) if n else 0
        if not len(self.dest_offsets) == len(self.src_offsets) == len(self.lengths) == ncoords:
            raise PlanningError("read table coordinates do not match the tensors' ndims")

    @classmethod
    def from_items(cls, items: Sequence[ReadItem]) -> ReadTable:
        index: dict[str, int] = {}
        names: list[str] = []
        ndims: list[int] = []
        cols: tuple[list[int], ...] = ([], [], [], [], [], [], [], [], [])
        for it in items:
            i = index.get(it.name)
            if i is None:
                i = index[it.name] = len(names)
                names.append(it.name)
                ndims.append(len(it.lengths))
            for col, v in zip(
                cols, (i, it.request_index, it.chunk_index, it.nbytes, it.broadcastable)
            ):
                col.append(v)
            cols[5].extend(it.dest_offsets)
            cols[6].extend(it.src_offsets)
            cols[7].extend(it.lengths)
        table = cls(
            names, ndims, cols[0], cols[1], cols[2], cols[5], cols[6], cols[7], cols[3], cols[4]
        )
        table.__dict__["_items"] = tuple(items)
        return table

    @cached_property
    def coord_start(self) -> np.ndarray:
        nd = self.ndims[self.name_index] if len(self.name_index) else np.zeros(0, np.int64)
        return np.concatenate(([0], np.cumsum(nd))).astype(np.int64)

    def __len__(self) -> int:
        return len(self.name_index)

    def items(self) -> list[ReadItem]:
        """Every read item, in order (each column read once: much cheaper than indexing the
        table item by item)."""
        given = self.__dict__.get("_items")
        if given is not None:
            return list(given)
        cs = self.coord_start.tolist()
        dest, src, lengths = (
            self.dest_offsets.tolist(),
            self.src_offsets.tolist(),
            self.lengths.tolist(),
        )
        names = self.names
        same = shared_tuples()
        return [
            ReadItem(r, names[n], c, same(dest[a:b]), same(src[a:b]), same(lengths[a:b]), nb, bc)
            for r, n, c, a, b, nb, bc in zip(
                self.request_index.tolist(),
                self.name_index.tolist(),
                self.chunk_index.tolist(),
                cs[:-1],
                cs[1:],
                self.nbytes.tolist(),
                self.broadcastable.tolist(),
            )
        ]

    def __iter__(self) -> Iterator[ReadItem]:
        return iter(self.items())

    @overload
    def __getitem__(self, i: int) -> ReadItem: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[ReadItem, ...]: ...
    def __getitem__(self, i: int | slice) -> ReadItem | tuple[ReadItem, ...]:
        items: tuple[ReadItem, ...] | None = self.__dict__.get("_items")
        if items is not None:
            return items[i]
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        s, e = int(self.coord_start[i]), int(self.coord_start[i + 1])
        return ReadItem(
            int(self.request_index[i]),
            self.names[int(self.name_index[i])],
            int(self.chunk_index[i]),
            tuple(self.dest_offsets[s:e].tolist()),
            tuple(self.src_offsets[s:e].tolist()),
            tuple(self.lengths[s:e].tolist()),
            int(self.nbytes[i]),
            bool(self.broadcastable[i]),
        )


@dataclass(frozen=True, eq=False)
class LocalLoadPlan:
    """One rank's reads; ``unexpected``: names in the checkpoint (tensors and values) it did not
    request; ``missing``: requested names absent from the checkpoint (only in non-strict mode)."""

    rank: int
    reads: Sequence[ReadItem]
    unexpected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        table = (
            self.reads
            if isinstance(self.reads, ReadTable)
            else ReadTable.from_items(tuple(self.reads))
        )
        if not isinstance(self.reads, ReadTable):
            object.__setattr__(self, "reads", tuple(self.reads))
        object.__setattr__(self, "unexpected", tuple(self.unexpected))
        object.__setattr__(self, "missing", tuple(self.missing))
        object.__setattr__(self, "_table", table)

    @property
    def table(self) -> ReadTable:
        table: ReadTable = self.__dict__["_table"]  # set in __post_init__
        return table

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalLoadPlan):
            return NotImplemented
        return (self.rank, tuple(self.reads), self.unexpected, self.missing) == (
            other.rank,
            tuple(other.reads),
            other.unexpected,
            other.missing,
        )

    __hash__ = None  # type: ignore[assignment]


def plan_local_load(
    manifest: Manifest,
    requests: Sequence[PieceSpec],
    *,
    rank: int,
    value_names: Sequence[str] = (),
    strict: bool = True,
) -> LocalLoadPlan:
    """Plan this rank's reads for ``requests`` (the pieces it wants filled, in its order).

    Read items come in request order, and within a request in the order of the stored chunks'
    offsets. Raises :class:`~cloudckpt.errors.MissingKeysError` listing requested tensors and
    ``value_names`` absent from the checkpoint (when ``strict``; otherwise they go to
    ``missing``), :class:`~cloudckpt.errors.ShapeMismatchError` naming both shapes when a global
    shape differs, and :class:`~cloudckpt.errors.CoverageError` naming the region when the stored
    chunks would not fill a requested element exactly once.
    """
    idx = manifest_index(manifest)
    width = idx.width
    n = len(requests)
    req_names = [r.name for r in requests]
    tensor_of = idx.tensor_of
    t_all = np.fromiter((tensor_of.get(name, -1) for name in req_names), np.int64, n)
    missing: list[str] = list(
        dict.fromkeys(name for name, t in zip(req_names, t_all.tolist()) if t < 0)
    )
    # every request's global shape, offsets and sizes as padded columns (a PieceSpec's three
    # have one length, checked when it was made)
    nd = np.fromiter((len(r.global_shape) for r in requests), np.int64, n)
    w = max(width, int(nd.max(initial=0)))
    shape = padded_rows((r.global_shape for r in requests), nd, w, 1)
    off = padded_rows((r.offsets for r in requests), nd, w, 0)
    size = padded_rows((r.sizes for r in requests), nd, w, 1)
    found = t_all >= 0
    tt = np.where(found, t_all, 0)
    stored = np.ones((n, w), dtype=np.int64)
    stored[:, :width] = idx.shape[tt]
    wrong = found & ((nd != idx.ndims[tt]) | (shape != stored).any(axis=1))
    if wrong.any():
        i = int(np.flatnonzero(wrong)[0])
        raise ShapeMismatchError(
            f"tensor {req_names[i]!r}: checkpoint has global shape "
            f"{manifest.shapes[int(t_all[i])]}, the state dict has "
            f"{requests[i].global_shape}"
        )
    r_index = np.flatnonzero(found & (size > 0).all(axis=1))  # empty pieces read nothing
    positions: dict[str, int] = {}
    r_name = [positions.setdefault(req_names[i], len(positions)) for i in r_index.tolist()]
    names = list(positions)
    ndims = idx.ndims[tensor_of_names(tensor_of, names)] if names else []
    r_bcast = np.fromiter((bool(r.broadcastable) for r in requests), bool, n)[r_index]
    t_arr = t_all[r_index]
    off, end = off[r_index, :width], (off + size)[r_index, :width]
    for v in value_names:
        if v not in manifest.values and v not in missing:
            missing.append(v)
    if missing and strict:
        raise MissingKeysError(missing_names_message(missing), keys=tuple(missing))
    wanted = set(req_names) | set(value_names)
    unexpected = tuple(
        name for name in list(manifest.tensors) + list(manifest.values) if name not in wanted
    )

    slab = idx.slab_ok[t_arr] & idx.vectorised if len(t_arr) else np.zeros(0, dtype=bool)
    rows_s = np.flatnonzero(slab)
    parts_r, parts_pos = [], []
    if len(rows_s):
        req_s, pos_s = idx.slab_hits(t_arr[rows_s], off[rows_s], end[rows_s])
        parts_r.append(rows_s[req_s])
        parts_pos.append(pos_s)
    rows_g = np.flatnonzero(~slab)
    if len(rows_g):
        idx.check(t_arr[rows_g])
        bad = rows_g[idx.verdict[t_arr[rows_g]] != 1]
        if len(bad):
            raise idx.coverage_error(int(t_arr[bad[0]]))
        few = (idx.seg[t_arr[rows_g] + 1] - idx.seg[t_arr[rows_g]]) <= SCAN_CHUNKS
        rows_s, rows_g = rows_g[few], rows_g[~few]
        req_s, pos_s = idx.scan_hits(t_arr[rows_s], off[rows_s], end[rows_s])
        parts_r.append(rows_s[req_s])
        parts_pos.append(pos_s)
    rows_g = rows_g[np.argsort(t_arr[rows_g], kind="stable")]
    bounds = np.flatnonzero(np.diff(t_arr[rows_g])) + 1 if len(rows_g) else rows_g
    for rows in np.split(rows_g, bounds) if len(rows_g) else ():
        t = int(t_arr[rows[0]])
        t_nd = int(idx.ndims[t])
        req, hits = idx.general(t).overlapping_many(off[rows, :t_nd], end[rows, :t_nd])
        parts_r.append(rows[req])
        parts_pos.append(idx.position_of(int(idx.chunk_start[t]) + hits))
    item_r = np.concatenate(parts_r) if parts_r else np.zeros(0, dtype=np.int64)
    pos = np.concatenate(parts_pos) if parts_pos else np.zeros(0, dtype=np.int64)
    order = np.lexsort((pos, item_r))
    item_r, pos = item_r[order], pos[order]
    lo = np.maximum(idx.s_off[pos], off[item_r])
    length = np.minimum(idx.s_end[pos], end[item_r]) - lo
    keep = np.flatnonzero((length > 0).all(axis=1))
    item_r, pos, lo, length = item_r[keep], pos[keep], lo[keep], length[keep]
    item_t = t_arr[item_r]
    mask = np.arange(width) < idx.ndims[item_t][:, None]
    table = ReadTable(
        names,
        ndims,
        np.array(r_name, dtype=np.int64)[item_r] if len(item_r) else [],
        r_index[item_r] if len(item_r) else [],
        idx.order[pos] - idx.chunk_start[item_t],
        (lo - off[item_r])[mask],
        (lo - idx.s_off[pos])[mask],
        length[mask],
        length.prod(axis=1) * idx.itemsizes[item_t],
        r_bcast[item_r] if len(item_r) else [],
    )
    return LocalLoadPlan(rank, table, unexpected, tuple(missing) if not strict else ())


def tensor_of_names(tensor_of: Mapping[str, int], names: Sequence[str]) -> np.ndarray:
    """The manifest's tensor number of each of ``names`` (all known)."""
    return np.fromiter(map(tensor_of.__getitem__, names), np.int64, len(names))
