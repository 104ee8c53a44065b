"""The checked-in v1, v2 and v3 manifests must keep decoding, to the same content, in every later
version; this version writes the v2 and v3 files byte for byte (the format cannot drift
silently): v3 when a manifest has fields of incremental checkpoints, v2 otherwise. The v2 file
with 8-byte chunk hashes (``chunks.hash64``, what every default save writes) likewise.

How the files were made: tests/manifest/golden.py (never regenerate them)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import pytest

from cloudckpt.checksum import block_crcs
from cloudckpt.errors import ManifestError, PickleNotAllowed
from cloudckpt.manifest.codec import decode_manifest, encode_manifest
from cloudckpt.manifest.framing import stored_version
from cloudckpt.manifest.lineage import compared_hashes
from cloudckpt.manifest.model import FORMAT_NAME, FORMAT_VERSION
from cloudckpt.manifest.records import ChunkRecord
from tests.manifest import golden

DATA = Path(__file__).resolve().parents[1] / "data"
GOLDEN = {
    1: DATA / "manifest_v1.msgpack",
    2: DATA / "manifest_v2.msgpack",
    3: DATA / "manifest_v3.msgpack",
}
HASH64 = DATA / "manifest_v2_hash64.msgpack"


@pytest.fixture(scope="module", params=sorted(GOLDEN), ids=lambda v: f"v{v}")
def version(request):
    return request.param


@pytest.fixture(scope="module")
def manifest(version):
    data = GOLDEN[version].read_bytes()
    assert stored_version(data) == version
    return decode_manifest(data, allow_pickle=True)


def _built(version: int):
    return golden.build_v3() if version >= 3 else golden.build()


def test_this_version_writes_the_golden_bytes(version):
    """v2 is what this cloudckpt writes for a manifest without incremental fields, v3 for one
    with them; v1 is what it writes when asked for the old layout."""
    assert (FORMAT_NAME, FORMAT_VERSION) == ("cloudckpt", 3)
    assert encode_manifest(_built(version), format_version=version) == GOLDEN[version].read_bytes()
    default = 1 if version == 1 else None  # the version each manifest needs by default
    assert encode_manifest(_built(version), format_version=default) == GOLDEN[version].read_bytes()


def test_a_manifest_with_incremental_fields_needs_version_3():
    for old in (1, 2):
        with pytest.raises(ValueError, match="needs format version 3"):
            encode_manifest(golden.build_v3(), format_version=old)


def test_the_v3_fields(manifest, version):
    if version < 3:
        assert (manifest.object_homes, manifest.base, manifest.attempt) == (("", ""), "", "")
        assert manifest.chunk_hashes is None and not manifest.references
        return
    assert manifest.object_homes == golden.HOMES and manifest.references
    assert (manifest.base, manifest.attempt) == (golden.BASE, golden.ATTEMPT)
    assert manifest.chunk_hashes.tobytes() == golden.chunk_hashes()
    assert manifest.chunk_hash_bytes == 16 and not manifest.chunk_hashes.flags.writeable
    # what a save compares: their first 8 bytes, the hash of the same bytes today
    eight = compared_hashes(manifest.chunk_hashes).tobytes()
    assert eight == golden.chunk_hashes(legacy=False)


def test_the_golden_file_with_8_byte_hashes():
    """A default save's manifest: version 2 (older readers read it and ignore the hashes),
    written byte for byte, decoding to the hashes of the chunks' bytes, every bit checked."""
    data = HASH64.read_bytes()
    assert stored_version(data) == 2
    assert encode_manifest(golden.build_hash64()) == data
    assert encode_manifest(golden.build_hash64(), format_version=2) == data
    m = decode_manifest(data, allow_pickle=True)
    assert m.chunk_hash_bytes == 8 and not m.chunk_hashes.flags.writeable
    assert m.chunk_hashes.tobytes() == golden.chunk_hashes(legacy=False)
    assert (m.object_homes, m.base, m.attempt) == (("", ""), "", "")
    plain = decode_manifest(GOLDEN[2].read_bytes(), allow_pickle=True)
    for name in plain.tensors:
        assert list(m.tensors[name].chunks) == list(plain.tensors[name].chunks)
    assert m.values == plain.values and m.structure == plain.structure
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ManifestError):
            decode_manifest(bytes(flipped), allow_pickle=True)


