"""The reader against a LocalStore (world 1, in process): regions land through verified sinks
(contiguous destinations of the stored dtype) or through windows in pooled buffers (any other
destination, dtype converted); a corrupt block raises ChecksumError and none of its bytes lands.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.dataplane.destinations import dest_view, fetch_into, sub_view
from cloudckpt.dataplane.reader import DirectPiece, WindowPiece, fetch_regions, plan_pieces
from cloudckpt.errors import ChecksumError
from cloudckpt.runtime.loop import run_coroutine
from tests.dataplane.helpers import box, data_path, piece, plan, store_at, write_tensors

BLOCK = 256
ROWS, COLS = 40, 24


def _state():
    g = torch.Generator().manual_seed(11)
    return {
        "f": torch.randn(ROWS, COLS, generator=g),
        "h": torch.randn(ROWS, COLS, generator=g).to(torch.bfloat16),
        "i": torch.randint(-1000, 1000, (ROWS * 3,), generator=g),
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader")
    store = store_at(root)
    state = _state()
    manifest, *_ = write_tensors(store, state, rows=7, block=BLOCK, object_size=4096)
    return store, manifest, state


def _fetch(store, manifest, requests, dests, **kw):
    """fetch_regions of the plan's regions into ``dests`` (as fetch_into, with options)."""
    p = plan(manifest, requests)
    by_region = {}
    for item in p.reads:
        by_region.setdefault(item.region, []).append(item)

    def consume(region, offsets, tensor):
        for item in by_region[region.region]:
            sub_view(dest_view(dests, item), offsets, tensor.shape).copy_(tensor)

    def targets(region):
        return [dest_view(dests, item) for item in by_region[region.region]]

    return run_coroutine(
        fetch_regions(
            store,
            manifest,
            [v[0] for v in by_region.values()],
            consume=consume,
            targets=targets,
            **kw,
        )
    )


def test_whole_tensors_land_through_sinks_others_through_windows(written):
    store, manifest, state = written
    same = [torch.full_like(t, 7) for t in state.values()]
    requests = [piece(n, t, (0,) * t.dim(), t.shape) for n, t in state.items()]
    regions = [item.region for item in plan(manifest, requests).reads]
    kinds = {
        type(p)
        for p in plan_pieces(
            manifest,
            regions,
            lambda r: [dest_view(same, i) for i in plan(manifest, requests).reads if i.region == r],
            1024,
        )
    }
    assert kinds == {DirectPiece}  # every chunk is one run, every destination contiguous
    fetched = run_coroutine(
        fetch_into(store, manifest, plan(manifest, requests).reads, same, 1 << 20)
    )
    assert fetched == sum(t.numel() * t.element_size() for t in state.values())
    for got, want in zip(same, state.values()):
        assert torch.equal(got, want)
    # transposed destinations cannot take bytes in place: windows, then copies
    strided = [
        torch.full((t.shape[1], t.shape[0]), 7, dtype=t.dtype).t()
        if t.dim() == 2
        else torch.full((t.numel() * 2,), 7, dtype=t.dtype)[::2]
        for t in state.values()
    ]
    assert {type(p) for p in plan_pieces(manifest, regions, lambda r: [strided[0]], 1024)} == {
        WindowPiece
    }
    run_coroutine(fetch_into(store, manifest, plan(manifest, requests).reads, strided, 1 << 20))
    for got, want in zip(strided, state.values()):
        assert torch.equal(got, want)


@st.composite
def boxes(draw):
    name = draw(st.sampled_from(["f", "h", "i"]))
    shape = (ROWS, COLS) if name != "i" else (ROWS * 3,)
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    sizes = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    dtype = draw(st.sampled_from([None, torch.float64, torch.float32, torch.int64]))
    contiguous = draw(st.booleans())
    return name, offsets, sizes, dtype, contiguous


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(boxes(), min_size=1, max_size=4),
    st.sampled_from([BLOCK, 3 * BLOCK, 4096]),
    st.sampled_from([BLOCK, 1 << 20]),
)
def test_any_box_lands_exactly_with_dtype_conversion(written, requests, window_bytes, max_bytes):
    store, manifest, state = written
    specs, dests, wants = [], [], []
    for name, offsets, sizes, dtype, contiguous in requests:
        src = state[name]
        dtype = dtype or src.dtype
        dest = torch.full(sizes, 5, dtype=dtype)
        if not contiguous and len(sizes) == 2:
            dest = torch.full(sizes[::-1], 5, dtype=dtype).t()
        specs.append(piece(name, src, offsets, sizes, dtype=src.dtype))
        dests.append(dest)
        wants.append(box(src, offsets, sizes).to(dtype))
    fetched = _fetch(store, manifest, specs, dests, window_bytes=window_bytes, max_bytes=max_bytes)
    regions = {item.region for item in plan(manifest, specs).reads}
    assert fetched >= sum(r.nbytes for r in regions)  # whole blocks around every region
    assert fetched <= sum(r.nbytes + 2 * BLOCK * r.lengths[0] for r in regions)
    for got, want in zip(dests, wants):
        assert torch.equal(got, want)


