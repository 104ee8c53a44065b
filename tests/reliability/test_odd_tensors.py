"""Odd but valid tensors: any strided view saves and loads exactly.

The class: one-element views whose size-1 dimensions carry any stride (``m[1:2, 0]``,
``m.t()[0:1, 2:3]``), stepped and transposed views, 0-d views with a storage offset, conjugate and
negative-bit views, as save sources and as load destinations, including the one-element pieces of
a strided destination that chunk boundaries cut. A destination's memory outside its view is never
touched. Generated with hypothesis: on LocalStore in this process (world 1), and a smaller set on
two real ranks over SeaweedFS (read-once broadcasts forced, so run windows land in place).

Also what a failed load leaves in the caller's tensors, values and stateful objects, as
docs/guide.md ("When a load fails") states it, on 1 and 2 ranks.
"""

from __future__ import annotations

import os
import random
import tempfile

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cloudckpt
from cloudckpt import GlobalPiece, LoadOptions, SaveOptions
from tests.reliability.stores import RawCheckpoint

DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.int64,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.complex64,
]

#: small blocks and objects: a few elements make several checksum blocks, windows and objects.
SMALL = dict(checksum_block_size=16, object_size=96)


# -- describing a strided view as plain data (picklable, so ranks can rebuild it) ------------------
#
# A view spec is (entries, restride, conj). ``entries`` lists the base tensor's dimensions in memory
# order: ("k", target_dim, start, step, tail) keeps a dimension sliced start::step (target size
# from the shape), ("d", size, index) drops one by an integer index. ``restride`` gives size-1
# target dimensions an arbitrary stride (a valid view of the same memory); ``conj`` applies a lazy
# conjugate (complex dtypes).


def base_shape(spec, shape) -> tuple[int, ...]:
    entries, _, _ = spec
    out = []
    for e in entries:
        if e[0] == "k":
            _, dim, start, step, tail = e
            n = shape[dim]
            out.append(start + max(0, n - 1) * step + (1 if n else 0) + tail)
        else:
            out.append(e[1])
    return tuple(out)


def apply_view(base: torch.Tensor, spec, shape) -> torch.Tensor:
    """The view ``spec`` describes, of shape ``shape``, over ``base``."""
    entries, restride, conj = spec
    index, kept = [], []
    for e in entries:
        if e[0] == "k":
            _, dim, start, step, _ = e
            index.append(slice(start, start + shape[dim] * step, step))
            kept.append(dim)
        else:
            index.append(e[2])
    view = base[tuple(index)]
    order = sorted(range(len(kept)), key=lambda j: kept[j])
    view = view.permute(order) if order else view
    assert tuple(view.shape) == tuple(shape), (view.shape, shape)
    if restride:
        strides = list(view.stride())
        for dim, stride in restride:
            strides[dim] = stride
        view = view.as_strided(view.shape, strides, view.storage_offset())
    if conj and view.is_complex():
        view = view.conj()
    return view


@st.composite
def view_specs(draw, shape):
    entries = [
        ("k", dim, draw(st.integers(0, 2)), draw(st.integers(1, 3)), draw(st.integers(0, 2)))
        for dim in range(len(shape))
    ]
    for _ in range(draw(st.integers(0, 2))):
        size = draw(st.integers(1, 3))
        entries.insert(
            draw(st.integers(0, len(entries))), ("d", size, draw(st.integers(0, size - 1)))
        )
    entries = draw(st.permutations(entries))
    ones = [d for d, n in enumerate(shape) if n == 1]
    restride = tuple(
        (d, draw(st.sampled_from([0, 1, 3, 17, 1000]))) for d in ones if draw(st.booleans())
    )
    return tuple(entries), restride, draw(st.booleans())


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple) | st.lists(
    st.just(1), min_size=1, max_size=3
).map(tuple)


def values(shape, dtype, seed: int) -> torch.Tensor:
    """Deterministic, exactly comparable values (no NaN) of ``dtype``."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        re = torch.randint(-99, 99, shape, generator=g)
        im = torch.randint(-99, 99, shape, generator=g)
        return torch.complex(re.float(), im.float()).to(dtype)
    low = 0 if dtype == torch.uint8 else -99
    return torch.randint(low, 99, shape, generator=g).to(dtype)


def sentinel(shape, dtype) -> torch.Tensor:
    return torch.full(shape, True if dtype == torch.bool else 77, dtype=dtype)


def view_with(spec, shape, dtype, content: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, view): a base full of sentinels whose view ``spec`` holds ``content``."""
    base = sentinel(base_shape(spec, shape), dtype)
    view = apply_view(base, spec, shape)
    view.copy_(content)
    return base, view


