"""Codec units of issue 13: the checksummed frame, chunks sharing bytes, shapes whose strides
overflow int64, the decode budget and the encoder's fallback, piecewise column decoding, and the
nesting depth the decoder accepts (the encoder's)."""

from __future__ import annotations

import math
import struct
import zlib

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ManifestError, UnsupportedManifestVersion, UnsupportedValueError
from cloudckpt.manifest.builder import ManifestBuilder
from cloudckpt.manifest.codec import DIMS_PER_BYTE, decode_manifest, encode_manifest
from cloudckpt.manifest.columns import (
    ColumnError,
    decode_int_column,
    encode_int_column,
    iter_int_column,
)
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE, MAX_ELEMENTS
from cloudckpt.manifest.framing import MAGIC, frame, stored_version, unframe
from cloudckpt.manifest.values import MAX_DEPTH, decode_value, encode_value

KEYS = ("data/a/r0.bin", "data/a/r1.bin")


def _small() -> bytes:
    b = ManifestBuilder(world_size=1, checksum_block_size=4, created_at=1.0)
    b.add_tensor("w", "float32", (2,))
    b.add_chunk("w", (0,), (2,), KEYS[0], 0, 8, (1, 2))
    b.set_value("step", 1234)
    return encode_manifest(b.build())


# -- the frame ----------------------------------------------------------------------------------


def test_the_frame_layout():
    data = _small()
    assert data[:8] == MAGIC and struct.unpack_from("<I", data, 8)[0] == 2
    assert stored_version(data) == 2 and unframe(data)[1].tobytes() == data[16:]
    payload = data[16:]
    assert stored_version(payload) == 1 and decode_manifest(frame(payload)).world_size == 1


@pytest.mark.parametrize("version", [0, 1, 4, 2**32 - 1])
def test_another_frame_version_is_unsupported(version):
    data = bytearray(_small())
    struct.pack_into("<I", data, 8, version)
    with pytest.raises(UnsupportedManifestVersion, match=f"version {version} is not supported"):
        decode_manifest(bytes(data))


def test_every_bit_flip_and_every_cut_is_refused():
    data = _small()
    for bit in range(8 * len(data)):
        flipped = bytearray(data)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(ManifestError):
            decode_manifest(bytes(flipped))
    for cut in range(len(data)):
        with pytest.raises(ManifestError):
            decode_manifest(data[:cut])


def test_a_bare_version_2_document_is_refused():
    """A version 2 document without its frame (its checksum stripped) is not read as v1."""
    with pytest.raises(UnsupportedManifestVersion):
        decode_manifest(_small()[16:])


# -- chunks sharing bytes -----------------------------------------------------------------------

_LAYOUT = st.lists(
    st.tuples(st.integers(0, 4), st.sampled_from([0, 1]), st.integers(0, 40)),
    min_size=1,
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(_LAYOUT)
def test_chunks_are_refused_exactly_when_their_bytes_overlap(layout):
    """Random (length, object, byte offset) chunks of one uint8 tensor: refused iff two
    non-empty byte ranges of one object overlap (brute force)."""
    b = ManifestBuilder(world_size=1, checksum_block_size=64, created_at=1.0)
    b.add_tensor("t", "uint8", (sum(n for n, _, _ in layout),))
    pos = 0
    for n, obj, off in layout:
        b.add_chunk("t", (pos,), (n,), KEYS[obj], off, n, (0,))
        pos += n
    ranges = [(obj, off, off + n) for n, obj, off in layout if n]
    overlap = any(
        a[0] == c[0] and a[1] < c[2] and c[1] < a[2]
        for i, a in enumerate(ranges)
        for c in ranges[i + 1 :]
    )
    try:
        m = b.build()
    except ManifestError as exc:
        assert overlap and "also those of" in str(exc), exc
        return
    assert not overlap
    assert decode_manifest(encode_manifest(m)).total_bytes() == m.total_bytes()


# -- shapes -------------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from([0, 1, 2, 3, 2**20, 2**30, 2**40, 2**62]), min_size=1, max_size=6),
    st.sampled_from(sorted(DTYPE_ITEMSIZE)),
)
def test_empty_shapes_are_refused_exactly_when_their_strides_overflow(dims, dtype):
    shape = (0, *dims)  # no element at all
    b = ManifestBuilder(world_size=1, created_at=1.0)
    b.add_tensor("e", dtype, shape)
    fits = math.prod(max(d, 1) for d in shape) * DTYPE_ITEMSIZE[dtype] <= MAX_ELEMENTS
    try:
        m = b.build()
    except ManifestError as exc:
        assert not fits and "too large" in str(exc)
        return
    assert fits and decode_manifest(encode_manifest(m)).tensors["e"].shape == shape


# -- the decode budget ----------------------------------------------------------------------------


