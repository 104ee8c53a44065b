"""Incremental saves, the pure part: which chunks of a new save may reuse its base's bytes, the
table of their hashes and crcs the coordinator sends every rank, and where a reused chunk's bytes
are.

A chunk of the new save *matches* a chunk of the base when both belong to a tensor of the same
name, dtype and global shape and cover the same box (offsets and sizes), the base records chunk
hashes and both use the same checksum block size (a reused chunk keeps the base's crc32c values).
A rank leaves a matched chunk out of its upload only when the content hash of its bytes
(:func:`cloudckpt.checksum.content_hash`, 8 bytes) *and* every block crc32c equal the base's
(:data:`KnownChunk`); the new manifest then points at the object that already holds them, in the
base's folder or wherever the base itself points (homes are flattened: a reference never leads
to another reference). A base of an older cloudckpt, with 16-byte hashes, is compared by their
first 8 bytes (:func:`cloudckpt.manifest.lineage.compared_hashes`): the same hash.

What a wrong reuse takes: a chunk whose bytes changed since the base but whose 64-bit hash and
32-bit block crcs all stay the same. The comparison is positional (this chunk against the same
box of the base, never against a set of hashes), so no birthday bound applies: for bytes that no
one crafted, about 2^-64 per changed chunk from the hash alone and, the crc32c being an unrelated
linear code, about 2^-96 with it (docs/decisions.md, "Content hashes").

No I/O, no torch, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack
import numpy as np

from cloudckpt.errors import PlanningError
from cloudckpt.manifest.columns import (
    ColumnError,
    decode_int_column,
    decode_u32,
    encode_int_column,
    encode_u32,
)
from cloudckpt.manifest.lineage import HASH_BYTES, compared_hashes
from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.save.global_plan import ManifestSkeleton

KNOWN_FORMAT = "cloudckpt.known-hashes"
_KNOWN_VERSION = 2  # 1: 16-byte hashes, no crcs
#: What a rank compares a chunk's bytes by: its content hash and its block crcs.
KnownChunk = tuple[bytes, tuple[int, ...]]


@dataclass(frozen=True, eq=False)
class BaseChunks:
    """The base of an incremental save as the commit needs it: its ``folder`` (a sibling of the
    new checkpoint in the run), its ``manifest`` and, per chunk id of the new save's skeleton,
    the matching base chunk (``-1``: none)."""

    folder: str
    manifest: Manifest
    match: np.ndarray

    def known(self) -> dict[int, KnownChunk]:
        """Chunk id -> the base's content hash and block crcs, for every matched chunk."""
        ids = np.flatnonzero(self.match >= 0)
        hashes = self.manifest.chunk_hashes
        assert hashes is not None  # match_base matches only a base that holds chunk hashes
        compared, cols = compared_hashes(hashes), self.manifest.columns
        crcs, start = cols.crcs.tolist(), cols.crc_start
        return {
            int(c): (compared[b].tobytes(), tuple(crcs[start[b] : start[b + 1]]))
            for c, b in zip(ids.tolist(), self.match[ids].tolist())
        }

    def homes(self) -> frozenset[str]:
        """Every folder the new save may reference: the base's own and the base's homes."""
        return frozenset({self.folder} | {h for h in self.manifest.object_homes if h})


def match_base(
    skeleton: ManifestSkeleton, base: Manifest, *, checksum_block_size: int
) -> np.ndarray:
    """Per chunk id of ``skeleton``, the index of the base chunk it matches (see module doc), or
    ``-1``. All ``-1`` when the base has no hashes or another checksum block size."""
    match = np.full(skeleton.num_chunks, -1, dtype=np.int64)
    if base.chunk_hashes is None or base.checksum_block_size != checksum_block_size:
        return match
    cols = base.columns
    for t, name in enumerate(skeleton.names):
        b = cols.name_index.get(name)
        if (
            b is None
            or cols.dtypes[b] != skeleton.dtypes[t]
            or base.shapes[b] != skeleton.shapes[t]
        ):
            continue
        nd = len(skeleton.shapes[t])
        c0, c1 = int(cols.chunk_start[b]), int(cols.chunk_start[b + 1])
        k0 = int(cols.coord_start[b])
        boxes = np.concatenate(
            (
                cols.offsets[k0 : k0 + (c1 - c0) * nd].reshape(c1 - c0, nd),
                cols.sizes[k0 : k0 + (c1 - c0) * nd].reshape(c1 - c0, nd),
            ),
            axis=1,
        )
        where = {row.tobytes(): c0 + i for i, row in enumerate(np.ascontiguousarray(boxes))}
        s0, s1 = int(skeleton.chunk_start[t]), int(skeleton.chunk_start[t + 1])
        mine = np.ascontiguousarray(
            np.concatenate((skeleton.offsets[s0:s1, :nd], skeleton.sizes[s0:s1, :nd]), axis=1),
            dtype=np.int64,
        )
        for i, row in enumerate(mine):
            match[s0 + i] = where.get(row.tobytes(), -1)
    return match