def destination(spec, shape, dtype):
    """(base, view, expected base after a load of ``content`` into the view)."""
    base = sentinel(base_shape(spec, shape), dtype)
    return base, apply_view(base, spec, shape)


def expected_base(spec, shape, dtype, content) -> torch.Tensor:
    base, _ = view_with(spec, shape, dtype, content)
    return base


def cuts(shape, dim, points) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes (offsets, sizes) cutting ``shape`` along ``dim`` at ``points``."""
    if not shape:
        return [((), ())]
    edges = [0] + sorted({p for p in points if 0 < p < shape[dim]}) + [shape[dim]]
    boxes = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        offsets = tuple(lo if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(hi - lo if d == dim else n for d, n in enumerate(shape))
        boxes.append((offsets, sizes))
    return boxes


def box(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, n)
    return t


@st.composite
def layouts(draw, shape):
    """A holding of a tensor of ``shape``: boxes, each with a view spec."""
    if shape and draw(st.booleans()):
        dim = draw(st.integers(0, len(shape) - 1))
        points = draw(st.lists(st.integers(1, max(1, shape[dim] - 1)), max_size=3))
        boxes = cuts(shape, dim, points)
    else:
        boxes = [((0,) * len(shape), tuple(shape))]
    return [(o, s, draw(view_specs(s))) for o, s in boxes]


def build_holding(layout, shape, dtype, full: torch.Tensor | None = None):
    """(state-dict leaf, bases) for ``layout``: one view when it is one whole box, GlobalPieces
    otherwise; the views hold ``full``'s boxes, or sentinels only when ``full`` is None."""
    pieces, bases = [], []
    for offsets, sizes, spec in layout:
        if full is not None:
            base, view = view_with(spec, sizes, dtype, box(full, offsets, sizes))
        else:
            base, view = destination(spec, sizes, dtype)
        pieces.append((offsets, view))
        bases.append(base)
    if len(layout) == 1 and layout[0][0] == (0,) * len(shape):
        return pieces[0][1], bases
    return [GlobalPiece(v, tuple(shape), o) for o, v in pieces], bases


def expected_bases(layout, dtype, full):
    return [
        expected_base(spec, sizes, dtype, box(full, offsets, sizes))
        for offsets, sizes, spec in layout
    ]


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# -- the issue's examples, explicitly ------------------------------------------------------------


def _m() -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(6, 8)


