"""From a global save plan and every rank's write results to the manifest, without per-chunk
Python objects (millions of chunks assemble in well under a second).

Each rank reports a :class:`WrittenChunks` (msgpack via :func:`encode_written_chunks`): for
each chunk id it wrote, the object (index into its own object keys), byte offset, byte length
and per-block crc32c values (and content hashes, in an incremental save), the chunk ids it did
not upload because its base holds their bytes, plus the encoded values it owns. The
coordinator decodes every report and calls :func:`assemble_manifest`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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
from cloudckpt.manifest.lineage import HASH_BYTES
from cloudckpt.manifest.model import DEFAULT_CHECKSUM_BLOCK_SIZE, Manifest, crc_counts
from cloudckpt.planning.save.global_plan import ManifestSkeleton
from cloudckpt.planning.save.incremental import ReusedChunks
from cloudckpt.wording import plural

WRITTEN_FORMAT = "cloudckpt.written"


@dataclass(frozen=True, eq=False)
class WrittenChunks:
    """Where one rank's chunks landed. ``crcs`` is flat: per chunk (in ``chunk_ids`` order)
    ``max(1, ceil(byte_length / checksum_block_size))`` values. ``values``: name -> bytes from
    ``encode_value`` for the values this rank owns. ``hashes``: 16 bytes per chunk (in
    ``chunk_ids`` order) when the save hashed, else empty; ``reused``: chunk ids not uploaded
    because the base holds the same bytes."""

    rank: int
    object_keys: tuple[str, ...]
    chunk_ids: np.ndarray
    object_index: np.ndarray
    byte_offset: np.ndarray
    byte_length: np.ndarray
    crcs: np.ndarray
    values: Mapping[str, bytes] = None  # type: ignore[assignment]
    hashes: bytes = b""
    reused: np.ndarray = ()  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "object_keys", tuple(self.object_keys))
        object.__setattr__(self, "hashes", bytes(self.hashes))
        for f in ("chunk_ids", "object_index", "byte_offset", "byte_length", "reused"):
            object.__setattr__(self, f, np.asarray(getattr(self, f), dtype=np.int64).reshape(-1))
        object.__setattr__(self, "crcs", np.asarray(self.crcs, dtype=np.int64).reshape(-1))
        object.__setattr__(self, "values", dict(self.values or {}))
        n = len(self.chunk_ids)
        if not len(self.object_index) == len(self.byte_offset) == len(self.byte_length) == n:
            raise PlanningError(f"rank {self.rank}: written chunk columns differ in length")
        if len(self.hashes) not in (0, HASH_BYTES * n):
            raise PlanningError(
                f"rank {self.rank}: {len(self.hashes)} bytes of chunk hashes for {n} chunks"
            )


def written_chunks(
    rank: int,
    locations: Sequence[Any],
    values: Mapping[str, bytes],
    reused: Sequence[int],
) -> WrittenChunks:
    """Rank ``rank``'s :class:`WrittenChunks` from its writer's locations (in write order: each
    with ``chunk_id``, ``object_key``, ``byte_offset``, ``byte_length``, ``crcs`` and
    ``content_hash``), the values it owns and the chunk ids its base holds."""
    keys: dict[str, int] = {}
    for loc in locations:
        keys.setdefault(loc.object_key, len(keys))
    return WrittenChunks(
        rank=rank,
        object_keys=tuple(keys),
        chunk_ids=_ints(loc.chunk_id for loc in locations),
        object_index=_ints(keys[loc.object_key] for loc in locations),
        byte_offset=_ints(loc.byte_offset for loc in locations),
        byte_length=_ints(loc.byte_length for loc in locations),
        crcs=_ints(c for loc in locations for c in loc.crcs),
        values=values,
        hashes=b"".join(loc.content_hash for loc in locations),
        reused=np.asarray(reused, dtype=np.int64),
    )


def _ints(values: Iterable[int]) -> np.ndarray:
    """A column of a :class:`WrittenChunks` (int64, as it keeps them)."""
    return np.fromiter(values, dtype=np.int64)


def encode_written_chunks(w: WrittenChunks) -> bytes:
    return msgpack.packb(
        {
            "format": WRITTEN_FORMAT,
            "version": 1,
            "rank": w.rank,
            "objects": list(w.object_keys),
            "chunk_ids": encode_int_column(w.chunk_ids, delta=True),
            "object_index": encode_int_column(w.object_index, delta=True),
            "byte_offset": encode_int_column(w.byte_offset, delta=True),
            "byte_length": encode_int_column(w.byte_length, delta=True),
            "crcs": encode_u32(w.crcs),
            "values": dict(w.values),
            "hashes": w.hashes,
            "reused": encode_int_column(w.reused, delta=True),
        },
        use_bin_type=True,
    )


def decode_written_chunks(data: bytes) -> WrittenChunks:
    try:
        doc = msgpack.unpackb(data, raw=False)
        if (
            not isinstance(doc, dict)
            or doc.get("format") != WRITTEN_FORMAT
            or doc.get("version") != 1
        ):
            raise PlanningError("not a cloudckpt write report")
        ids = decode_int_column(doc["chunk_ids"])
        n = len(ids)
        return WrittenChunks(
            rank=int(doc["rank"]),
            object_keys=tuple(doc["objects"]),
            chunk_ids=ids,
            object_index=decode_int_column(doc["object_index"], expected=n),
            byte_offset=decode_int_column(doc["byte_offset"], expected=n),
            byte_length=decode_int_column(doc["byte_length"], expected=n),
            crcs=decode_u32(doc["crcs"]),
            values=dict(doc["values"]),
            hashes=doc["hashes"],
            reused=decode_int_column(doc["reused"]),
        )
    except PlanningError:
        raise
    except (ColumnError, KeyError, TypeError, ValueError) as exc:
        raise PlanningError(f"malformed write report: {exc}") from exc


def assemble_manifest(
    skeleton: ManifestSkeleton,
    written: Sequence[WrittenChunks],
    *,
    world_size: int,
    checksum_block_size: int = DEFAULT_CHECKSUM_BLOCK_SIZE,
    metadata: Mapping[str, object] | None = None,
    structure: object = None,
    created_at: float | None = None,
    cloudckpt_version: str | None = None,
    allow_pickle: bool = False,
    reused: ReusedChunks | None = None,
    hashed: bool = False,
    base: str = "",
    attempt: str = "",
) -> Manifest:
    """Build the checkpoint's manifest. Every chunk id of ``skeleton`` must be reported exactly
    once (written by a rank, or reused: ``reused`` says where the base holds those) with the
    byte length the plan expects (else :class:`~cloudckpt.errors.PlanningError`); the result is
    validated like any manifest. ``allow_pickle`` must be true if a reported value is pickled.
    With ``hashed`` every written chunk must come with its hash, and the manifest records them
    (format version 3, with ``base`` and ``attempt``)."""
    n = skeleton.num_chunks
    objects: list[str] = []
    homes: list[str] = []
    obj_pos: dict[tuple[str, str], int] = {}
    hashes = np.zeros((n, HASH_BYTES), dtype=np.uint8) if hashed else None
    owner = np.full(n, -1, dtype=np.int64)
    obj = np.zeros(n, dtype=np.int64)
    boff = np.zeros(n, dtype=np.int64)
    blen = np.zeros(n, dtype=np.int64)
    crc_parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    blobs: dict[str, bytes] = {}
    for w in written:
        ids = w.chunk_ids
        if len(ids) and (ids.min() < 0 or ids.max() >= n):
            raise PlanningError(f"rank {w.rank} reports a chunk id outside the plan")
        if (owner[ids] >= 0).any() or len(np.unique(ids)) != len(ids):
            raise PlanningError(f"rank {w.rank} reports a chunk another report already holds")
        remap = _add_objects(objects, homes, obj_pos, [("", k) for k in w.object_keys])
        if len(w.object_index) and (w.object_index.min() < 0 or w.object_index.max() >= len(remap)):
            raise PlanningError(f"rank {w.rank} reports an object index outside its object keys")
        owner[ids] = w.rank
        obj[ids] = remap[w.object_index]
        boff[ids] = w.byte_offset
        blen[ids] = w.byte_length
        ncrc = crc_counts(w.byte_length, checksum_block_size)
        if int(ncrc.sum()) != len(w.crcs):
            raise PlanningError(
                f"rank {w.rank} reports {len(w.crcs)} crcs, expected {int(ncrc.sum())}"
            )
        crc_parts.append((ids, ncrc, w.crcs))
        if hashes is not None:
            if len(w.hashes) != HASH_BYTES * len(ids):
                raise PlanningError(f"rank {w.rank} reports no hashes of its chunks")
            hashes[ids] = np.frombuffer(w.hashes, dtype=np.uint8).reshape(len(ids), HASH_BYTES)
        for name, blob in w.values.items():
            if name in blobs:
                raise PlanningError(f"value {name!r} reported by two ranks")
            blobs[name] = blob
    if reused is not None and len(reused.ids):
        ids = reused.ids
        if (owner[ids] >= 0).any():
            raise PlanningError("a chunk is reported both written and reused")
        told = [w.reused for w in written] or [np.zeros(0, dtype=np.int64)]
        if sorted(np.concatenate(told).tolist()) != ids.tolist():
            raise PlanningError("the reused chunks are not those the ranks report")
        owner[ids] = world_size
        obj[ids] = _add_objects(objects, homes, obj_pos, reused.objects)[reused.object_index]
        boff[ids], blen[ids] = reused.byte_offset, reused.byte_length
        crc_parts.append((ids, crc_counts(reused.byte_length, checksum_block_size), reused.crcs))
        if hashes is not None:
            hashes[ids] = reused.hashes
    elif any(len(w.reused) for w in written):
        raise PlanningError("a rank reports reused chunks, but the save has no base")
    if (owner < 0).any():
        missing = np.flatnonzero(owner < 0)
        raise PlanningError(
            f"{plural(len(missing), 'chunk')} {'was' if len(missing) == 1 else 'were'}"
            f" not reported written (first chunk id {int(missing[0])})"
        )
    if (blen != skeleton.nbytes).any():
        c = int(np.flatnonzero(blen != skeleton.nbytes)[0])
        raise PlanningError(
            f"chunk {c} has {int(blen[c])} bytes written, "
            f"the plan expects {int(skeleton.nbytes[c])}"
        )
    ncrc_all = crc_counts(blen, checksum_block_size)
    crc_start = np.concatenate(([0], np.cumsum(ncrc_all))).astype(np.int64)
    crcs = np.zeros(int(crc_start[-1]), dtype=np.int64)
    for ids, ncrc, values in crc_parts:
        if not len(ids):
            continue
        dest = np.repeat(crc_start[ids], ncrc) + (
            np.arange(len(values)) - np.repeat(np.cumsum(ncrc) - ncrc, ncrc)
        )
        crcs[dest] = values
    offsets, sizes = skeleton.flat_coords()
    if cloudckpt_version is None:
        from cloudckpt.version import __version__

        cloudckpt_version = __version__
    return Manifest(
        world_size=world_size,
        created_at=time.time() if created_at is None else created_at,
        cloudckpt_version=cloudckpt_version,
        metadata=dict(metadata or {}),
        checksum_block_size=checksum_block_size,
        objects=objects,
        tensor_names=skeleton.names,
        tensor_dtypes=skeleton.dtypes,
        tensor_shapes=skeleton.shapes,
        chunk_counts=np.diff(skeleton.chunk_start),
        chunk_offsets=offsets,
        chunk_sizes=sizes,
        chunk_object_index=obj,
        chunk_byte_offset=boff,
        chunk_byte_length=blen,
        chunk_crcs=crcs,
        value_blobs=blobs,
        structure=structure,
        allow_pickle=allow_pickle,
        object_homes=homes,
        chunk_hashes=hashes,
        base=base,
        attempt=attempt,
    )


def _add_objects(
    objects: list[str],
    homes: list[str],
    pos: dict[tuple[str, str], int],
    entries: Sequence[tuple[str, str]],
) -> np.ndarray:
    """Index of each ``(home, key)`` of ``entries`` in the object table (added when new)."""
    remap = np.empty(len(entries), dtype=np.int64)
    for i, (home, key) in enumerate(entries):
        if (home, key) not in pos:
            pos[home, key] = len(objects)
            objects.append(key)
            homes.append(home)
        remap[i] = pos[home, key]
    return remap
