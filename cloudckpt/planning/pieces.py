"""Pure piece descriptors: :class:`PieceSpec` and its columnar form :class:`PieceTable`.

A piece is one box (``offsets``, ``sizes``) of one global tensor (``name``, ``dtype``,
``global_shape``) held by one rank. Plans of thousands of ranks are handled as columns (a
:class:`PieceTable` per rank: a header of distinct names with their dtype and shape, plus int
arrays per piece); :class:`PieceSpec` objects are made only when asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import SupportsInt, overload

import msgpack
import numpy as np
import numpy.typing as npt

from cloudckpt.errors import LayoutMismatchError, PlanningError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS, MAX_NDIM


def region_str(offsets: Iterable[SupportsInt], sizes: Iterable[SupportsInt]) -> str:
    """A box as slices, like ``[0:4, 8:16]`` (``[]`` for a 0-d tensor)."""
    return "[" + ", ".join(f"{int(o)}:{int(o) + int(s)}" for o, s in zip(offsets, sizes)) + "]"


@dataclass(frozen=True, slots=True)
class PieceSpec:
    """One box of one global tensor held by one rank (see module doc).

    ``broadcastable`` says whether the transport can broadcast into this piece's device (False
    makes every rank read such pieces itself on load). Validated on construction:
    :class:`~cloudckpt.errors.PlanningError` for an unknown dtype, mismatched lengths, negative
    numbers or a box outside ``global_shape``.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    broadcastable: bool = True

    def __post_init__(self) -> None:
        shape = tuple(map(int, self.global_shape))
        offsets = tuple(map(int, self.offsets))
        sizes = tuple(map(int, self.sizes))
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)
        object.__setattr__(self, "sizes", sizes)
        if type(self.name) is not str:
            raise PlanningError(f"piece name must be a string, got {self.name!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise PlanningError(
                f"tensor {self.name!r}: dtype {self.dtype!r} is not supported "
                f"(allowed: {', '.join(DTYPE_ITEMSIZE)})"
            )
        if not len(shape) == len(offsets) == len(sizes) or len(shape) > MAX_NDIM:
            raise PlanningError(
                f"tensor {self.name!r}: global shape {shape}, offsets {offsets} and sizes "
                f"{sizes} must have the same length (at most {MAX_NDIM})"
            )
        for g, o, s in zip(shape, offsets, sizes):
            if g < 0 or o < 0 or s < 0 or o + s > g:
                raise PlanningError(
                    f"tensor {self.name!r}: piece {region_str(offsets, sizes)} is not inside "
                    f"global shape {shape}"
                )
        if math.prod(shape) * DTYPE_ITEMSIZE[self.dtype] > MAX_ELEMENTS:
            raise PlanningError(f"tensor {self.name!r}: global shape {shape} is too large")

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


class PieceHeader:
    """Distinct tensor names of a piece table with their dtype and global shape (immutable)."""

    __slots__ = (
        "names",
        "dtypes",
        "shapes",
        "index",
        "ndims",
        "itemsizes",
        "_packed",
        "__weakref__",
    )

    def __init__(
        self, names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[tuple[int, ...]]
    ):
        self.names = tuple(names)
        self.dtypes = tuple(dtypes)
        self.shapes = tuple(tuple(s) for s in shapes)
        self.index = {n: i for i, n in enumerate(self.names)}
        if len(self.index) != len(self.names):
            raise PlanningError("piece header lists a name twice")
        self.ndims = np.array([len(s) for s in self.shapes], dtype=np.int64)
        self.itemsizes = np.array([DTYPE_ITEMSIZE[d] for d in self.dtypes], dtype=np.int64)
        for n, s, size in zip(self.names, self.shapes, self.itemsizes.tolist()):
            if math.prod(s) * size > MAX_ELEMENTS:
                raise PlanningError(f"tensor {n!r}: global shape {s} is too large")
        self._packed: bytes | None = None

    @property
    def packed(self) -> bytes:
        """msgpack bytes ``[names, dtypes, shapes]`` (canonical for this header)."""
        if self._packed is None:
            self._packed = msgpack.packb(
                [list(self.names), list(self.dtypes), [list(s) for s in self.shapes]],
                use_bin_type=True,
            )
        return self._packed

    def same_as(self, other: PieceHeader) -> bool:
        return other is self or (
            self.names == other.names
            and self.dtypes == other.dtypes
            and self.shapes == other.shapes
        )

    @classmethod
    def unpack(cls, data: bytes) -> PieceHeader:
        """Inverse of :attr:`packed`, validating names, dtypes and shapes."""
        try:
            names, dtypes, shapes = msgpack.unpackb(data, raw=False)
        except Exception as exc:  # noqa: BLE001
            raise PlanningError(f"malformed piece header: {exc}") from exc
        if not (
            isinstance(names, list)
            and isinstance(dtypes, list)
            and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes)
        ):
            raise PlanningError("malformed piece header")
        for n, d, s in zip(names, dtypes, shapes):
            if (
                type(n) is not str
                or type(d) is not str
                or d not in DTYPE_ITEMSIZE
                or not isinstance(s, list)
                or len(s) > MAX_NDIM
                or any(type(x) is not int or x < 0 for x in s)
            ):
                raise PlanningError(f"malformed piece header entry for {n!r}")
        header = cls(names, dtypes, [tuple(s) for s in shapes])
        header._packed = bytes(data)
        return header


