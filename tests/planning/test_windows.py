"""Read windows (planning/load/windows.py, windows_many.py): every element of a region in exactly
one sub-box of one window, block-aligned windows that never share a block, bounded window size,
views that land on the right elements."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.errors import ManifestError
from cloudckpt.planning.load.plan import Region
from cloudckpt.planning.load.windows import (
    boxes_in_flat_range,
    plan_run_windows,
    plan_windows,
    row_major_strides,
)
from cloudckpt.planning.load.windows_many import plan_run_windows_many, plan_windows_many
from tests.planning.test_load_plan import manifest_with


def _flat_indices(offsets, lengths, sizes):
    """Flat indices (row-major in ``sizes``) of the box's elements, in box order."""
    grids = np.meshgrid(*[np.arange(o, o + n) for o, n in zip(offsets, lengths)], indexing="ij")
    strides = row_major_strides(sizes)
    return sum((g * s for g, s in zip(grids, strides)), np.zeros(lengths, dtype=np.int64)).reshape(
        -1
    )


DTYPES = st.sampled_from(["float32", "int64", "bfloat16", "bool"])
BLOCKS = st.sampled_from([1, 3, 4, 8, 16, 24, 64])  # odd sizes split elements across blocks


def _one_chunk_region(box, dtype: str, block: int):
    """A manifest holding one tensor of ``box``'s sizes as one chunk, and the box as a region."""
    sizes, offsets, lengths = box
    itemsize = {"float32": 4, "int64": 8, "bfloat16": 2, "bool": 1}[dtype]
    m = manifest_with({"t": (dtype, sizes, [((0,) * len(sizes), sizes)])}, block=block)
    return m, Region("t", 0, offsets, lengths, math.prod(lengths) * itemsize), itemsize


@st.composite
def boxes(draw):
    ndim = draw(st.integers(0, 4))
    sizes = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in sizes)
    lengths = tuple(draw(st.integers(1, s - o)) for s, o in zip(sizes, offsets))
    return sizes, offsets, lengths


@settings(max_examples=300, deadline=None)
@given(boxes(), st.data())
def test_boxes_in_flat_range_cover_exactly_the_elements_in_range(box, data):
    sizes, offsets, lengths = box
    total = math.prod(sizes)
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    parts = boxes_in_flat_range(offsets, lengths, sizes, lo, hi)
    assert len(parts) <= 2 * len(sizes) + 1
    got = []
    for o, n in parts:
        assert all(x >= 1 for x in n)
        abs_off = tuple(a + b for a, b in zip(offsets, o))
        assert all(a + b <= a0 + b0 for a, b, a0, b0 in zip(o, n, (0,) * len(o), lengths))
        got.extend(_flat_indices(abs_off, n, sizes).tolist())
    want = [i for i in _flat_indices(offsets, lengths, sizes).tolist() if lo <= i < hi]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))


