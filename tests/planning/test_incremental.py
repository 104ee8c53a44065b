"""The pure part of incremental saves: which chunks match the base, the broadcast table of their
hashes, and the manifest assembled from written and reused chunks (homes flattened)."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from cloudckpt.checksum import block_crcs, content_hash
from cloudckpt.errors import PlanningError
from cloudckpt.manifest.columns import encode_int_column
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.planning.save.assemble import WrittenChunks, assemble_manifest
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.incremental import (
    BaseChunks,
    decode_known,
    encode_known,
    match_base,
    reused_chunks,
)
from cloudckpt.planning.save.local_plan import LocalSavePlan

BLOCK = 16


def _skeleton(pieces):
    plan = plan_global_save(
        [LocalSavePlan(rank=0, world_size=1, pieces=tuple(pieces), value_names=())], rank=0
    )
    return plan


def _bytes(cid: int, n: int, version: int = 0) -> bytes:
    return bytes((cid * 31 + i * 7 + version) % 256 for i in range(n))


def _manifest(
    plan,
    versions: dict[int, int],
    *,
    key="data/00000000000000aa/r00000-0000.bin",
    homes_of=None,
    base="",
    attempt="00000000000000aa",
):
    """The manifest of ``plan`` whose chunk ``c`` holds ``_bytes(c, n, versions[c])``, all in
    one object (``homes_of``: chunk -> (home, key) of a chunk stored elsewhere)."""
    sk = plan.skeleton
    written = {}
    offset = 0
    ids, offs, lens, crcs, hashes = [], [], [], [], b""
    for c in range(sk.num_chunks):
        data = _bytes(c, int(sk.nbytes[c]), versions.get(c, 0))
        written[c] = data
        ids.append(c), offs.append(offset), lens.append(len(data))
        crcs += block_crcs(data, BLOCK)
        hashes += content_hash(data)
        offset += len(data)
    w = WrittenChunks(
        rank=0,
        object_keys=(key,),
        chunk_ids=ids,
        object_index=[0] * len(ids),
        byte_offset=offs,
        byte_length=lens,
        crcs=crcs,
        hashes=hashes,
    )
    return assemble_manifest(
        sk, [w], world_size=1, checksum_block_size=BLOCK, hashed=True, base=base, attempt=attempt
    )


PIECES = [
    PieceSpec("a", "float32", (8, 4), (0, 0), (8, 4)),
    PieceSpec("b", "float32", (8, 4), (0, 0), (4, 4)),
    PieceSpec("b", "float32", (8, 4), (4, 0), (4, 4)),
    PieceSpec("c", "int64", (), (), ()),
]


def test_match_needs_the_same_name_dtype_shape_box_and_block_size():
    plan = _skeleton(PIECES)
    base = _manifest(plan, {})
    assert (match_base(plan.skeleton, base, checksum_block_size=BLOCK) >= 0).all()
    assert (match_base(plan.skeleton, base, checksum_block_size=2 * BLOCK) == -1).all()
    other = _skeleton(
        [
            PieceSpec("a", "float64", (8, 4), (0, 0), (8, 4)),  # dtype differs
            PieceSpec("b", "float32", (8, 4), (0, 0), (8, 4)),  # boxes differ
            PieceSpec("c", "int64", (), (), ()),  # same
            PieceSpec("d", "float32", (2,), (0,), (2,)),
        ]
    )  # new
    match = match_base(other.skeleton, base, checksum_block_size=BLOCK)
    named = dict(zip(other.skeleton.names, np.split(match, other.skeleton.chunk_start[1:-1])))
    assert named["a"].tolist() == [-1] and named["b"].tolist() == [-1]
    assert named["d"].tolist() == [-1] and named["c"].tolist() != [-1]


def test_known_table_round_trips_and_refuses_garbage():
    known = {3: (b"\x01" * 8, (1, 2)), 0: (b"\x02" * 8, (7,)), 70000: (b"\x03" * 8, (0, 0, 5))}
    assert decode_known(encode_known(known, "step-1")) == (known, "step-1")
    assert decode_known(encode_known({}, "")) == ({}, "")
    for bad in (b"", b"\x00", encode_known(known, "x")[:-3]):
        with pytest.raises(PlanningError):
            decode_known(bad)


def _table(**changes) -> bytes:
    doc = msgpack.unpackb(encode_known({3: (b"\x01" * 8, (1, 2)), 5: (b"\x02" * 8, (7,))}, "b"))
    doc.update(changes)
    return msgpack.packb(doc, use_bin_type=True)


@pytest.mark.parametrize(
    "changes",
    [
        dict(version=1),  # 16-byte hashes, no crcs: an older peer
        dict(hashes=b"\x01" * 15),  # short
        dict(hashes=b"\x01" * 24),  # long
        dict(hashes=b"\x01" * 32),  # 16 bytes a chunk
        dict(hashes="x" * 16),
        dict(crcs=b"\x00" * 8),  # one crc short
        dict(crcs=b"\x00" * 16),  # one too many
        dict(crcs=b"\x00" * 11),
        dict(crc_counts=encode_int_column(np.array([2, 0]))),  # a chunk without a crc
        dict(crc_counts=encode_int_column(np.array([3]))),  # not one count per chunk
        dict(ids=encode_int_column(np.array([3, 3]))),  # one chunk twice
        dict(ids=[1, 2]),
        dict(base=7),
    ],
)
def test_a_malformed_known_table_is_a_planning_error(changes):
    """A peer's table whose parts disagree never turns into a comparison (a reuse)."""
    with pytest.raises(PlanningError):
        decode_known(_table(**changes))


