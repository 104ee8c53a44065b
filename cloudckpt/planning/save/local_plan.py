"""A rank's local save plan and its msgpack codec.

Encoding (msgpack map): ``format`` ``"cloudckpt.save_plan"``, ``version`` 1, ``rank``,
``world_size``, ``header`` (bytes: msgpack ``[names, dtypes, shapes]``), ``name_index`` /
``offsets`` / ``sizes`` (integer columns, see :mod:`cloudckpt.manifest.columns`),
``broadcastable`` (bytes: numpy ``packbits`` of one flag per piece) and ``values`` (``[str]``).
The encoding is canonical: equal plans give equal bytes, so :meth:`LocalSavePlan.fingerprint`
is a stable hash of the layout.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from cloudckpt.errors import LayoutMismatchError, PlanningError
from cloudckpt.manifest.columns import ColumnError, decode_int_column, encode_int_column
from cloudckpt.planning.lru import LRUCache
from cloudckpt.planning.pieces import PieceHeader, PieceSpec, PieceTable

SAVE_PLAN_FORMAT = "cloudckpt.save_plan"
HEADER_CACHE: LRUCache[bytes, PieceHeader] = LRUCache(16)
"""Decoded save plan headers by their bytes (a memo of a pure decode: never stale)."""


@dataclass(frozen=True, eq=False)
class LocalSavePlan:
    """What one rank holds: its pieces (in local order) and the names of its non-tensor values.

    ``pieces`` may be a tuple of :class:`PieceSpec` or a :class:`PieceTable` (decoded plans use
    the columnar form; it is still a ``Sequence[PieceSpec]``). The piece index used by write items
    is the position in ``pieces``.
    """

    rank: int
    world_size: int
    pieces: Sequence[PieceSpec]
    value_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not (
            type(self.world_size) is int
            and self.world_size >= 1
            and type(self.rank) is int
            and 0 <= self.rank < self.world_size
        ):
            raise PlanningError(f"bad rank {self.rank!r} / world size {self.world_size!r}")
        table = (
            self.pieces
            if isinstance(self.pieces, PieceTable)
            else PieceTable.from_pieces(tuple(self.pieces), rank=self.rank)
        )
        if not isinstance(self.pieces, PieceTable):
            object.__setattr__(self, "pieces", tuple(self.pieces))
        object.__setattr__(self, "value_names", tuple(self.value_names))
        for v in self.value_names:
            if type(v) is not str:
                raise PlanningError(f"value name must be a string, got {v!r}")
            if v in table.header.index:
                raise LayoutMismatchError(f"{v!r} is both a tensor and a value on rank {self.rank}")
        object.__setattr__(self, "_table", table)
        object.__setattr__(self, "_encoded", None)
        object.__setattr__(self, "_fingerprint", None)

    @property
    def table(self) -> PieceTable:
        """The pieces as columns."""
        table: PieceTable = self.__dict__["_table"]  # set in __post_init__
        return table

    def fingerprint(self) -> bytes:
        """16-byte blake2b of the canonical encoding (names, dtypes, shapes, boxes, rank, world
        size, broadcastable flags, value names)."""
        digest: bytes | None = self.__dict__["_fingerprint"]
        if digest is None:
            digest = hashlib.blake2b(encode_local_save_plan(self), digest_size=16).digest()
            object.__setattr__(self, "_fingerprint", digest)
        return digest

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalSavePlan):
            return NotImplemented
        return (
            self.rank == other.rank
            and self.world_size == other.world_size
            and self.value_names == other.value_names
            and self.table == other.table
        )

    __hash__ = None  # type: ignore[assignment]


def encode_local_save_plan(plan: LocalSavePlan) -> bytes:
    """Canonical msgpack bytes of a local save plan (cached on the plan)."""
    encoded: bytes | None = plan.__dict__["_encoded"]
    if encoded is None:
        t = plan.table
        doc = {
            "format": SAVE_PLAN_FORMAT,
            "version": 1,
            "rank": plan.rank,
            "world_size": plan.world_size,
            "header": t.header.packed,
            "name_index": encode_int_column(t.name_index, delta=True),
            "offsets": encode_int_column(t.offsets, delta=True),
            "sizes": encode_int_column(t.sizes, delta=True),
            "broadcastable": np.packbits(t.broadcastable).tobytes(),
            "values": list(plan.value_names),
        }
        encoded = msgpack.packb(doc, use_bin_type=True)
        object.__setattr__(plan, "_encoded", encoded)
    return encoded


def _header(data: bytes) -> PieceHeader:
    """Decoded header, shared between plans whose header bytes are identical (the common case)."""
    header = HEADER_CACHE.get(data)
    if header is None:
        header = PieceHeader.unpack(data)
        HEADER_CACHE.put(bytes(data), header)
    return header


def decode_local_save_plan(data: bytes) -> LocalSavePlan:
    """Inverse of :func:`encode_local_save_plan`; raises PlanningError on malformed bytes."""
    try:
        doc = msgpack.unpackb(data, raw=False)
        if (
            not isinstance(doc, dict)
            or doc.get("format") != SAVE_PLAN_FORMAT
            or doc.get("version") != 1
        ):
            raise PlanningError("not a cloudckpt save plan (format/version)")
        header = _header(doc["header"])
        name_index = decode_int_column(doc["name_index"])
        n = len(name_index)
        ndims = header.ndims[name_index] if n else np.zeros(0, dtype=np.int64)
        ncoords = int(ndims.sum())
        offsets = decode_int_column(doc["offsets"], expected=ncoords)
        sizes = decode_int_column(doc["sizes"], expected=ncoords)
        bits = doc["broadcastable"]
        if not isinstance(bits, bytes) or len(bits) != (n + 7) // 8:
            raise PlanningError("bad broadcastable flags")
        bcast = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=n).astype(bool)
        table = PieceTable(header, name_index, offsets, sizes, bcast)
        plan = LocalSavePlan(
            rank=doc["rank"],
            world_size=doc["world_size"],
            pieces=table,
            value_names=tuple(doc["values"]),
        )
    except PlanningError:
        raise
    except (ColumnError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise PlanningError(f"malformed save plan: {exc}") from exc
    object.__setattr__(plan, "_encoded", bytes(data))
    return plan