@settings(max_examples=300, deadline=None)
@given(boxes(), DTYPES, BLOCKS, st.integers(1, 200))
def test_windows_cover_region_once_and_view_the_right_bytes(box, dtype, block, max_bytes):
    sizes, offsets, lengths = box
    m, region, itemsize = _one_chunk_region(box, dtype, block)
    windows = plan_windows(m, region, max_bytes)
    chunk_bytes = math.prod(sizes) * itemsize
    chunk = np.arange(math.prod(sizes), dtype=np.int64)  # element i holds value i
    seen = np.zeros(lengths, dtype=np.int64)
    blocks_used: set[int] = set()
    for w in windows:
        assert w.start % block == 0 or w.start + w.length == chunk_bytes
        assert w.start % itemsize == 0  # the view starts on an element
        assert w.length <= max(max_bytes, block) + block * itemsize
        nblocks = len(w.crc32c)
        assert nblocks == -(-w.length // block)
        mine = set(range(w.first_block, w.first_block + nblocks))
        assert not (mine & blocks_used)
        blocks_used |= mine
        window = chunk[w.start // itemsize : (w.start + w.length) // itemsize]
        for sub in w.boxes:
            view = (
                np.lib.stride_tricks.as_strided(
                    window[sub.first :], shape=sub.lengths, strides=tuple(s * 8 for s in w.strides)
                )
                if sub.lengths
                else window[sub.first]
            )
            abs_off = tuple(a + b for a, b in zip(offsets, sub.offsets))
            expect = _flat_indices(abs_off, sub.lengths, sizes).reshape(sub.lengths)
            assert np.array_equal(np.asarray(view), expect)
            idx = tuple(slice(o, o + n) for o, n in zip(sub.offsets, sub.lengths))
            seen[idx] += 1
    assert (seen == 1).all()


def test_strided_region_skips_windows_without_its_elements():
    # rows of 1024 float32 (4 KiB); the region takes 1 column: blocks of 4 KiB hold one row
    # each, so every block holds an element; with a 2-column region in 8 KiB rows, half skip
    m = manifest_with({"t": ("float32", (8, 2048), [((0, 0), (8, 2048))])}, block=4096)
    windows = plan_windows(m, Region("t", 0, (0, 0), (8, 2), 64), 4096)
    assert [w.first_block for w in windows] == [0, 2, 4, 6, 8, 10, 12, 14]


def test_whole_chunk_windows_are_max_bytes_apart():
    m = manifest_with({"t": ("float32", (1 << 20,), [((0,), (1 << 20,))])}, block=1 << 20)
    windows = plan_windows(m, Region("t", 0, (0,), (1 << 20,), 4 << 20), 2 << 20)
    assert [(w.start, w.length) for w in windows] == [(0, 2 << 20), (2 << 20, 2 << 20)]
    assert [len(w.boxes) for w in windows] == [1, 1]


def test_region_past_chunk_is_a_manifest_error():
    m = manifest_with({"t": ("float32", (4,), [((0,), (4,))])})
    with pytest.raises(ManifestError):
        plan_windows(m, Region("t", 0, (2,), (4,), 16), 1 << 20)


def test_empty_region_has_no_windows():
    m = manifest_with({"t": ("float32", (4, 0), [((0, 0), (4, 0))])})
    assert plan_windows(m, Region("t", 0, (0, 0), (4, 0), 0), 1 << 20) == []


@settings(max_examples=300, deadline=None)
@given(boxes(), DTYPES, BLOCKS, st.integers(1, 200))
def test_run_windows_cover_contiguous_regions_in_order(box, dtype, block, max_bytes):
    sizes, offsets, lengths = box
    m, region, itemsize = _one_chunk_region(box, dtype, block)
    flat = _flat_indices(offsets, lengths, sizes)
    runs = plan_run_windows(m, region, max_bytes)
    if len(flat) == 0 or flat[-1] - flat[0] + 1 != len(flat):
        assert runs is None
        return
    nbytes = len(flat) * itemsize
    chunk = np.arange(math.prod(sizes) * itemsize, dtype=np.int64)  # byte i of the chunk
    got = np.full(nbytes, -1, dtype=np.int64)
    pos = 0
    for w in runs:
        assert w.lo == pos and w.lo % itemsize == 0 and w.hi > w.lo
        for b in w.blocks:
            assert b.offset % block == 0 and b.length <= block
            got[b.region_pos : b.region_pos + b.keep_len] = chunk[
                b.offset + b.keep_at : b.offset + b.keep_at + b.keep_len
            ]
        assert sum(b.keep_len for b in w.blocks) == w.hi - w.lo
        pos = w.hi
    assert pos == nbytes
    assert np.array_equal(got, np.arange(flat[0] * itemsize, flat[0] * itemsize + nbytes))


def _chunked_manifest(tensors, block):
    """tensors: {name: (dtype, shape, rows per chunk)}: chunks cut along dim 0 (whole for 0-d
    tensors), back to back in one object, every block's crc distinct."""
    from cloudckpt.manifest.builder import ManifestBuilder
    from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
    from cloudckpt.manifest.model import crc_counts

    b = ManifestBuilder(world_size=1, checksum_block_size=block, created_at=0.0)
    pos, crc = 0, 0
    for name, (dtype, shape, rows) in tensors.items():
        b.add_tensor(name, dtype, shape)
        cuts = (
            [((), ())]
            if not shape
            else [
                ((r,) + (0,) * (len(shape) - 1), (min(rows, shape[0] - r),) + shape[1:])
                for r in range(0, max(shape[0], 1), rows)
            ]
        )
        for off, size in cuts:
            nbytes = math.prod(size) * DTYPE_ITEMSIZE[dtype]
            count = int(crc_counts(np.array([nbytes]), block)[0])
            b.add_chunk(
                name, off, size, "data/x/r0.bin", pos, nbytes, list(range(crc, crc + count))
            )
            pos, crc = pos + nbytes, crc + count
    return b.build()


@st.composite
def many_regions(draw):
    """A manifest of a few tensors and regions inside their chunks, some of them bad (an
    unknown name or chunk, a box past its chunk, an empty box)."""
    tensors = {}
    for i in range(draw(st.integers(1, 4))):
        shape = tuple(draw(st.integers(0, 5)) for _ in range(draw(st.integers(0, 3))))
        tensors[f"t{i}"] = (draw(DTYPES), shape, draw(st.integers(1, 3)))
    block = draw(BLOCKS)
    m = _chunked_manifest(tensors, block)
    regions = []
    for _ in range(draw(st.integers(0, 8))):
        name = draw(st.sampled_from(sorted(tensors)))
        record = m.tensors[name]
        kind = draw(st.sampled_from(["ok"] * 6 + ["name", "chunk", "past", "empty"]))
        ci = draw(st.integers(0, len(record.chunks) - 1)) if len(record.chunks) else 0
        sizes = record.chunks[ci].sizes if len(record.chunks) else ()
        offsets = tuple(draw(st.integers(0, max(s - 1, 0))) for s in sizes)
        lengths = tuple(
            draw(st.integers(min(1, s - o), max(s - o, 0))) for s, o in zip(sizes, offsets)
        )
        if kind == "name":
            name = "missing"
        elif kind == "chunk":
            ci = len(record.chunks) + 1
        elif kind == "past" and sizes:
            lengths = (sizes[0] - offsets[0] + 1,) + lengths[1:]
        elif kind == "empty" and sizes:
            lengths = (0,) + lengths[1:]
        nbytes = math.prod(lengths) * DTYPE_ITEMSIZE_OF[record.dtype]
        regions.append(Region(name, ci, offsets, lengths, nbytes))
    return m, regions, draw(st.integers(1, 200))


DTYPE_ITEMSIZE_OF = {"float32": 4, "int64": 8, "bfloat16": 2, "bool": 1}


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the outcome compared is the error itself
        return (type(exc), str(exc))


@settings(max_examples=300, deadline=None)
@given(many_regions())
def test_windows_of_many_regions_are_those_of_each(case):
    """Locating regions together (a load's every region at once) gives each region the very
    windows, or the very error, of planning it alone."""
    m, regions, max_bytes = case
    for many, one in ((plan_windows_many, plan_windows), (plan_run_windows_many, plan_run_windows)):
        singles = [_outcome(lambda r=r, one=one: one(m, r, max_bytes)) for r in regions]
        errors = [s for s in singles if isinstance(s, tuple) and isinstance(s[0], type)]
        got = _outcome(lambda many=many: many(m, regions, max_bytes))
        assert got == (errors[0] if errors else singles)
