"""A rank's share of the global save plan, and its codec.

Only the coordinator plans the whole save (:func:`~cloudckpt.planning.save.global_plan.
plan_global_save`); every rank gets its :class:`SaveShare`: what it writes (per write item the
chunk id, its local piece and the box inside that piece), the names of the values it owns and
the digest of the plan's skeleton (reported at the commit, where the coordinator checks that
every rank's share was cut from its plan). :func:`encode_shares` cuts every rank's share out
of one plan at once (numpy over all chunks, then a slice of each column per rank).

Encoding (msgpack array): ``"cloudckpt.save_share"``, version 1, ``rank``, ``world_size``,
``plan_digest`` (16 bytes), ``count`` (write items), ``width`` (coordinates per item), then the
columns as little-endian int64 bytes: ``chunk_ids`` (``count``), ``pieces`` (``count``),
``within`` and ``sizes`` (``count * width``, row-major; dims past a tensor's ndim: 0 and 1),
and ``values`` (``[str]``). :func:`decode_share` checks every field against the rank's own local
plan (its pieces and values): a share that does not fit raises
:class:`~cloudckpt.errors.ProtocolError`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgpack
import numpy as np

from cloudckpt.errors import ProtocolError
from cloudckpt.planning.save.global_plan import GlobalSavePlan, ManifestSkeleton
from cloudckpt.planning.save.local_plan import LocalSavePlan

SHARE_FORMAT = "cloudckpt.save_share"
DIGEST_BYTES = 16
MAX_WIDTH = 64  # coordinates per item: more dims than any tensor torch makes


@dataclass(frozen=True, eq=False)
class SaveShare:
    """Rank ``rank``'s part of one global save plan.

    Write item ``i`` (in the order the rank writes them: by piece, then chunk id) is chunk
    ``chunk_ids[i]``: the box of local piece ``pieces[i]`` starting at ``within[i]``, of
    ``sizes[i]`` (``(count, width)`` arrays; dims past the piece's ndim: 0 and 1). ``values``:
    the names of the values this rank owns (writes). ``plan_digest``: the skeleton's
    :meth:`~cloudckpt.planning.save.global_plan.ManifestSkeleton.digest`. ``skeleton``: the
    whole plan's skeleton, on the coordinator only (it assembles the manifest); ``None``
    elsewhere."""

    rank: int
    world_size: int
    plan_digest: bytes
    chunk_ids: np.ndarray
    pieces: np.ndarray
    within: np.ndarray
    sizes: np.ndarray
    values: tuple[str, ...]
    skeleton: ManifestSkeleton | None = None

    def __len__(self) -> int:
        return len(self.chunk_ids)

    def boxes(self) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
        """``(chunk_id, piece, within, sizes)`` per write item, as Python ints."""
        return list(
            zip(
                self.chunk_ids.tolist(),
                self.pieces.tolist(),
                map(tuple, self.within.tolist()),
                map(tuple, self.sizes.tolist()),
            )
        )


def _columns(plan: GlobalSavePlan) -> tuple[np.ndarray, np.ndarray, int]:
    """Every chunk id in write order (by writer, then piece, then chunk id), each writer's
    bounds in it, and the coordinate width."""
    sk = plan.skeleton
    pieces = int(plan.writer_piece.max()) + 1 if len(plan.writer_piece) else 1
    order = np.argsort(sk.writer * pieces + plan.writer_piece, kind="stable")  # one sort key
    bounds = np.searchsorted(sk.writer[order], np.arange(plan.world_size + 1))
    return order.astype(np.int64, copy=False), bounds, int(sk.offsets.shape[1])


def _owned(plan: GlobalSavePlan) -> list[list[str]]:
    owned: list[list[str]] = [[] for _ in range(plan.world_size)]
    for name, owner in plan.value_owner.items():
        owned[owner].append(name)
    return owned


def encode_shares(plan: GlobalSavePlan, *, ranks: Sequence[int] | None = None) -> list[bytes]:
    """Every rank's encoded share of ``plan`` (or those of ``ranks``), in that order."""
    sk = plan.skeleton
    digest = sk.digest()
    order, bounds, width = _columns(plan)
    ids = memoryview(order.astype("<i8").tobytes())
    pieces = memoryview(plan.writer_piece[order].astype("<i8").tobytes())
    within = memoryview(np.ascontiguousarray(plan.within[order], dtype="<i8").tobytes())
    sizes = memoryview(np.ascontiguousarray(sk.sizes[order], dtype="<i8").tobytes())
    owned = _owned(plan)
    starts = bounds.tolist()
    pack = msgpack.Packer(use_bin_type=True).pack  # one packer for every share
    out = []
    row = 8 * width
    for r in range(plan.world_size) if ranks is None else ranks:
        s, e = starts[r], starts[r + 1]
        out.append(
            pack(
                [
                    SHARE_FORMAT,
                    1,
                    r,
                    plan.world_size,
                    digest,
                    e - s,
                    width,
                    ids[8 * s : 8 * e],
                    pieces[8 * s : 8 * e],
                    within[row * s : row * e],
                    sizes[row * s : row * e],
                    owned[r],
                ]
            )
        )
    return out


def _bad(detail: str) -> ProtocolError:
    return ProtocolError(
        f"malformed save plan share from the coordinator: {detail} "
        "(run the same cloudckpt version on every rank)"
    )


def _column(raw: object, count: int, what: str) -> np.ndarray:
    if not isinstance(raw, bytes) or len(raw) != 8 * count:
        got = len(raw) if isinstance(raw, bytes) else type(raw).__name__
        raise _bad(f"{what}: {got} bytes, expected {8 * count}")
    return np.frombuffer(raw, dtype="<i8").astype(np.int64)


def decode_share(
    data: bytes, local: LocalSavePlan, skeleton: ManifestSkeleton | None = None
) -> SaveShare:
    """Inverse of :func:`encode_shares` for the rank of ``local`` (its local plan: every write
    item must lie inside one of its pieces, every owned value must be one of its values).
    Raises :class:`~cloudckpt.errors.ProtocolError` on anything else. ``skeleton``: kept on the
    share (the coordinator's)."""
    try:
        doc = msgpack.unpackb(data, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several types on garbage
        raise _bad(f"not msgpack ({exc})") from exc
    if not isinstance(doc, list) or len(doc) != 12 or doc[:2] != [SHARE_FORMAT, 1]:
        raise _bad("not a cloudckpt save plan share (format/version)")
    _, _, rank, world, digest, count, width, ids, pieces, within, sizes, values = doc
    if (rank, world) != (local.rank, local.world_size) or type(rank) is not int:
        raise _bad(f"for rank {rank!r} of {world!r}, not rank {local.rank} of {local.world_size}")
    if not isinstance(digest, bytes) or len(digest) != DIGEST_BYTES:
        raise _bad("bad plan digest")
    if type(count) is not int or count < 0 or type(width) is not int or not 0 < width <= MAX_WIDTH:
        raise _bad(f"bad count {count!r} or width {width!r}")
    chunk_ids = _column(ids, count, "chunk ids")
    piece = _column(pieces, count, "pieces")
    at = _column(within, count * width, "within").reshape(count, width)
    size = _column(sizes, count * width, "sizes").reshape(count, width)
    if count and (chunk_ids.min() < 0 or len(np.unique(chunk_ids)) != count):
        raise _bad("chunk ids negative or repeated")
    if not isinstance(values, list) or not all(type(v) is str for v in values):
        raise _bad("value names are not strings")
    _check_fits(local, piece, at, size, values)
    for arr in (chunk_ids, piece, at, size):
        arr.flags.writeable = False
    return SaveShare(rank, world, digest, chunk_ids, piece, at, size, tuple(values), skeleton)


def _check_fits(
    local: LocalSavePlan, piece: np.ndarray, at: np.ndarray, size: np.ndarray, values: list[str]
) -> None:
    table = local.table
    count, width = size.shape
    if count and (piece.min() < 0 or piece.max() >= len(table)):
        raise _bad(f"a write item names a piece outside this rank's {len(table)}")
    if count and len(table) and int(table.ndims.max()) > width:
        raise _bad(f"width {width} below this rank's tensors' ndim")
    if count:
        _, extent = table.padded(width)
        if (at < 0).any() or (size < 1).any() or (at + size > extent[piece]).any():
            raise _bad("a write item's box is not inside its piece")
    if len(set(values)) != len(values) or not set(values) <= set(local.value_names):
        raise _bad("owned values repeated or not this rank's")
