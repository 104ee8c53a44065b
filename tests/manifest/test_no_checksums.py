"""Manifests without data checksums (``Manifest(checksums=False)``): only ever built in memory
for foreign files (safetensors), never decoded from stored bytes nor encoded, so a cloudckpt
checkpoint cannot lose its corruption detection; their read windows are exact element runs."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ManifestError
from cloudckpt.manifest.codec import decode_manifest, encode_manifest
from cloudckpt.manifest.model import Manifest
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import plan_run_windows, plan_windows
from tests.planning.test_load_plan import manifest_with
from tests.planning.test_windows import _flat_indices, boxes
from tests.reliability.hostile import doc_of, pack

ITEMSIZE = {"float32": 4, "int64": 8, "bfloat16": 2, "bool": 1}


def unchecked(dtype: str, shape, *, start: int = 0, **overrides) -> Manifest:
    """A one-tensor, one-chunk manifest without checksums, its bytes at ``start``."""
    n = math.prod(shape) * ITEMSIZE[dtype]
    kw = dict(
        world_size=1,
        created_at=0.0,
        cloudckpt_version="t",
        metadata={},
        checksum_block_size=0,
        checksums=False,
        objects=["m.safetensors"],
        tensor_names=["t"],
        tensor_dtypes=[dtype],
        tensor_shapes=[tuple(shape)],
        chunk_counts=[1],
        chunk_offsets=[0] * len(shape),
        chunk_sizes=list(shape),
        chunk_object_index=[0],
        chunk_byte_offset=[start],
        chunk_byte_length=[n],
        chunk_crcs=[],
        value_blobs={},
    )
    kw.update(overrides)
    return Manifest(**kw)


def test_a_manifest_without_checksums_has_no_crcs_and_cannot_be_stored():
    m = unchecked("float32", (3, 4))
    assert not m.checksums and m.tensors["t"].chunks[0].crc32c == ()
    with pytest.raises(ManifestError, match="cannot be stored"):
        encode_manifest(m)


@pytest.mark.parametrize(
    "overrides",
    [
        {"checksum_block_size": 4096},  # no checksums, yet a block size
        {"chunk_crcs": [1]},  # no checksums, yet crcs
        {"checksums": 0},  # not a bool
        {"checksums": True},  # checksums with a block size of 0
    ],
)
def test_inconsistent_checksum_settings_are_refused(overrides):
    with pytest.raises(ManifestError):
        unchecked("float32", (3, 4), **overrides)


def test_a_stored_manifest_claiming_no_checksums_is_refused():
    doc = doc_of(encode_manifest(manifest_with({"w": ("float32", (4, 4), [((0, 0), (4, 4))])})))
    doc["checksum_block_size"] = 0
    with pytest.raises(ManifestError, match="checksum_block_size"):
        decode_manifest(pack(doc))
    doc["chunks"]["crc32c"] = b""  # what an in-memory manifest without checksums holds
    with pytest.raises(ManifestError, match="crc32c"):
        decode_manifest(pack(doc))
    doc["checksums"] = False  # a field the format does not have changes nothing
    with pytest.raises(ManifestError):
        decode_manifest(pack(doc))


@settings(max_examples=300, deadline=None)
@given(boxes(), st.sampled_from(sorted(ITEMSIZE)), st.integers(1, 200), st.integers(0, 3))
def test_windows_read_exactly_the_region_span(box, dtype, max_bytes, start):
    sizes, offsets, lengths = box
    itemsize = ITEMSIZE[dtype]
    m = unchecked(dtype, sizes, start=start * 8)
    region = Region("t", 0, offsets, lengths, math.prod(lengths) * itemsize)
    assert plan_run_windows(m, region, max_bytes) is None  # no verified blocks: no direct landing
    windows = plan_windows(m, region, max_bytes)
    flat = _flat_indices(offsets, lengths, sizes)
    first, last = int(flat.min()), int(flat.max())
    seen = np.zeros(lengths, dtype=np.int64)
    chunk = np.arange(math.prod(sizes), dtype=np.int64)
    prev_end = start * 8 + first * itemsize
    for w in windows:
        assert w.crc32c == (None,) and w.block_size == w.length
        assert w.start >= prev_end and (w.start - start * 8) % itemsize == 0
        assert w.length <= max(max_bytes, itemsize)
        prev_end = w.start + w.length
        window = chunk[(w.start - start * 8) // itemsize : (prev_end - start * 8) // itemsize]
        for sub in w.boxes:
            view = (
                np.lib.stride_tricks.as_strided(
                    window[sub.first :], shape=sub.lengths, strides=tuple(s * 8 for s in w.strides)
                )
                if sub.lengths
                else window[sub.first]
            )
            abs_off = tuple(a + b for a, b in zip(offsets, sub.offsets))
            assert np.array_equal(
                np.asarray(view), _flat_indices(abs_off, sub.lengths, sizes).reshape(sub.lengths)
            )
            seen[tuple(slice(o, o + n) for o, n in zip(sub.offsets, sub.lengths))] += 1
    assert (seen == 1).all()
    assert windows[0].start == start * 8 + first * itemsize  # nothing before the region
    assert prev_end <= start * 8 + (last + 1) * itemsize  # nothing after it