def test_the_encoder_stays_within_the_decode_budget():
    """16-dimension tensor in 2,000 one-crc chunks: compressed, its coordinate columns would hold
    about 8 coordinates per byte; the encoder stores them uncompressed and the manifest decodes."""
    b = ManifestBuilder(world_size=1, checksum_block_size=1 << 20, created_at=1.0)
    shape = (2000,) + (1,) * 15
    b.add_tensor("t", "uint8", shape)
    for i in range(2000):
        b.add_chunk("t", (i,) + (0,) * 15, (1,) * 16, KEYS[0], i, 1, (0,))
    m = b.build()
    data = encode_manifest(m)
    doc = msgpack.unpackb(unframe(data)[1])
    assert doc["chunks"]["offsets"][2] == "none" and doc["chunks"]["sizes"][2] == "none"
    assert 2 * 16 + 2000 * 16 <= DIMS_PER_BYTE * len(data)
    assert list(decode_manifest(data).tensors["t"].chunks) == list(m.tensors["t"].chunks)
    doc["chunks"]["offsets"] = encode_int_column(unframe_offsets(doc), delta=True)
    doc["chunks"]["sizes"] = encode_int_column([1] * 32000, delta=True)
    with pytest.raises(ManifestError, match="chunk coordinates, more than 2 per byte"):
        decode_manifest(frame(msgpack.packb(doc, use_bin_type=True)))


def unframe_offsets(doc) -> list:
    return decode_int_column(doc["chunks"]["offsets"]).tolist()


# -- columns --------------------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300),
    st.booleans(),
    st.booleans(),
    st.integers(1, 64),
)
def test_piecewise_decoding_matches(values, delta, compress, block):
    arr = np.array(values, dtype=np.int64)
    column = encode_int_column(arr, delta=delta, compress=compress)
    assert decode_int_column(column, expected=len(arr)).tolist() == values
    pieces = list(iter_int_column(column, block=block))
    assert all(len(v) <= block for _, v in pieces)
    assert [x for _, v in pieces for x in v.tolist()] == values
    assert [s for s, _ in pieces] == list(range(0, len(values), block))


@pytest.mark.parametrize(
    "payload,needle",
    [
        (zlib.compress(b"\0" * 80) + b"x", "exactly"),  # trailing data
        (zlib.compress(b"\0" * 79), "inflates to 79"),  # one byte short
        (zlib.compress(b"\0" * 81), "exactly"),  # one byte long
        (zlib.compress(b"\0" * 80)[:-3], "exactly"),  # checksum cut
        (b"\x78\x9c" + b"\xff" * 30, "corrupt"),
    ],
)
def test_bad_zlib_payloads(payload, needle):
    with pytest.raises(ColumnError, match=needle):
        decode_int_column(["raw", 8, "zlib", 10, payload])


def test_a_zlib_bomb_never_inflates_past_one_block():
    bomb = zlib.compress(b"\0" * (64 << 20), 9)
    with pytest.raises(ColumnError, match="exactly"):
        decode_int_column(["raw", 8, "zlib", 8, bomb])


# -- nesting ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_DEPTH - 1, MAX_DEPTH, MAX_DEPTH + 1, 500])
@pytest.mark.parametrize("kind", ["list", "tuple", "dict"])
def test_the_decoder_accepts_exactly_the_depths_the_encoder_writes(depth, kind):
    value = 0
    for _ in range(depth):
        value = [value] if kind == "list" else (value,) if kind == "tuple" else {"k": value}
    try:
        data = encode_value(value, key="v", allow_pickle=False)
        encodable = True
    except UnsupportedValueError:
        encodable = False
        nested = value
        for _ in range(depth):  # the same shape, written by hand
            nested = nested[0] if kind != "dict" else nested["k"]
        data = msgpack.packb(value if kind != "tuple" else _as_lists(value), use_bin_type=True)
    assert encodable == (depth <= MAX_DEPTH)
    if encodable:
        assert decode_value(data, key="v", allow_pickle=False) == value
    else:
        with pytest.raises(ManifestError, match="nested deeper"):
            decode_value(data, key="v", allow_pickle=False)


def _as_lists(value):
    out, stack = [], []
    while isinstance(value, tuple):
        stack.append(value)
        value = value[0]
    out = value
    for _ in stack:
        out = [out]
    return out


def test_pickled_values_are_not_held_to_the_depth():
    """A value too deep for msgpack is pickled on save (with the opt-in); loading it back is
    fine: pickled payloads are leaves for the depth check."""
    value = 0
    for _ in range(MAX_DEPTH + 50):
        value = [value]
    data = encode_value(value, key="v", allow_pickle=True)
    assert decode_value(data, key="v", allow_pickle=True) == value


DEEP_TUPLES = """
import msgpack
from cloudckpt.errors import ManifestError
from cloudckpt.manifest.values import decode_value, encode_value
value = 0
for _ in range(200):
    value = (value,)
assert decode_value(encode_value(value, key="v", allow_pickle=False), key="v",
                    allow_pickle=False) == value
data = b"\\xc0"
for _ in range(5000):
    data = msgpack.packb(msgpack.ExtType(1, b"\\x91" + data))
try:
    decode_value(data, key="v", allow_pickle=False)
except ManifestError as exc:
    print("refused:", exc)
"""


def test_deeply_nested_tuples_neither_crash_nor_pass():
    """Tuples are msgpack extensions whose payloads were decoded by nested msgpack calls: 200
    levels (what the encoder writes) overflowed the C stack, a segfault; 5000 levels ~ 15 KB
    of hostile manifest. Run in a subprocess: a crash must fail this test, not the run."""
    import subprocess
    import sys

    res = subprocess.run(
        [sys.executable, "-c", DEEP_TUPLES], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, (res.returncode, res.stderr[-500:])
    assert "refused: " in res.stdout and "nested deeper than 200" in res.stdout
