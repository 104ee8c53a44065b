"""The pure parts of cloudckpt.dcp, over generated cases: DCP items made without copying tensors
are what torch.load reads back, block crcs over segments equal those of the joined bytes, and
the byte span of a box of a stored chunk holds exactly the box."""

from __future__ import annotations

import io

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.checksum import block_crcs
from cloudckpt.dcp.items import block_crcs_of, bytes_item, region_span, tensor_item

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.uint8,
    torch.complex64,
    torch.float64,
]


def _tensors():
    base = torch.arange(60.0).reshape(3, 4, 5)
    yield base  # owns its storage: sent from its memory
    yield base.transpose(0, 2)  # strided view
    yield base[1]  # view into a larger storage
    yield base[:, 1:3]  # strided slice
    yield torch.tensor(7, dtype=torch.int64)  # 0-d
    yield torch.empty(0, 3)  # no elements
    yield torch.randn(4, 3, dtype=torch.complex64).conj()  # lazy conjugate
    for dtype in DTYPES:
        yield (torch.rand(17, 3) * 50).to(dtype)


def test_a_tensor_item_is_what_torch_load_reads_back():
    for t in _tensors():
        item = tensor_item(t)
        data = b"".join(bytes(s) for s in item.segments)
        back = torch.load(io.BytesIO(data), weights_only=True)
        assert back.dtype == t.dtype and torch.equal(back, t.resolve_conj()), t.shape
        raw = data[item.data_offset : item.data_offset + item.data_length]
        assert raw == t.resolve_conj().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        assert item.length == len(data)


def test_an_owned_tensor_is_sent_from_its_own_memory():
    t = torch.randn(1000)
    item = tensor_item(t)
    t.add_(1)  # the data segment is the tensor's memory: it sees the change
    assert bytes(item.segments[1]) == t.numpy().tobytes()


def test_a_bytes_item_is_the_planners_bytes():
    buf = io.BytesIO(b"abc" * 10)
    item = bytes_item(buf)
    assert b"".join(bytes(s) for s in item.segments) == b"abc" * 10 and item.data_offset == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(max_size=40), max_size=6), st.integers(1, 33))
def test_block_crcs_over_segments_equal_those_of_the_joined_bytes(parts, block):
    joined = b"".join(parts)
    assert block_crcs_of([memoryview(p) for p in parts], block) == list(block_crcs(joined, block))


@st.composite
def _boxes(draw):
    sizes = draw(st.lists(st.integers(0, 5), min_size=0, max_size=4))
    offsets, lengths = [], []
    for n in sizes:
        o = draw(st.integers(0, n))
        offsets.append(o)
        lengths.append(draw(st.integers(0, n - o)))
    return sizes, offsets, lengths, draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=300, deadline=None)
@given(_boxes())
def test_the_span_of_a_box_holds_exactly_it(case):
    sizes, offsets, lengths, itemsize = case
    a, b, contiguous = region_span(sizes, offsets, lengths, itemsize)
    flat = np.arange(int(np.prod(sizes)) if sizes else 1).reshape(sizes)
    box = flat[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))].reshape(-1)
    if box.size == 0:
        assert (a, b, contiguous) == (0, 0, True)
        return
    assert a == box.min() * itemsize and b == (box.max() + 1) * itemsize
    assert contiguous == (box.size * itemsize == b - a)
    if contiguous:
        assert (np.diff(box) == 1).all()