class PieceTable(Sequence[PieceSpec]):
    """The pieces of one rank as columns; a read-only ``Sequence[PieceSpec]``.

    ``name_index`` (per piece, into ``header.names``), ``offsets`` / ``sizes`` (flat, each piece
    contributing its tensor's ndim numbers) and ``broadcastable`` (bool per piece).
    """

    __slots__ = ("header", "name_index", "offsets", "sizes", "broadcastable", "__dict__")

    def __init__(
        self,
        header: PieceHeader,
        name_index: npt.ArrayLike,
        offsets: npt.ArrayLike,
        sizes: npt.ArrayLike,
        broadcastable: npt.ArrayLike,
    ):
        self.header = header
        self.name_index = np.asarray(name_index, dtype=np.int64).reshape(-1)
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        self.broadcastable = np.asarray(broadcastable, dtype=bool).reshape(-1)
        n = len(self.name_index)
        if len(self.broadcastable) != n:
            raise PlanningError("piece table columns differ in length")
        if n and (self.name_index.min() < 0 or self.name_index.max() >= len(header.names)):
            raise PlanningError("piece table refers to an unknown name")
        if len(self.offsets) != int(self.ndims.sum()) or len(self.sizes) != len(self.offsets):
            raise PlanningError("piece table coordinates do not match the tensors' ndims")

    @classmethod
    def from_pieces(cls, pieces: Sequence[PieceSpec], *, rank: int | None = None) -> PieceTable:
        """Columns of ``pieces``; all pieces of one name must agree on dtype and global shape."""
        index: dict[str, int] = {}
        names: list[str] = []
        dtypes: list[str] = []
        shapes: list[tuple[int, ...]] = []
        name_index: list[int] = []
        offsets: list[int] = []
        sizes: list[int] = []
        bcast: list[bool] = []
        for p in pieces:
            i = index.get(p.name)
            if i is None:
                i = index[p.name] = len(names)
                names.append(p.name)
                dtypes.append(p.dtype)
                shapes.append(p.global_shape)
            elif dtypes[i] != p.dtype or shapes[i] != p.global_shape:
                where = "" if rank is None else f" on rank {rank}"
                raise LayoutMismatchError(
                    f"tensor {p.name!r}: pieces{where} disagree: {dtypes[i]} {shapes[i]} vs "
                    f"{p.dtype} {p.global_shape}"
                )
            name_index.append(i)
            offsets.extend(p.offsets)
            sizes.extend(p.sizes)
            bcast.append(p.broadcastable)
        table = cls(PieceHeader(names, dtypes, shapes), name_index, offsets, sizes, bcast)
        table.__dict__["_specs"] = tuple(pieces)
        return table

    @cached_property
    def ndims(self) -> np.ndarray:
        return self.header.ndims[self.name_index]

    @cached_property
    def coord_start(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.ndims))).astype(np.int64)

    def padded(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """Offsets and sizes as ``(n, width)`` arrays (missing dims: offset 0, size 1)."""
        n = len(self.name_index)
        off = np.zeros((n, width), dtype=np.int64)
        size = np.ones((n, width), dtype=np.int64)
        mask = np.arange(width) < self.ndims[:, None]
        off[mask] = self.offsets
        size[mask] = self.sizes
        return off, size

    def __len__(self) -> int:
        return len(self.name_index)

    @overload
    def __getitem__(self, i: int) -> PieceSpec: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[PieceSpec, ...]: ...
    def __getitem__(self, i: int | slice) -> PieceSpec | tuple[PieceSpec, ...]:
        specs: tuple[PieceSpec, ...] | None = self.__dict__.get("_specs")
        if specs is not None:
            return specs[i]
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        t = int(self.name_index[i])
        s, e = int(self.coord_start[i]), int(self.coord_start[i + 1])
        h = self.header
        return PieceSpec(
            h.names[t],
            h.dtypes[t],
            h.shapes[t],
            tuple(self.offsets[s:e].tolist()),
            tuple(self.sizes[s:e].tolist()),
            bool(self.broadcastable[i]),
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PieceTable):
            return NotImplemented
        return (
            self.header.same_as(other.header)
            and np.array_equal(self.name_index, other.name_index)
            and np.array_equal(self.offsets, other.offsets)
            and np.array_equal(self.sizes, other.sizes)
            and np.array_equal(self.broadcastable, other.broadcastable)
        )

    __hash__ = None  # type: ignore[assignment]
