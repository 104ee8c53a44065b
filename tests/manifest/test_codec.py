"""Manifest round trip and validation of untrusted bytes: every violation names where it is."""

from __future__ import annotations

import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import (
    ManifestError,
    PickleNotAllowed,
    PlanningError,
    UnsupportedManifestVersion,
    UnsupportedValueError,
)
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import decode_manifest, encode_manifest
from cloudckpt.manifest.columns import encode_int_column, encode_u32
from cloudckpt.manifest.framing import frame, unframe
from cloudckpt.manifest.values import encode_value

KEYS = ("data/a/r0.bin", "data/a/r1.bin")


def small_manifest(**kw):
    """w: float32 (8,) in 4 chunks of 8 bytes (2 crcs each with 4-byte blocks); s: int64 scalar."""
    b = ManifestBuilder(
        world_size=2,
        metadata={"m": 1},
        checksum_block_size=4,
        created_at=5.0,
        structure=["d", [["w", ["x", "w"]], ["lr", ["v", "lr"]]]],
        **kw,
    )
    b.add_tensor("w", "float32", (8,))
    for i in range(4):
        b.add_chunk("w", (2 * i,), (2,), KEYS[i % 2], 8 * (i // 2), 8, (i, i + 100))
    b.add_tensor("s", "int64", ())
    b.add_chunk("s", (), (), KEYS[0], 16, 8, (7, 8))
    b.set_value("lr", (0.5, [1, 2]))
    return b.build()


def doc_of(m=None):
    """The msgpack document of a manifest (inside its checksummed frame)."""
    return msgpack.unpackb(unframe(encode_manifest(m or small_manifest()))[1], raw=False)


def pack(doc) -> bytes:
    """Stored bytes of a (possibly hostile) document, framed with a correct checksum."""
    return frame(msgpack.packb(doc, use_bin_type=True))


def test_round_trip_keeps_everything():
    m = small_manifest()
    d = decode_manifest(encode_manifest(m))
    assert (
        d.world_size,
        d.created_at,
        d.metadata,
        d.checksum_block_size,
        d.objects,
        d.structure,
    ) == (2, 5.0, {"m": 1}, 4, KEYS, m.structure)
    assert d.values == {"lr": (0.5, [1, 2])}
    assert list(d.tensors) == ["w", "s"]
    assert list(d.tensors["w"].chunks) == list(m.tensors["w"].chunks)
    assert d.tensors["w"].chunks[3].crc32c == (3, 103) and d.tensors["s"].chunks[0].crc32c == (7, 8)
    assert d.tensors["w"].chunks[-1].offsets == (6,)
    assert not d.tensors["w"].chunks.offsets.flags.writeable
    assert d.object_sizes() == {KEYS[0]: 24, KEYS[1]: 16} and d.total_bytes() == 40
    assert encode_manifest(d) == encode_manifest(m)


def test_without_structure_everything_else_is_decoded_and_checked():
    """``structure=False`` (a load's ranks other than the coordinator) leaves the nesting out,
    and only it: the rest is decoded as usual, and still checked."""
    m = small_manifest()
    d = decode_manifest(encode_manifest(m), structure=False)
    full = decode_manifest(encode_manifest(m))
    assert d.structure is None and full.structure == m.structure
    assert (d.values, list(d.tensors), d.objects) == (full.values, list(full.tensors), full.objects)
    assert list(d.tensors["w"].chunks) == list(full.tensors["w"].chunks)
    doc = doc_of()
    doc["structure"] = b"\xc1"  # not msgpack: only a full decode looks at it
    assert decode_manifest(pack(doc), structure=False).structure is None
    with pytest.raises(ManifestError):
        decode_manifest(pack(doc))
    doc = doc_of()
    doc["chunks"]["crc32c"] = doc["chunks"]["crc32c"][:-4]  # the rest is still checked
    with pytest.raises(ManifestError):
        decode_manifest(pack(doc), structure=False)


def test_builder_misuse_and_unsupported_metadata():
    b = ManifestBuilder(world_size=1)
    with pytest.raises(PlanningError, match="add_tensor first"):
        b.add_chunk("w", (0,), (1,), "k", 0, 4, (0,))
    b.add_tensor("w", "float32", (1,))
    with pytest.raises(PlanningError, match="needs 1 offsets"):
        b.add_chunk("w", (0, 0), (1, 1), "k", 0, 4, (0,))
    with pytest.raises(PlanningError, match="already holds"):
        b.add_tensor("w", "float32", (1,))
    with pytest.raises(UnsupportedValueError, match="'metadata'"):
        ManifestBuilder(world_size=1, metadata={"x": {1, 2}}).build()


def mutated(path: str, fn):
    doc = doc_of()
    node = doc
    parts = path.split(".")
    for p in parts[:-1]:
        node = node[p]
    if fn is None:
        del node[parts[-1]]
    else:
        node[parts[-1]] = fn(node[parts[-1]])
    return pack(doc)


CASES = [
    ("format", lambda v: "other", UnsupportedManifestVersion, "format"),
    ("version", lambda v: 3, UnsupportedManifestVersion, "version"),
    ("version", lambda v: 1, UnsupportedManifestVersion, "version"),  # a v1 document in a v2 frame
    ("version", lambda v: "1", UnsupportedManifestVersion, "version"),
    ("world_size", None, ManifestError, "world_size"),
    ("world_size", lambda v: "2", ManifestError, "world_size"),
    ("world_size", lambda v: 0, ManifestError, "world_size"),
    ("created_at", lambda v: True, ManifestError, "created_at"),
    ("checksum_block_size", lambda v: 0, ManifestError, "checksum_block_size"),
    (
        "metadata",
        lambda v: encode_value([1], key="m", allow_pickle=False),
        ManifestError,
        "metadata",
    ),
    (
        "metadata",
        lambda v: encode_value({1, 2}, key="m", allow_pickle=True),
        PickleNotAllowed,
        "metadata",
    ),
    ("objects", lambda v: ["../escape.bin", v[1]], ManifestError, "objects[0]"),
    ("objects", lambda v: [v[0], "/abs/path"], ManifestError, "objects[1]"),
    ("objects", lambda v: ["data\\a", v[1]], ManifestError, "objects[0]"),
    ("objects", lambda v: ["data//a", v[1]], ManifestError, "objects[0]"),
    ("objects", lambda v: ["data/./a", v[1]], ManifestError, "objects[0]"),
    ("objects", lambda v: ["", v[1]], ManifestError, "objects[0]"),
    ("objects", lambda v: [v[0], v[0]], ManifestError, "objects"),
    ("objects", lambda v: [v[0], 3], ManifestError, "objects[1]"),
    ("tensors.names", lambda v: ["w", "w"], ManifestError, 'tensors["w"]'),
    ("tensors.dtypes", lambda v: ["float128", v[1]], ManifestError, 'tensors["w"].dtype'),
    ("tensors.dtypes", lambda v: [["float32"], v[1]], ManifestError, 'tensors["w"].dtype'),
    ("tensors.shapes", lambda v: encode_int_column([-8]), ManifestError, 'tensors["w"].shape'),
    ("tensors.shapes", lambda v: encode_int_column([1 << 62]), ManifestError, 'tensors["w"].shape'),
    ("tensors.ndims", lambda v: encode_int_column([65, 0]), ManifestError, "tensors.ndims"),
    ("tensors.ndims", lambda v: encode_int_column([1]), ManifestError, "tensors.ndims"),
    ("tensors.chunk_counts", lambda v: encode_int_column([4, 9]), ManifestError, "chunks"),
    (
        "tensors.chunk_counts",
        lambda v: encode_int_column([-1, 1]),
        ManifestError,
        "tensors.chunk_counts",
    ),
    (
        "chunks.sizes",
        lambda v: encode_int_column([2, 2, 2, -2]),
        ManifestError,
        'tensors["w"].chunks[3]',
    ),
    (
        "chunks.offsets",
        lambda v: encode_int_column([0, 2, 4, 7]),
        ManifestError,
        'tensors["w"].chunks[3]',
    ),
    ("chunks.offsets", lambda v: encode_int_column([0, 2, 4]), ManifestError, "chunks.offsets"),
    (
        "chunks.byte_length",
        lambda v: encode_int_column([8, 8, 8, 8, 9]),
        ManifestError,
        'tensors["s"].chunks[0].byte_length',
    ),
    (
        "chunks.byte_length",
        lambda v: encode_int_column([8, 4, 8, 8, 8]),
        ManifestError,
        'tensors["w"].chunks[1].byte_length',
    ),
    (
        "chunks.object_index",
        lambda v: encode_int_column([0, 1, 2, 1, 0]),
        ManifestError,
        'tensors["w"].chunks[2].object_index',
    ),
    (
        "chunks.byte_offset",
        lambda v: encode_int_column([0, 0, -8, 8, 16]),
        ManifestError,
        'tensors["w"].chunks[2].byte_offset',
    ),
    ("chunks.crc32c", lambda v: v[:-4], ManifestError, "chunks.crc32c"),
    ("chunks.crc32c", lambda v: v + encode_u32([1]), ManifestError, "chunks.crc32c"),
    ("chunks.crc32c", lambda v: v[:-1], ManifestError, "chunks.crc32c"),
    (
        "chunks.offsets",
        lambda v: ["raw", 8, "zlib", 4, zlib.compress(b"\0" * 4096)],
        ManifestError,
        "chunks.offsets",
    ),
    (
        "chunks.offsets",
        lambda v: ["raw", 3, "none", 4, b"\0" * 12],
        ManifestError,
        "chunks.offsets",
    ),
    ("chunks.offsets", lambda v: ["rle", 1, "none", 4, b"\0" * 4], ManifestError, "chunks.offsets"),
    (
        "chunks.offsets",
        lambda v: ["raw", 1, "zlib", 4, b"garbage"],
        ManifestError,
        "chunks.offsets",
    ),
    ("chunks.offsets", lambda v: "nope", ManifestError, "chunks.offsets"),
    (
        "values",
        lambda v: {**v, "w": encode_value(1, key="w", allow_pickle=False)},
        ManifestError,
        'values["w"]',
    ),
    ("values", lambda v: {"lr": b"\xc1"}, ManifestError, 'values["lr"]'),
    ("values", lambda v: {"lr": "text"}, ManifestError, "values['lr']"),
    (
        "values",
        lambda v: {**v, "p": encode_value({1}, key="p", allow_pickle=True)},
        PickleNotAllowed,
        'values["p"]',
    ),
    (
        "structure",
        lambda v: encode_value(["x", "nope"], key="s", allow_pickle=False),
        ManifestError,
        "structure",
    ),
    (
        "structure",
        lambda v: encode_value(["d", [[1.5, ["x", "w"]]]], key="s", allow_pickle=False),
        ManifestError,
        "structure",
    ),
    (
        "structure",
        lambda v: encode_value(["q", []], key="s", allow_pickle=False),
        ManifestError,
        "structure",
    ),
    ("structure", lambda v: b"\xc1", ManifestError, "structure"),
]


@pytest.mark.parametrize(
    "path,fn,error,where", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_violations_name_their_path(path, fn, error, where):
    with pytest.raises(error) as exc:
        decode_manifest(mutated(path, fn))
    assert exc.value.path == where, str(exc.value)
    assert str(exc.value).startswith(where)


def test_element_count_must_match_the_shape():
    """Chunks inside the shape but holding fewer elements than it (a gap) are refused."""
    doc = doc_of()
    doc["tensors"]["chunk_counts"] = encode_int_column([3, 1])
    doc["chunks"]["offsets"] = encode_int_column([0, 2, 4])
    doc["chunks"]["sizes"] = encode_int_column([2, 2, 2])
    doc["chunks"]["object_index"] = encode_int_column([0, 1, 0, 0])
    doc["chunks"]["byte_offset"] = encode_int_column([0, 0, 8, 16])
    doc["chunks"]["byte_length"] = encode_int_column([8, 8, 8, 8])
    doc["chunks"]["crc32c"] = encode_u32(range(8))
    with pytest.raises(ManifestError) as exc:
        decode_manifest(pack(doc))
    assert exc.value.path == 'tensors["w"]' and "6 elements" in str(exc.value)


@pytest.mark.parametrize(
    "data,needle",
    [
        (b"", "empty"),
        (b"\xc1", "header truncated"),
        (b"\xc1ckpt\r\n\x1a\x02\x00", "header truncated"),
        (msgpack.packb([1, 2]), "not a cloudckpt manifest"),
        (msgpack.packb(msgpack.ExtType(1, b"")), "not a cloudckpt manifest"),
        (frame(msgpack.packb([1, 2])), "not a msgpack map"),
        (frame(b"\xc1"), "not a msgpack map"),
        (frame(msgpack.packb({"format": msgpack.ExtType(1, b"")})), "extension"),
        (frame(msgpack.packb({1: 2})), "top-level key"),
        (frame(b"\x82\xa6format\xa1a\xa6format\xa1b"), "field appears twice"),
        (frame(msgpack.packb({"format": "cloudckpt"}) + b"\xc0"), "1 bytes after"),
        ("text", "must be bytes"),
    ],
)
def test_not_a_manifest(data, needle):
    with pytest.raises(ManifestError, match=needle):
        decode_manifest(data)


def test_size_bound():
    data = encode_manifest(small_manifest())
    with pytest.raises(ManifestError, match="max_bytes"):
        decode_manifest(data, max_bytes=len(data) - 1)
    assert decode_manifest(data, max_bytes=len(data)).world_size == 2


def test_unknown_top_level_fields_are_ignored():
    doc = doc_of()
    doc["future_field"] = {"anything": [1, 2]}
    assert decode_manifest(pack(doc)).world_size == 2


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_corrupted_bytes_raise_only_manifest_errors(data):
    raw = bytearray(encode_manifest(small_manifest()))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(len(raw) // 2, len(raw)))
    try:
        decode_manifest(bytes(raw[:cut]))
    except ManifestError:
        pass


def test_decoded_arrays_are_views_not_objects():
    m = decode_manifest(encode_manifest(small_manifest()))
    chunks = m.tensors["w"].chunks
    assert chunks.offsets.shape == (4, 1) and np.array_equal(chunks.byte_offset, [0, 0, 8, 8])
    assert chunks[1:3] == [chunks[1], chunks[2]]


@pytest.mark.parametrize("how", ["built", "decoded"])
def test_the_column_view_is_read_only(how):
    import dataclasses

    m = small_manifest()
    if how == "decoded":
        m = decode_manifest(encode_manifest(m))
    cols = m.columns
    assert (
        cols.names == ("w", "s")
        and cols.name_index["s"] == 1
        and list(cols.chunk_start) == [0, 4, 5]
    )
    assert list(cols.offsets) == [0, 2, 4, 6] and m.shapes == ((8,), ())
    arrays = {
        f.name: getattr(cols, f.name)
        for f in dataclasses.fields(cols)
        if isinstance(getattr(cols, f.name), np.ndarray)
    }
    assert len(arrays) == 12
    for name, arr in arrays.items():
        assert not arr.flags.writeable, name
        if arr.size:
            with pytest.raises(ValueError):
                arr[0] = arr[0]
    with pytest.raises(TypeError):
        cols.name_index["x"] = 2
    with pytest.raises(TypeError):
        cols.value_blobs["x"] = b""
    with pytest.raises(dataclasses.FrozenInstanceError):
        cols.offsets = np.zeros(4, np.int64)
    assert m.columns is cols


def test_derived_values_are_made_once_per_manifest():
    m, other = small_manifest(), small_manifest()
    made = []
    assert m.derived("k", lambda x: made.append(x) or len(made)) == 1
    assert m.derived("k", lambda x: made.append(x) or len(made)) == 1
    assert other.derived("k", lambda x: made.append(x) or len(made)) == 2
    assert made == [m, other]