EXAMPLES = {
    "m[1:2, 0]": lambda m: m[1:2, 0],
    "m.t()[0:1, 2:3]": lambda m: m.t()[0:1, 2:3],
    "m[::4, 2]": lambda m: m[::4, 2],
    "m[1, 2] (0-d, offset)": lambda m: m[1, 2],
    "m[2:3, 5:6].t()": lambda m: m[2:3, 5:6].t(),
    "m.t()[2:3, :]": lambda m: m.t()[2:3, :],
    "m[::2, ::3]": lambda m: m[::2, ::3],
    "m[0:1, 0:1] restrided 0": lambda m: m[0:1, 0:1].as_strided((1, 1), (0, 0), 0),
    "m[:, 3:4].unsqueeze(0)": lambda m: m[:, 3:4].unsqueeze(0),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_issue_examples_round_trip_as_source_and_destination(name, tmp_path):
    make = EXAMPLES[name]
    src = make(_m())
    cloudckpt.save({"x": src}, str(tmp_path / "ck"))
    assert same(cloudckpt.load_full(str(tmp_path / "ck"))["x"], src.contiguous())
    base = torch.full((6, 8), -1.0)
    dst = make(base)
    cloudckpt.load({"x": dst}, str(tmp_path / "ck"))
    expected = torch.full((6, 8), -1.0)
    make(expected).copy_(src)
    assert same(dst, src) and same(base, expected)


def test_conjugate_and_negative_views_round_trip(tmp_path):
    z = values((3, 4), torch.complex64, 1)
    state = {"conj": z.conj(), "neg": z.conj().imag, "conj_t": z.t().conj()[1:2, 0:1]}
    assert state["neg"].is_neg() and state["conj"].is_conj()
    cloudckpt.save(state, str(tmp_path / "ck"))
    full = cloudckpt.load_full(str(tmp_path / "ck"))
    for k, v in state.items():
        assert same(full[k], v.resolve_conj().resolve_neg()), k
    zb = torch.zeros(3, 4, dtype=torch.complex64)
    dst = {
        "conj": torch.zeros(3, 4, dtype=torch.complex64).conj(),
        "neg": zb.conj().imag,
        "conj_t": torch.zeros(4, 3, dtype=torch.complex64).conj()[1:2, 0:1],
    }
    cloudckpt.load(dst, str(tmp_path / "ck"))
    for k, v in state.items():
        assert same(dst[k].resolve_conj().resolve_neg(), v.resolve_conj().resolve_neg()), k
    assert same(zb.imag, z.imag) and same(zb.real, torch.zeros(3, 4))  # only the view written


def test_one_element_pieces_of_a_transposed_destination(tmp_path):
    """Chunks cut a transposed destination into one-element pieces: a 1x1 box of a tensor with
    strides (1, 5) is 'contiguous' for torch, with stride 5 on its last dimension."""
    full = values((4, 4), torch.float32, 2)
    pieces = [
        GlobalPiece(full[i : i + 1, j : j + 1].clone(), (4, 4), (i, j))
        for i in range(2)
        for j in range(4)
    ]
    pieces += [
        GlobalPiece(full[i : i + 1, j : j + 2].t().contiguous().t(), (4, 4), (i, j))
        for i in range(2, 4)
        for j in (0, 2)
    ]
    cloudckpt.save({"w": pieces}, str(tmp_path / "ck"), options=SaveOptions(**SMALL))
    base = torch.full((6, 5), -5.0)
    dst = base[1:5, 0:4].t()
    cloudckpt.load({"w": dst}, str(tmp_path / "ck"))
    want = torch.full((6, 5), -5.0)
    want[1:5, 0:4] = full.t()
    assert same(dst, full) and same(base, want)
    # destination pieces of one element each, every one with its last stride 5
    base = torch.full((6, 5), -5.0)
    view = base[1:5, 0:4].t()
    held = [
        GlobalPiece(view[i : i + 1, j : j + 1], (4, 4), (i, j)) for i in range(4) for j in range(4)
    ]
    assert all(p.local.is_contiguous() and p.local.stride(-1) == 5 for p in held)
    cloudckpt.load({"w": held}, str(tmp_path / "ck"))
    assert same(view, full) and same(base, want)


# -- generated: world 1, LocalStore --------------------------------------------------------------


@st.composite
def cases(draw):
    shape = draw(shapes)
    dtype = draw(st.sampled_from(DTYPES))
    saved = draw(layouts(shape))
    loaded = draw(layouts(shape))
    options = draw(st.sampled_from([SMALL, dict(checksum_block_size=48, object_size=1 << 20), {}]))
    return shape, dtype, saved, loaded, options, draw(st.integers(0, 1 << 30))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_generated_strided_views_round_trip_on_local_store(case, figures):
    shape, dtype, saved, loaded, options, seed = case
    full = values(shape, dtype, seed)
    with tempfile.TemporaryDirectory() as root:
        url = os.path.join(root, "ck")
        leaf, _ = build_holding(saved, shape, dtype, full)
        cloudckpt.save({"t": leaf, "step": 3}, url, options=SaveOptions(**options))
        assert same(cloudckpt.load_full(url)["t"], full)
        leaf, bases = build_holding(loaded, shape, dtype)
        cloudckpt.load({"t": leaf, "step": 0}, url)
        for base, want in zip(bases, expected_bases(loaded, dtype, full)):
            assert same(base, want)
    figures.add("odd tensor round trips (world 1)")


# -- generated: two ranks over S3 ----------------------------------------------------------------


def rank_round_trip(
    url: str, shape, dtype, saved, loaded, seed: int, options: dict
) -> tuple[bool, int]:
    """Rank r saves the boxes of ``saved`` at positions r, r+2, ...; every rank loads all of
    ``loaded`` (so each region goes to both ranks: read once and broadcast)."""
    rank = dist.get_rank()
    full = values(shape, dtype, seed)
    mine = [p for i, p in enumerate(saved) if i % 2 == rank]
    pieces = []
    for offsets, sizes, spec in mine:
        _, view = view_with(spec, sizes, dtype, box(full, offsets, sizes))
        pieces.append(GlobalPiece(view, tuple(shape), offsets))
    cloudckpt.save({"t": pieces} if pieces else {}, url, options=SaveOptions(**options))
    leaf, bases = build_holding(loaded, shape, dtype)
    result = cloudckpt.load(
        {"t": leaf},
        url,
        options=LoadOptions(broadcast=True, min_broadcast_bytes=0, broadcast_batch_bytes=64),
    )
    ok = all(same(b, w) for b, w in zip(bases, expected_bases(loaded, dtype, full)))
    return ok, result.broadcasts


@st.composite
def two_rank_cases(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    dim = draw(st.integers(0, len(shape) - 1))
    # at least one cut on a dimension of 2+ elements, so both ranks hold a piece
    points = draw(st.lists(st.integers(1, max(1, shape[dim] - 1)), min_size=1, max_size=3))
    boxes = cuts(shape, dim, points)
    saved = [(o, s, draw(view_specs(s))) for o, s in boxes]
    return shape, dtype, saved, draw(layouts(shape)), draw(st.integers(0, 1 << 30))


_counter = iter(range(1 << 30))


@settings(
    max_examples=12,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=two_rank_cases())
def test_generated_strided_views_round_trip_on_two_ranks(case, world2, s3_server, figures):
    shape, dtype, saved, loaded, seed = case
    url = s3_server.url(f"odd-{os.getpid()}-{next(_counter)}-{random.getrandbits(32):08x}")
    results = world2.run(
        rank_round_trip,
        url,
        shape,
        dtype,
        saved,
        loaded,
        seed,
        dict(checksum_block_size=16, object_size=64),
    )
    assert [ok for ok, _ in results] == [True, True]
    figures.add("odd tensor round trips (world 2, S3)")
    figures.add("odd tensor broadcasts (world 2, S3)", results[0][1])


# -- every entry point -----------------------------------------------------------------------------


def _odd_state() -> dict:
    m = _m()
    z = values((3, 4), torch.complex64, 5)
    return {name: make(m) for name, make in EXAMPLES.items()} | {"conj": z.t().conj()[0:1, 1:2]}


def _blank_like(state: dict) -> tuple[dict, list]:
    """Destinations of the same odd layouts over fresh sentinel bases."""
    base = torch.full((6, 8), -1.0)
    zb = torch.zeros(3, 4, dtype=torch.complex64)
    dst = {name: make(base) for name, make in EXAMPLES.items()} | {"conj": zb.t().conj()[0:1, 1:2]}
    return dst, [base, zb]


def _check_loaded(dst: dict, state: dict) -> None:
    for name, v in state.items():
        assert same(dst[name].resolve_conj(), v.resolve_conj()), name


def test_odd_views_through_async_save_and_manager(tmp_path):
    state = _odd_state()
    handle = cloudckpt.async_save(state, str(tmp_path / "async"))
    handle.result()
    dst, _ = _blank_like(state)
    cloudckpt.load(dst, str(tmp_path / "async"))
    _check_loaded(dst, state)

    with cloudckpt.CheckpointManager(str(tmp_path / "run")) as mgr:
        mgr.save(7, state)
        dst, _ = _blank_like(state)
        assert mgr.load(dst) == 7
    _check_loaded(dst, state)


def test_odd_views_exported_by_the_cli(tmp_path):
    from safetensors.torch import load_file

    from tests.reliability.stores import cli

    state = _odd_state()
    cloudckpt.save(state, str(tmp_path / "ck"))
    out = tmp_path / "out.safetensors"
    proc = cli(None, "export", str(tmp_path / "ck"), str(out))
    assert proc.returncode == 0, proc.stderr
    loaded = load_file(str(out))
    for name, v in state.items():
        assert same(loaded[name], v.resolve_conj().contiguous()), name


# -- what a failed load leaves (docs/guide.md, "When a load fails") ------------------------------

BLOCK = 256
OLD = -7.0


class _Holder:
    """A Stateful object whose state_dict() hands out its own tensor (filled in place)."""

    def __init__(self):
        self.c = torch.full((300,), OLD)
        self.loaded = 0
        self.asked = 0

    def state_dict(self):
        self.asked += 1
        return {"c": self.c, "tag": "old"}

    def load_state_dict(self, sd):
        self.loaded += 1


def _failed_load_state() -> dict:
    return {
        "a": torch.arange(1000, dtype=torch.float32),
        "b": torch.arange(500.0) * 3,
        "obj": {"c": torch.arange(300.0) + 0.5, "tag": "new"},
        "step": 42,
        "cfg": {"name": "new"},
    }


def _failed_load_target() -> tuple[dict, _Holder]:
    holder = _Holder()
    return {
        "a": torch.full((1000,), OLD),
        "b": torch.full((500,), OLD),
        "obj": holder,
        "step": 0,
        "cfg": {"name": "old"},
    }, holder


def _untouched_values(target: dict, holder: _Holder) -> None:
    assert target["step"] == 0 and target["cfg"] == {"name": "old"}
    assert holder.loaded == 0 and holder.asked == 1


def test_failed_load_before_data_moves_changes_nothing(tmp_path):
    url = str(tmp_path / "ck")
    cloudckpt.save(_failed_load_state(), url)
    for change, error in (
        (lambda t: t.__setitem__("extra", torch.zeros(2)), cloudckpt.MissingKeysError),
        (lambda t: t.__setitem__("b", torch.full((499,), OLD)), cloudckpt.ShapeMismatchError),
    ):
        target, holder = _failed_load_target()
        change(target)
        with pytest.raises(error):
            cloudckpt.load(target, url)
        _untouched_values(target, holder)
        for name in ("a", "b"):
            assert bool((target[name] == OLD).all()), name
        assert bool((holder.c == OLD).all())


@pytest.mark.parametrize("corrupt", ["a", "obj.c"])
def test_failed_load_on_a_corrupt_block_writes_only_verified_elements(tmp_path, corrupt):
    url = str(tmp_path / "ck")
    state = _failed_load_state()
    cloudckpt.save(state, url, options=SaveOptions(checksum_block_size=BLOCK, object_size=1024))
    manifest = cloudckpt.read_manifest(url)
    chunk = manifest.tensors[corrupt].chunks[0]
    key = manifest.objects[chunk.object_index]
    bad_block = 1 if chunk.byte_length > BLOCK else 0
    RawCheckpoint(url).flip(key, chunk.byte_offset + bad_block * BLOCK + 5)

    target, holder = _failed_load_target()
    with pytest.raises(cloudckpt.ChecksumError) as failed:
        cloudckpt.load(target, url)
    assert key in str(failed.value)
    _untouched_values(target, holder)
    got = {"a": target["a"], "b": target["b"], "obj.c": holder.c}
    want = {"a": state["a"], "b": state["b"], "obj.c": state["obj"]["c"]}
    for name, dest in got.items():  # every element: its previous value or the checkpoint's
        assert bool(((dest == OLD) | (dest == want[name])).all()), name
    per = BLOCK // 4
    assert bool((got[corrupt][bad_block * per : (bad_block + 1) * per] == OLD).all())


def rank_failed_load(url: str) -> dict:
    """Rank 0 loads tensor "a" (one of its blocks is corrupt), rank 1 loads "b" (intact)."""
    rank = dist.get_rank()
    holder = _Holder()
    target = {
        ("a" if rank == 0 else "b"): torch.full((1000 if rank == 0 else 500,), OLD),
        "obj": holder,
        "step": 0,
        "cfg": {"name": "old"},
    }
    try:
        cloudckpt.load(target, url, strict=False)
        error = None
    except cloudckpt.CloudCkptError as exc:
        error = type(exc).__name__
    dest = target["a" if rank == 0 else "b"]
    return {
        "error": error,
        "step": target["step"],
        "name": target["cfg"]["name"],
        "loaded": holder.loaded,
        "dest": dest.tolist(),
    }


def test_failed_load_on_two_ranks_restores_nothing_on_any_rank(world2, tmp_path):
    url = str(tmp_path / "ck")
    state = _failed_load_state()
    cloudckpt.save(state, url, options=SaveOptions(checksum_block_size=BLOCK, object_size=1024))
    manifest = cloudckpt.read_manifest(url)
    chunk = manifest.tensors["a"].chunks[0]
    RawCheckpoint(url).flip(manifest.objects[chunk.object_index], chunk.byte_offset + BLOCK + 5)
    r0, r1 = world2.run(rank_failed_load, url)
    assert r0["error"] == r1["error"] == "ChecksumError"
    assert (r0["step"], r0["name"], r0["loaded"]) == (0, "old", 0)  # the failing rank
    assert (r1["step"], r1["name"], r1["loaded"]) == (0, "old", 0)  # its peer: nothing restored
    a = torch.tensor(r0["dest"])
    assert bool(((a == OLD) | (a == state["a"])).all()) and bool((a[64:128] == OLD).all())
    b = torch.tensor(r1["dest"])  # its own reads succeeded: loaded
    assert torch.equal(b, state["b"])
