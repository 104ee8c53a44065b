"""Load planning: which stored bytes fill which requested pieces.

For every requested piece and every stored chunk of the same name, their N-d overlap becomes a
:class:`ReadItem`. Chunks of each stored tensor are indexed once (sorted along the dimension
where their starts differ most), so a request finds its chunks by binary search, not by scanning
them all. Plans are columnar (:class:`ReadTable`); :class:`ReadItem` objects are made on access.

dtype: a request may ask for another dtype than the stored one; the reader converts (values
cast like ``torch.Tensor.to``). Read sizes (``nbytes``) are always in the stored dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import msgpack
import numpy as np

from cloudckpt.errors import CoverageError, MissingKeysError, PlanningError, ShapeMismatchError
from cloudckpt.manifest.columns import ColumnError, decode_int_column, encode_int_column
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_NDIM
from cloudckpt.manifest.model import Manifest, TensorRecord
from cloudckpt.planning.coverage import find_cover_defect
from cloudckpt.planning.pieces import PieceSpec, region_str

LOAD_PLAN_FORMAT = "cloudckpt.load_plan"


@dataclass(frozen=True)
class Region:
    """A box inside one stored chunk (offsets relative to the chunk's own origin)."""

    name: str
    chunk_index: int
    src_offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
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


class ReadTable(Sequence):
    """Read items as columns; a read-only ``Sequence[ReadItem]``.

    ``names`` / ``ndims``: the distinct tensor names; per item ``name_index``, ``request_index``,
    ``chunk_index``, ``nbytes``, ``broadcastable``; ``dest_offsets``, ``src_offsets``, ``lengths``
    flat (each item contributes its tensor's ndim numbers).
    """

    __slots__ = ("names", "ndims", "name_index", "request_index", "chunk_index", "dest_offsets",
                 "src_offsets", "lengths", "nbytes", "broadcastable", "__dict__")

    def __init__(self, names, ndims, name_index, request_index, chunk_index, dest_offsets, src_offsets,
                 lengths, nbytes, broadcastable):
        self.names = tuple(names)
        self.ndims = np.asarray(ndims, dtype=np.int64).reshape(-1)
        cols = [np.asarray(c, dtype=np.int64).reshape(-1) for c in
                (name_index, request_index, chunk_index, dest_offsets, src_offsets, lengths, nbytes)]
        (self.name_index, self.request_index, self.chunk_index, self.dest_offsets, self.src_offsets,
         self.lengths, self.nbytes) = cols
        self.broadcastable = np.asarray(broadcastable, dtype=bool).reshape(-1)
        n = len(self.name_index)
        if len(self.ndims) != len(self.names) or any(len(c) != n for c in (
                self.request_index, self.chunk_index, self.nbytes, self.broadcastable)):
            raise PlanningError("read table columns differ in length")
        if n and (self.name_index.min() < 0 or self.name_index.max() >= len(self.names)):
            raise PlanningError("read table refers to an unknown name")
        ncoords = int(self.ndims[self.name_index].sum()) if n else 0
        if not len(self.dest_offsets) == len(self.src_offsets) == len(self.lengths) == ncoords:
            raise PlanningError("read table coordinates do not match the tensors' ndims")

    @classmethod
    def from_items(cls, items: Sequence[ReadItem]) -> "ReadTable":
        index: dict[str, int] = {}
        names, ndims, cols = [], [], ([], [], [], [], [], [], [], [], [])
        for it in items:
            i = index.get(it.name)
            if i is None:
                i = index[it.name] = len(names)
                names.append(it.name)
                ndims.append(len(it.lengths))
            for col, v in zip(cols, (i, it.request_index, it.chunk_index, it.nbytes, it.broadcastable)):
                col.append(v)
            cols[5].extend(it.dest_offsets)
            cols[6].extend(it.src_offsets)
            cols[7].extend(it.lengths)
        table = cls(names, ndims, cols[0], cols[1], cols[2], cols[5], cols[6], cols[7], cols[3], cols[4])
        table.__dict__["_items"] = tuple(items)
        return table

    @cached_property
    def coord_start(self) -> np.ndarray:
        nd = self.ndims[self.name_index] if len(self.name_index) else np.zeros(0, np.int64)
        return np.concatenate(([0], np.cumsum(nd))).astype(np.int64)

    def __len__(self) -> int:
        return len(self.name_index)

    def __getitem__(self, i):
        items = self.__dict__.get("_items")
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
        return ReadItem(int(self.request_index[i]), self.names[int(self.name_index[i])], int(self.chunk_index[i]),
                        tuple(self.dest_offsets[s:e].tolist()), tuple(self.src_offsets[s:e].tolist()),
                        tuple(self.lengths[s:e].tolist()), int(self.nbytes[i]), bool(self.broadcastable[i]))


@dataclass(frozen=True, eq=False)
class LocalLoadPlan:
    """One rank's reads; ``unexpected``: names in the checkpoint (tensors and values) it did not
    request; ``missing``: requested names absent from the checkpoint (only in non-strict mode)."""

    rank: int
    reads: Sequence[ReadItem]
    unexpected: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        table = self.reads if isinstance(self.reads, ReadTable) else ReadTable.from_items(tuple(self.reads))
        if not isinstance(self.reads, ReadTable):
            object.__setattr__(self, "reads", tuple(self.reads))
        object.__setattr__(self, "unexpected", tuple(self.unexpected))
        object.__setattr__(self, "missing", tuple(self.missing))
        object.__setattr__(self, "_table", table)

    @property
    def table(self) -> ReadTable:
        return self._table  # type: ignore[attr-defined]

    def __eq__(self, other) -> bool:
        if not isinstance(other, LocalLoadPlan):
            return NotImplemented
        return (self.rank, tuple(self.reads), self.unexpected, self.missing) == \
            (other.rank, tuple(other.reads), other.unexpected, other.missing)

    __hash__ = None  # type: ignore[assignment]


class _ChunkIndex:
    """Chunks of one stored tensor sorted along one axis, verified to tile the tensor exactly."""

    def __init__(self, rec: TensorRecord):
        offsets = np.asarray(rec.chunks.offsets, dtype=np.int64)
        sizes = np.asarray(rec.chunks.sizes, dtype=np.int64)
        defect = find_cover_defect(rec.shape, offsets, sizes)
        if defect is not None:
            kind, o, s = defect
            what = "leave a gap" if kind == "gap" else "overlap"
            raise CoverageError(f"tensor {rec.name!r}: stored chunks {what} at {region_str(o, s)}; "
                                "destination elements there would not be filled exactly once")
        nonempty = np.flatnonzero(sizes.prod(axis=1) > 0)
        self.offsets, self.sizes = offsets, sizes
        self.ends = offsets + sizes
        self.itemsize = DTYPE_ITEMSIZE[rec.dtype]
        d = len(rec.shape)
        self.axis = int(np.argmax([len(np.unique(offsets[nonempty, j])) for j in range(d)])) if d else -1
        if d:
            order = nonempty[np.argsort(offsets[nonempty, self.axis], kind="stable")]
            self.order = order
            self.starts = offsets[order, self.axis]
            self.max_size = int(sizes[order, self.axis].max(initial=0))
        else:
            self.order = nonempty

    def overlapping(self, req_off: np.ndarray, req_end: np.ndarray) -> np.ndarray:
        """Indices of the chunks whose box overlaps the request box (non-empty overlap)."""
        if self.axis < 0:
            return self.order
        k = self.axis
        lo = np.searchsorted(self.starts, req_off[k] - self.max_size, side="right")
        hi = np.searchsorted(self.starts, req_end[k], side="left")
        cand = self.order[lo:hi]
        inter = np.minimum(self.ends[cand], req_end) > np.maximum(self.offsets[cand], req_off)
        return cand[inter.all(axis=1)]


def _chunk_index(manifest: Manifest, name: str) -> _ChunkIndex:
    cache = manifest.__dict__.setdefault("_cloudckpt_chunk_index", {})
    idx = cache.get(name)
    if idx is None:
        idx = cache[name] = _ChunkIndex(manifest.tensors[name])
    return idx


def plan_local_load(manifest: Manifest, requests: Sequence[PieceSpec], *, rank: int,
                    value_names: Sequence[str] = (), strict: bool = True) -> LocalLoadPlan:
    """Plan this rank's reads for ``requests`` (the pieces it wants filled, in its order).

    Raises :class:`~cloudckpt.errors.MissingKeysError` listing requested tensors and
    ``value_names`` absent from the checkpoint (when ``strict``; otherwise they go to
    ``missing``), :class:`~cloudckpt.errors.ShapeMismatchError` naming both shapes when a global
    shape differs, and :class:`~cloudckpt.errors.CoverageError` naming the region when the stored
    chunks would not fill a requested element exactly once.
    """
    names: list[str] = []
    name_pos: dict[str, int] = {}
    ndims: list[int] = []
    missing: list[str] = []
    parts: dict[str, list] = {k: [] for k in ("name", "req", "chunk", "dest", "src", "len", "nbytes", "bcast")}
    for i, req in enumerate(requests):
        rec = manifest.tensors.get(req.name)
        if rec is None:
            if req.name not in missing:
                missing.append(req.name)
            continue
        if rec.shape != req.global_shape:
            raise ShapeMismatchError(f"tensor {req.name!r}: checkpoint has global shape {rec.shape}, "
                                     f"the state dict has {req.global_shape}")
        if req.numel == 0:
            continue
        idx = _chunk_index(manifest, req.name)
        req_off = np.array(req.offsets, dtype=np.int64)
        req_end = req_off + np.array(req.sizes, dtype=np.int64)
        hits = idx.overlapping(req_off, req_end)
        lo = np.maximum(idx.offsets[hits], req_off)
        length = np.minimum(idx.ends[hits], req_end) - lo
        pos = name_pos.get(req.name)
        if pos is None:
            pos = name_pos[req.name] = len(names)
            names.append(req.name)
            ndims.append(len(rec.shape))
        n = len(hits)
        parts["name"].append(np.full(n, pos, dtype=np.int64))
        parts["req"].append(np.full(n, i, dtype=np.int64))
        parts["chunk"].append(hits)
        parts["dest"].append((lo - req_off).reshape(-1))
        parts["src"].append((lo - idx.offsets[hits]).reshape(-1))
        parts["len"].append(length.reshape(-1))
        parts["nbytes"].append(length.prod(axis=1) * idx.itemsize)
        parts["bcast"].append(np.full(n, bool(req.broadcastable)))
    for v in value_names:
        if v not in manifest.values and v not in missing:
            missing.append(v)
    if missing and strict:
        raise MissingKeysError(f"{len(missing)} names are not in the checkpoint: {', '.join(map(repr, missing))}",
                               keys=tuple(missing))
    wanted = {r.name for r in requests} | set(value_names)
    unexpected = tuple(n for n in list(manifest.tensors) + list(manifest.values) if n not in wanted)
    cols = {k: np.concatenate(v) if v else np.zeros(0, dtype=bool if k == "bcast" else np.int64)
            for k, v in parts.items()}
    table = ReadTable(names, ndims, cols["name"], cols["req"], cols["chunk"], cols["dest"], cols["src"],
                      cols["len"], cols["nbytes"], cols["bcast"])
    return LocalLoadPlan(rank, table, unexpected, tuple(missing) if not strict else ())


def encode_local_load_plan(plan: LocalLoadPlan) -> bytes:
    """msgpack bytes of a load plan (columnar; see :class:`ReadTable`)."""
    t = plan.table
    return msgpack.packb({
        "format": LOAD_PLAN_FORMAT, "version": 1, "rank": plan.rank,
        "names": list(t.names), "ndims": encode_int_column(t.ndims),
        "name_index": encode_int_column(t.name_index, delta=True),
        "request_index": encode_int_column(t.request_index, delta=True),
        "chunk_index": encode_int_column(t.chunk_index, delta=True),
        "dest_offsets": encode_int_column(t.dest_offsets, delta=True),
        "src_offsets": encode_int_column(t.src_offsets, delta=True),
        "lengths": encode_int_column(t.lengths, delta=True),
        "nbytes": encode_int_column(t.nbytes, delta=True),
        "broadcastable": np.packbits(t.broadcastable).tobytes(),
        "unexpected": list(plan.unexpected), "missing": list(plan.missing),
    }, use_bin_type=True)


def decode_local_load_plan(data: bytes) -> LocalLoadPlan:
    """Inverse of :func:`encode_local_load_plan`; raises PlanningError on malformed bytes."""
    try:
        doc = msgpack.unpackb(data, raw=False)
        if not isinstance(doc, dict) or doc.get("format") != LOAD_PLAN_FORMAT or doc.get("version") != 1:
            raise PlanningError("not a cloudckpt load plan (format/version)")
        names = doc["names"]
        if not isinstance(names, list) or any(type(n) is not str for n in names):
            raise PlanningError("bad load plan names")
        ndims = decode_int_column(doc["ndims"], expected=len(names))
        if len(ndims) and (ndims.min() < 0 or ndims.max() > MAX_NDIM):
            raise PlanningError("bad load plan ndims")
        name_index = decode_int_column(doc["name_index"])
        n = len(name_index)
        if n and (name_index.min() < 0 or name_index.max() >= len(names)):
            raise PlanningError("load plan refers to an unknown name")
        ncoords = int(ndims[name_index].sum()) if n else 0
        bits = doc["broadcastable"]
        if not isinstance(bits, bytes) or len(bits) != (n + 7) // 8:
            raise PlanningError("bad broadcastable flags")
        table = ReadTable(
            names, ndims, name_index, decode_int_column(doc["request_index"], expected=n),
            decode_int_column(doc["chunk_index"], expected=n),
            decode_int_column(doc["dest_offsets"], expected=ncoords),
            decode_int_column(doc["src_offsets"], expected=ncoords),
            decode_int_column(doc["lengths"], expected=ncoords), decode_int_column(doc["nbytes"], expected=n),
            np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).astype(bool))
        return LocalLoadPlan(int(doc["rank"]), table, tuple(doc["unexpected"]), tuple(doc["missing"]))
    except PlanningError:
        raise
    except (ColumnError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise PlanningError(f"malformed load plan: {exc}") from exc