def encode_known(known: dict[int, KnownChunk], base: str) -> bytes:
    """The table the coordinator broadcasts: the base's folder, chunk ids, their hashes and their
    block crcs."""
    ids = sorted(known)
    counts = [len(known[i][1]) for i in ids]
    return msgpack.packb(
        {
            "format": KNOWN_FORMAT,
            "version": _KNOWN_VERSION,
            "base": base,
            "ids": encode_int_column(np.array(ids, dtype=np.int64), delta=True),
            "hashes": b"".join(known[i][0] for i in ids),
            "crc_counts": encode_int_column(np.array(counts, dtype=np.int64)),
            "crcs": encode_u32([c for i in ids for c in known[i][1]]),
        },
        use_bin_type=True,
    )


def decode_known(data: bytes) -> tuple[dict[int, KnownChunk], str]:
    """``(chunk id -> (base hash, base crcs), base folder)`` of :func:`encode_known`'s bytes;
    ``PlanningError`` for anything else (a table whose parts disagree in length included)."""
    try:
        doc = msgpack.unpackb(data, raw=False)
        if (
            not isinstance(doc, dict)
            or doc.get("format") != KNOWN_FORMAT
            or doc.get("version") != _KNOWN_VERSION
        ):
            raise PlanningError("not a table of known chunk hashes")
        ids = decode_int_column(doc["ids"])
        counts = decode_int_column(doc["crc_counts"], expected=len(ids))
        hashes, base = doc["hashes"], doc["base"]
        crcs = decode_u32(doc["crcs"])
        if (
            type(hashes) is not bytes
            or len(hashes) != HASH_BYTES * len(ids)
            or type(base) is not str
            or (len(counts) and int(counts.min()) < 1)
            or int(counts.sum()) != len(crcs)
            or len(set(ids.tolist())) != len(ids)
        ):
            raise PlanningError("malformed table of known chunk hashes")
    except PlanningError:
        raise
    except (ColumnError, KeyError, TypeError, ValueError) as exc:
        raise PlanningError(f"malformed table of known chunk hashes: {exc}") from exc
    values, ends = crcs.tolist(), np.cumsum(counts).tolist()
    return {
        int(c): (hashes[HASH_BYTES * i : HASH_BYTES * (i + 1)], tuple(values[e - n : e]))
        for i, (c, n, e) in enumerate(zip(ids.tolist(), counts.tolist(), ends))
    }, base


@dataclass(frozen=True, eq=False)
class ReusedChunks:
    """Where the reused chunks' bytes are, as :func:`cloudckpt.planning.assemble_manifest`
    needs them: per reused chunk id its (home, key) object, byte offset, byte length, crcs
    (``crc_counts`` values each, flat, in ``ids`` order) and hashes (``HASH_BYTES`` each)."""

    ids: np.ndarray
    objects: tuple[tuple[str, str], ...]
    object_index: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray
    crcs: np.ndarray
    hashes: np.ndarray


def reused_chunks(base: BaseChunks, ids: np.ndarray) -> ReusedChunks:
    """The base's locations of the reused chunk ``ids`` (sorted, distinct), their objects
    flattened to the folder that holds them. ``PlanningError`` for an id that matched nothing."""
    ids = np.asarray(ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= len(base.match) or (base.match[ids] < 0).any()):
        raise PlanningError("a rank reused a chunk its base does not hold")
    m, cols = base.manifest, base.manifest.columns
    src = base.match[ids]
    used, local = np.unique(cols.object_index[src], return_inverse=True)
    objects = tuple((m.object_homes[o] or base.folder, m.objects[o]) for o in used.tolist())
    ncrc = cols.crc_start[src + 1] - cols.crc_start[src]
    pos = np.repeat(cols.crc_start[src], ncrc) + (
        np.arange(int(ncrc.sum())) - np.repeat(np.cumsum(ncrc) - ncrc, ncrc)
    )
    assert m.chunk_hashes is not None  # a reused chunk comes from a base with chunk hashes
    return ReusedChunks(
        ids=ids,
        objects=objects,
        object_index=local.astype(np.int64).reshape(-1),
        byte_offset=cols.byte_offset[src],
        byte_length=cols.byte_length[src],
        crcs=cols.crcs[pos.astype(np.int64)].astype(np.int64),
        hashes=compared_hashes(m.chunk_hashes)[src],
    )
