"""Format version 3 (incremental checkpoints): homes never lead outside the run root, hashes and
the other fields are checked, a v2 document's fields of the same names are never followed, and
a manifest is relocated to run-relative keys only as distinct, valid keys."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.codec import decode_manifest, encode_manifest, read_document
from cloudckpt.manifest.framing import frame
from cloudckpt.manifest.lineage import folder_problem
from tests.manifest import golden


def _v3_fields() -> dict:
    return dict(read_document(encode_manifest(golden.build_v3())).fields)


def _encode(fields: dict, version: int = 3) -> bytes:
    return frame(msgpack.packb(fields, use_bin_type=True), version)


def _with(**changes) -> bytes:
    fields = _v3_fields()
    chunks = dict(fields["chunks"])
    if "hash" in changes:
        chunks["hash"] = changes.pop("hash")
    fields.update(changes, chunks=chunks)
    return _encode(fields)


@pytest.mark.parametrize(
    "home",
    [
        "..",
        ".",
        "a/b",
        "../step-1",
        "/abs",
        "a\\b",
        "x\x00y",
        "tab\there",
        "\x7f",
        "x" * 256,
        7,
        None,
        b"step",
    ],
)
def test_a_home_that_is_not_one_safe_segment_is_refused(home):
    data = _with(homes=["", home])
    with pytest.raises(ManifestError) as exc:
        decode_manifest(data, allow_pickle=True)
    assert exc.value.path == "homes[1]"


@given(st.text(min_size=1, max_size=40))
@settings(max_examples=300, deadline=None)
def test_every_accepted_home_stays_one_segment_below_the_run_root(home):
    fields = _v3_fields()
    fields["homes"] = ["", home]
    try:
        m = decode_manifest(_encode(fields), allow_pickle=True)
    except ManifestError:
        assert folder_problem(home) is not None
        return
    assert folder_problem(home) is None
    for h, key in zip(m.object_homes, m.objects):
        resolved = f"{h or 'self'}/{key}".split("/")
        assert ".." not in resolved and "." not in resolved and "" not in resolved
        assert resolved[0] == (h or "self")


@pytest.mark.parametrize(
    "changes, path",
    [
        (dict(homes=[""]), "homes"),
        (dict(homes="step-1"), "homes"),
        (dict(base="../up"), "base"),
        (dict(base="a/b"), "base"),
        (dict(base=3), "base"),
        (dict(attempt="xyz"), "attempt"),
        (dict(attempt="00000000000000BB"), "attempt"),
        (dict(hash=b"\x00" * 15), "chunks.hash"),
        (dict(hash=b""), "hash_algorithm"),
        (dict(hash_algorithm="md5"), "hash_algorithm"),
        (dict(hash_algorithm=""), "hash_algorithm"),
    ],
)
def test_malformed_v3_fields_are_refused(changes, path):
    with pytest.raises(ManifestError) as exc:
        decode_manifest(_with(**changes), allow_pickle=True)
    assert exc.value.path == path


@pytest.mark.parametrize("missing", ["homes", "base", "attempt", "hash_algorithm"])
def test_a_v3_manifest_needs_its_fields(missing):
    fields = _v3_fields()
    del fields[missing]
    with pytest.raises(ManifestError, match="missing field"):
        decode_manifest(_encode(fields), allow_pickle=True)


def test_a_v2_document_with_v3_fields_does_not_follow_them():
    """A version 2 manifest carrying "homes" (an older writer's, or a hostile one) reads its
    objects under its own root: the field is not part of version 2."""
    fields = _v3_fields()
    fields["version"] = 2
    fields["homes"] = ["..", "../../elsewhere"]
    m = decode_manifest(_encode(fields, 2), allow_pickle=True)
    assert m.object_homes == ("", "") and not m.references and m.chunk_hashes is None


def test_relocation_takes_only_distinct_valid_keys():
    m = golden.build_v3()
    moved = m.with_object_keys(["self/" + m.objects[0], "step-000000000007/" + m.objects[1]])
    assert moved.objects[1] == "step-000000000007/" + m.objects[1]
    assert moved.object_homes == ("", "") and m.object_homes == golden.HOMES
    assert list(moved.tensors["model.w"].chunks) == list(m.tensors["model.w"].chunks)
    for keys in (["a", "a"], ["a"], ["../a", "b"], ["a//b", "c"]):
        with pytest.raises(ManifestError):
            m.with_object_keys(keys)


# -- 8-byte chunk hashes (chunks.hash64, version 2 on) -------------------------------------------


def _hash64_fields(version: int = 2) -> dict:
    fields = dict(read_document(encode_manifest(golden.build_hash64())).fields)
    fields["version"] = version
    if version >= 3:
        fields.update(homes=["", ""], base="", attempt="", hash_algorithm="")
        fields["chunks"] = {**fields["chunks"], "hash": b""}
    return fields


def _with_hash64(value, version: int = 2) -> bytes:
    fields = _hash64_fields(version)
    fields["chunks"] = {**fields["chunks"], "hash64": value}
    return _encode(fields, version)


N_CHUNKS = 8  # the golden content's chunks


@pytest.mark.parametrize("version", [2, 3])
@pytest.mark.parametrize(
    "value",
    [
        b"\x00" * (8 * N_CHUNKS - 1),  # short
        b"\x00" * (8 * N_CHUNKS + 8),  # long: one hash too many
        b"\x00" * (16 * N_CHUNKS),  # the wrong width: 16 bytes a chunk
        b"\x00" * 8,  # one chunk's
        b"",
        "\x00" * (8 * N_CHUNKS),  # not bytes
        [0] * N_CHUNKS,
        None,
    ],
)
def test_a_hash_column_of_the_wrong_size_or_type_is_refused(version, value):
    """Never a silent reuse: a hash column that does not hold exactly 8 bytes per chunk is a
    ManifestError naming it, in either version that carries it."""
    with pytest.raises(ManifestError) as exc:
        decode_manifest(_with_hash64(value, version), allow_pickle=True)
    assert exc.value.path == "chunks.hash64"


def test_the_hash_column_reads_in_versions_2_and_3_and_is_ignored_in_version_1():
    good = golden.chunk_hashes(legacy=False)
    assert len(good) == 8 * N_CHUNKS
    for version in (2, 3):
        m = decode_manifest(_with_hash64(good, version), allow_pickle=True)
        assert m.chunk_hashes.tobytes() == good and m.chunk_hash_bytes == 8
    fields = _hash64_fields()
    fields["version"] = 1
    fields["chunks"] = {**fields["chunks"], "hash64": b"\x00"}  # a version 1 reader's view
    v1 = decode_manifest(msgpack.packb(fields, use_bin_type=True), allow_pickle=True)
    assert v1.chunk_hashes is None


def test_16_and_8_byte_hashes_together_are_refused():
    fields = _v3_fields()  # 16-byte "xxh3-128" hashes
    fields["chunks"] = {**fields["chunks"], "hash64": golden.chunk_hashes(legacy=False)}
    with pytest.raises(ManifestError, match="both") as exc:
        decode_manifest(_encode(fields), allow_pickle=True)
    assert exc.value.path == "chunks.hash64"


def test_legacy_hashes_in_the_new_column_are_refused():
    """16-byte digests put where 8-byte hashes go (a writer mixing the two) do not decode."""
    with pytest.raises(ManifestError):
        decode_manifest(_with_hash64(golden.chunk_hashes(legacy=True)), allow_pickle=True)


def test_a_constructor_refuses_a_hash_width_other_than_8_or_16():
    m = golden.build_hash64()
    with pytest.raises(ManifestError, match="8 or 16"):
        golden._with_lineage(
            m, chunk_hashes=golden.chunk_hashes(legacy=False) * 4, chunk_hash_bytes=32
        )