@pytest.mark.parametrize("framed", [2, 3])
def test_every_bit_of_a_framed_golden_file_is_checked(framed):
    data = GOLDEN[framed].read_bytes()
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ManifestError):
            decode_manifest(bytes(flipped), allow_pickle=True)


def test_header_fields(manifest):
    assert manifest.world_size == 2
    assert manifest.created_at == 1700000000.5
    assert manifest.cloudckpt_version == "0.1.0"
    assert manifest.checksum_block_size == 16
    assert manifest.metadata == {"step": 100, "note": "golden v1", "tags": ("a", "b")}
    assert type(manifest.metadata["tags"]) is tuple
    assert manifest.objects == (
        "data/00000000000000aa/r00000-0000.bin",
        "data/00000000000000aa/r00001-0000.bin",
    )
    assert manifest.object_sizes() == {manifest.objects[0]: 42, manifest.objects[1]: 44}
    assert manifest.object_extents() == {manifest.objects[0]: 44, manifest.objects[1]: 44}
    assert manifest.total_bytes() == 86


def test_tensors_and_chunks(manifest):
    assert list(manifest.tensors) == ["model.w", "model.b", "optim.step", "empty", "grid"]
    w = manifest.tensors["model.w"]
    assert (w.dtype, w.shape, len(w.chunks)) == ("float32", (4, 3), 2)
    assert w.chunks[0] == ChunkRecord((0, 0), (2, 3), 0, 0, 24, (1456454633, 3843260408))
    assert w.chunks[1].offsets == (2, 0) and w.chunks[1].object_index == 1
    assert manifest.tensors["model.b"].chunks[0] == ChunkRecord((0,), (3,), 0, 24, 6, (494848512,))
    step = manifest.tensors["optim.step"]
    assert (step.dtype, step.shape, list(step.chunks)) == (
        "int64",
        (),
        [ChunkRecord((), (), 1, 24, 8, (3159274190,))],
    )
    empty = manifest.tensors["empty"]
    assert (empty.dtype, empty.shape, len(empty.chunks)) == ("float32", (0, 2), 0)
    grid = manifest.tensors["grid"]
    assert [(c.offsets, c.object_index, c.byte_offset) for c in grid.chunks] == [
        ((0, 0), 0, 32),
        ((0, 3), 1, 32),
        ((2, 0), 0, 38),
        ((2, 3), 1, 38),
    ]
    for name in manifest.tensors:
        for i, chunk in enumerate(manifest.tensors[name].chunks):
            assert chunk.crc32c == block_crcs(golden.chunk_bytes(name, i), 16)


def test_values_and_structure(manifest):
    assert manifest.values["optim.param_groups"] == golden.VALUES["optim.param_groups"]
    assert type(manifest.values["optim.param_groups"][0]["betas"]) is tuple
    assert manifest.values["rng"] == {0: b"\x00\x01\xff", 1: 2**70, -3: -(2**65)}
    assert manifest.values["epoch"] == 7
    assert manifest.values["frac"] == Fraction(1, 3)
    assert manifest.structure == golden.STRUCTURE


def test_pickled_value_needs_opt_in(version):
    with pytest.raises(PickleNotAllowed, match="allow_pickle=True") as exc:
        decode_manifest(GOLDEN[version].read_bytes())
    assert exc.value.path == 'values["frac"]'


def test_the_maker_still_describes_the_file(manifest, version):
    rebuilt = decode_manifest(encode_manifest(_built(version)), allow_pickle=True)
    assert rebuilt.values == manifest.values and rebuilt.structure == manifest.structure
    for name in manifest.tensors:
        assert list(rebuilt.tensors[name].chunks) == list(manifest.tensors[name].chunks)