def _corrupt_first_block_of(tmp_path, manifest, name: str, chunk: int) -> None:
    c = manifest.tensors[name].chunks[chunk]
    path = data_path(tmp_path, manifest.objects[c.object_index])
    body = bytearray(path.read_bytes())
    body[c.byte_offset + 3] ^= 0xFF
    path.write_bytes(bytes(body))


@pytest.mark.parametrize("contiguous", [True, False], ids=["sinks", "windows"])
def test_a_corrupt_block_raises_checksum_error_and_nothing_of_it_lands(tmp_path, contiguous):
    store = store_at(tmp_path)
    state = _state()
    manifest, *_ = write_tensors(store, state, rows=7, block=BLOCK, object_size=4096)
    _corrupt_first_block_of(tmp_path, manifest, "f", 0)
    dest = torch.full((ROWS, COLS), 5.0) if contiguous else torch.full((COLS, ROWS), 5.0).t()
    requests = [piece("f", state["f"], (0, 0), (ROWS, COLS))]
    with pytest.raises(ChecksumError) as info:
        _fetch(store, manifest, requests, [dest], window_bytes=1 << 20)
    assert info.value.key == manifest.objects[manifest.tensors["f"].chunks[0].object_index]
    first_block = BLOCK // 4  # float32 elements in the corrupted block
    assert (
        (dest.reshape(-1)[:first_block] == 5).all()
        if contiguous
        else (dest.contiguous().reshape(-1)[:first_block] == 5).all()
    )
    if not contiguous:  # one window batch per object: nothing of the failed batch landed
        c0 = manifest.tensors["f"].chunks[0]
        rows_in_object = [
            c for c in manifest.tensors["f"].chunks if c.object_index == c0.object_index
        ]
        untouched = sum(int(c.sizes[0]) for c in rows_in_object)
        assert (dest[:untouched] == 5).all()


@st.composite
def landing_cases(draw):
    """A destination (contiguous or not, some dtype) and a box inside it."""
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
    layout = draw(st.sampled_from(["contiguous", "odd size-1 strides", "transposed", "sliced"]))
    return shape, offsets, lengths, dtype, layout


def _destination(shape, dtype, layout):
    n = 1
    for s in shape:
        n *= s
    base = torch.arange(n).to(dtype).reshape(shape)
    if layout == "odd size-1 strides" and base.dim():
        strides = [st_ if s != 1 else 97 for s, st_ in zip(shape, base.stride())]
        base = base.as_strided(shape, strides)
    elif layout == "transposed" and base.dim() >= 2:
        base = base.transpose(0, 1).contiguous().transpose(0, 1)
    elif layout == "sliced" and base.dim():
        base = torch.arange(2 * n).to(dtype).reshape((2 * shape[0],) + shape[1:])[::2]
    return base


@settings(max_examples=300, deadline=None)
@given(landing_cases(), st.sampled_from([torch.float32, torch.bfloat16]))
def test_landing_views_are_the_byte_views_of_the_boxes(case, stored):
    """``DestinationBytes.views``: a box lands as bytes only when its view of the destination is
    byte-viewable and of the stored dtype, and then in the very bytes of that view; always
    when the destination itself is byte-viewable (a box that is one run of a strided
    destination goes through a window instead)."""
    from types import SimpleNamespace

    from cloudckpt.dataplane.buffers import byte_view, is_byte_viewable
    from cloudckpt.dataplane.destinations import DestinationBytes

    shape, offsets, lengths, dtype, layout = case
    dest = _destination(shape, dtype, layout)
    item = SimpleNamespace(request_index=0, dest_offsets=offsets, lengths=lengths)
    view = dest_view([dest], item)
    got = DestinationBytes([dest]).views([item], stored)
    if not (is_byte_viewable(view) and dest.dtype == stored):
        assert got is None
        return
    if not is_byte_viewable(dest):
        assert got is None
        return
    assert got is not None
    (mv,) = got
    want = byte_view(view)
    assert bytes(mv) == bytes(want)
    # the same memory, not a copy: a write through the landing view shows in the box
    mv[:1] = bytes([(mv[0] + 1) % 256]) if len(mv) else b""
    assert bytes(mv) == bytes(byte_view(view))