def test_a_legacy_base_is_compared_by_the_first_8_bytes_of_its_hashes():
    """A base saved by an older cloudckpt records 16-byte XXH3-128 digests: the table carries
    their first 8 bytes, which are the hash a save computes of the same bytes today, with the
    base's block crcs; the manifest of a save reusing them records those 8 bytes."""
    import xxhash

    plan = _skeleton(PIECES)
    new = _manifest(plan, {})
    sk = plan.skeleton
    digests = b"".join(
        xxhash.xxh3_128_digest(_bytes(c, int(sk.nbytes[c]))) for c in range(sk.num_chunks)
    )
    legacy = _relabel(new, chunk_hashes=digests, chunk_hash_bytes=16)
    chunks = BaseChunks("b1", legacy, match_base(sk, legacy, checksum_block_size=BLOCK))
    cols = legacy.columns
    for cid, (digest, crcs) in chunks.known().items():
        data = _bytes(cid, int(sk.nbytes[cid]))
        assert digest == content_hash(data) == new.chunk_hashes[cid].tobytes()
        assert crcs == block_crcs(data, BLOCK)
        b = int(chunks.match[cid])
        assert crcs == tuple(cols.crcs[cols.crc_start[b] : cols.crc_start[b + 1]].tolist())
    reused = reused_chunks(chunks, np.arange(sk.num_chunks))
    assert reused.hashes.shape == (sk.num_chunks, 8)
    assert reused.hashes.tobytes() == new.chunk_hashes.tobytes()


def _relabel(m, **lineage):
    from cloudckpt.manifest.model import Manifest

    c = m.columns
    return Manifest(
        world_size=1,
        created_at=0.0,
        cloudckpt_version="t",
        metadata={},
        checksum_block_size=BLOCK,
        objects=m.objects,
        tensor_names=c.names,
        tensor_dtypes=c.dtypes,
        tensor_shapes=m.shapes,
        chunk_counts=np.diff(c.chunk_start),
        chunk_offsets=c.offsets,
        chunk_sizes=c.sizes,
        chunk_object_index=c.object_index,
        chunk_byte_offset=c.byte_offset,
        chunk_byte_length=c.byte_length,
        chunk_crcs=c.crcs,
        value_blobs={},
        **lineage,
    )


def test_reused_chunks_point_at_the_base_and_flatten_its_homes():
    plan = _skeleton(PIECES)
    first = _manifest(plan, {})
    # the base (folder "b2") stored chunk 0 itself and refers to "b1" for the others
    base = first.with_object_keys(first.objects)  # same content; homes set below
    from cloudckpt.manifest.model import Manifest

    c = base.columns
    base = Manifest(
        world_size=1,
        created_at=0.0,
        cloudckpt_version="t",
        metadata={},
        checksum_block_size=BLOCK,
        objects=("data/00000000000000bb/r00000-0000.bin", first.objects[0]),
        tensor_names=c.names,
        tensor_dtypes=c.dtypes,
        tensor_shapes=first.shapes,
        chunk_counts=np.diff(c.chunk_start),
        chunk_offsets=c.offsets,
        chunk_sizes=c.sizes,
        chunk_object_index=[0] + [1] * (first.num_chunks - 1),
        chunk_byte_offset=c.byte_offset,
        chunk_byte_length=c.byte_length,
        chunk_crcs=c.crcs,
        value_blobs={},
        object_homes=("", "b1"),
        chunk_hashes=first.chunk_hashes,
        attempt="00000000000000bb",
    )
    chunks = BaseChunks(
        folder="b2", manifest=base, match=match_base(plan.skeleton, base, checksum_block_size=BLOCK)
    )
    assert chunks.homes() == {"b1", "b2"}
    assert set(chunks.known()) == set(range(plan.skeleton.num_chunks))
    reused = reused_chunks(chunks, np.array([0, 2]))
    assert reused.objects == (("b2", base.objects[0]), ("b1", base.objects[1]))
    # chunk 1 changed: written anew; 0 and 2 and 3 reused
    data = _bytes(1, int(plan.skeleton.nbytes[1]), 5)
    w = WrittenChunks(
        rank=0,
        object_keys=("data/00000000000000cc/r00000-0000.bin",),
        chunk_ids=[1],
        object_index=[0],
        byte_offset=[0],
        byte_length=[len(data)],
        crcs=block_crcs(data, BLOCK),
        hashes=content_hash(data),
        reused=[0, 2, 3],
    )
    m = assemble_manifest(
        plan.skeleton,
        [w],
        world_size=1,
        checksum_block_size=BLOCK,
        hashed=True,
        base="b2",
        attempt="00000000000000cc",
        reused=reused_chunks(chunks, np.array([0, 2, 3])),
    )
    assert m.base == "b2" and m.attempt == "00000000000000cc" and m.references
    homes = dict(zip(m.objects, m.object_homes))
    assert homes == {
        "data/00000000000000cc/r00000-0000.bin": "",
        base.objects[0]: "b2",
        base.objects[1]: "b1",
    }  # never "b2" for b1's
    for cid in (0, 2, 3):
        assert m.chunk_hashes[cid].tobytes() == base.chunk_hashes[cid].tobytes()
    assert m.chunk_hashes[1].tobytes() == content_hash(data)
    with pytest.raises(PlanningError, match="not those the ranks report"):
        assemble_manifest(
            plan.skeleton,
            [w],
            world_size=1,
            checksum_block_size=BLOCK,
            hashed=True,
            reused=reused_chunks(chunks, np.array([0, 2])),
        )
    with pytest.raises(PlanningError, match="does not hold"):
        reused_chunks(BaseChunks("b2", base, np.full(4, -1)), np.array([0]))
