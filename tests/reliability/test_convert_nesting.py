"""Conversion keeps what DCP keeps: ``cloudckpt.convert`` and ``load_full`` against torch's own
``dcp_to_torch_save``, over generated nestings (dicts, lists, tuples, empty ones, tuples of
tensors, lists inside tuples, plain values, 0-d and empty tensors of many dtypes, keys with dots
and odd characters), both ways, compared exactly: structure, container types, key order, value
types, tensor dtypes and values. What DCP's format cannot hold is named, never silently lost.

Local folders only: the storage paths of conversion are covered on SeaweedFS by
``tests/interop/test_dcp_convert.py``. torch.load is used here on the reference side only."""

from __future__ import annotations

import collections
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, event, given, reject, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import cloudckpt
from cloudckpt.errors import DuplicateKeyError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
SHAPES = [(), (0,), (3,), (2, 3), (1, 0, 2)]
EXAMPLES = 80  # per direction: 5-10 s each on the 2-core machine, up to 30 s when shared


def _tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-50, 50, shape, generator=g)
    if dtype is torch.bool:
        return t > 0
    if dtype is torch.uint8:
        return t.abs().to(dtype)
    if dtype.is_floating_point or dtype.is_complex:
        return (t.to(torch.float64) / 4).to(dtype)
    return t.to(dtype)


tensors = st.builds(
    _tensor, st.sampled_from(DTYPES), st.sampled_from(SHAPES), st.integers(0, 1 << 16)
)
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.binary(min_size=1, max_size=4),
)  # b"": see the limit test
keys = st.text(alphabet="ab.x _-/é0", min_size=1, max_size=4)
nestings = st.recursive(
    st.one_of(tensors, values),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(keys, inner, max_size=3),
    ),
    max_leaves=10,
)
state_dicts = st.dictionaries(keys, nestings, min_size=1, max_size=4)

SETTINGS = settings(
    max_examples=EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def assert_same(got, want, path="") -> None:
    """Exactly the same: types (tuple is not list, OrderedDict is not dict), dict keys in
    order and of the same types, tensors of the same dtype and shape with equal elements."""
    assert type(got) is type(want), (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, (path, got, want)
        assert torch.equal(got, want), (path, got, want)
    elif isinstance(want, dict):
        assert [(type(k), k) for k in got] == [(type(k), k) for k in want], (path, got, want)
        for k in want:
            assert_same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), (path, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}.{i}")
    else:
        assert got == want, (path, got, want)


def _count_kinds(state) -> None:
    """Hypothesis events (``--hypothesis-show-statistics``): what the generated states held."""

    def walk(v, inside_tuple=False):
        if isinstance(v, torch.Tensor):
            yield "a tensor inside a tuple" if inside_tuple else "a tensor"
        elif isinstance(v, (dict, list, tuple)):
            if not v:
                yield f"an empty {type(v).__name__}"
            for x in v.values() if isinstance(v, dict) else v:
                yield from walk(x, inside_tuple or isinstance(v, tuple))

    for kind in set(walk(state)):
        event(kind)


def _reference(folder: Path, out: Path):
    """What DCP itself rebuilds from the DCP checkpoint in ``folder``; ``RuntimeError`` where
    it fails (DCP's ``CheckpointException`` is a ``BaseException``)."""
    _dcp(dcp_to_torch_save, folder, out)
    return torch.load(out, weights_only=True)


def _dcp(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001
        raise RuntimeError(f"{fn.__name__} failed: {str(exc).splitlines()[-1]}") from exc


def _outcome(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, or the message of the ``RuntimeError`` it raises."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        return str(exc)


def _zeros_like(state):
    """A destination for ``dcp.load``: tensors zeroed, the containers DCP walks kept, everything
    else (values, tuples: DCP replaces them) None."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_zeros_like(v) for v in state]
    return None


@SETTINGS
@given(state_dicts)
def test_dcp_to_cloudckpt_loads_whole_as_dcp_rebuilds_it(state):
    _count_kinds(state)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = Path(tmp)
        try:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp / "dcp", sync_files=False))
        except ValueError as exc:  # two keys with one dotted name: DCP refuses it too
            assert "duplicated flatten key" in str(exc)
            reject()
        try:
            want = _reference(tmp / "dcp", tmp / "ref.pt")
        except RuntimeError as exc:  # a list where DCP dropped an empty dict: it fails
            event("dcp_to_torch_save fails")
            want = exc
        try:
            result = cloudckpt.convert(tmp / "dcp", tmp / "ck", to="cloudckpt", allow_pickle=True)
        except DuplicateKeyError:
            # a tuple's element and another key with the same dotted name ("a" holding (t,)
            # and "a.0"): cloudckpt cannot hold both, and says so before writing anything
            assert not (tmp / "ck" / "manifest.msgpack").exists()
            reject()
        assert result.skipped == (), result.skipped
        got = cloudckpt.load_full(tmp / "ck")
        if isinstance(want, RuntimeError):
            assert any("empty mapping" in c for c in result.changed), (result.changed, want)
        else:
            assert_same(got, want)
            assert result.changed == (), result.changed


@SETTINGS
@given(state_dicts)
def test_cloudckpt_to_dcp_rebuilds_as_load_full_returns_it(state):
    _count_kinds(state)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tmp = Path(tmp)
        try:
            cloudckpt.save(state, tmp / "ck")
        except DuplicateKeyError:
            reject()
        want = cloudckpt.load_full(tmp / "ck")
        result = cloudckpt.convert(tmp / "ck", tmp / "dcp", to="dcp")
        assert result.skipped == ()
        # the very items dcp.save writes for the same state, under the same paths
        try:
            dcp.save(want, storage_writer=dcp.FileSystemWriter(tmp / "own", sync_files=False))
        except ValueError:  # two keys with one dotted name once tuples are DCP items
            reject()
        ours, own = (dcp.FileSystemReader(tmp / d).read_metadata() for d in ("dcp", "own"))
        assert [(k, type(v)) for k, v in ours.state_dict_metadata.items()] == [
            (k, type(v)) for k, v in own.state_dict_metadata.items()
        ]
        assert ours.planner_data == own.planner_data
        # so DCP rebuilds what load_full returns, but for what DCP's own save changes (named)
        got = _outcome(_reference, tmp / "dcp", tmp / "ref.pt")
        if result.changed:
            assert_same(got, _outcome(_reference, tmp / "own", tmp / "own.pt"))
        else:
            assert_same(got, want)
        # and DCP's default planner loads it into a state dict of the same nesting (or fails
        # as on DCP's own checkpoint: a list holding an empty dict, say)
        dest, own_dest = _zeros_like(want), _zeros_like(want)
        failed = _outcome(_dcp, dcp.load, dest, storage_reader=dcp.FileSystemReader(tmp / "dcp"))
        assert failed == _outcome(
            _dcp, dcp.load, own_dest, storage_reader=dcp.FileSystemReader(tmp / "own")
        )
        if failed is None:
            assert_same(dest, want)


# -- the cases found, one by one (quick, and each fails on the converter before the fix) -----


T = torch.arange(6.0).reshape(2, 3)
CONTAINERS = {
    "pair": (T, T + 1),
    "mixed": [(T[0], 2), 3],
    "deep": {"x": ([T[1]], {"k": torch.tensor(7, dtype=torch.int8)}), "n": ()},
    "betas": (0.9, 0.95),
    "bytes": b"\x00",
    "step": torch.tensor(5),
}


def _dcp_checkpoint(state, folder: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder, sync_files=False))
    return folder


def test_a_tuple_of_tensors_in_a_dcp_checkpoint_comes_back_a_tuple(tmp_path):
    src = _dcp_checkpoint(CONTAINERS, tmp_path / "dcp")
    result = cloudckpt.convert(src, tmp_path / "ck", to="cloudckpt", allow_pickle=True)
    got = cloudckpt.load_full(tmp_path / "ck")
    assert_same(got, _reference(src, tmp_path / "ref.pt"))
    assert_same(got, CONTAINERS)
    assert (result.skipped, result.changed) == ((), ())
    # the tensors inside are stored tensors of their own (verify checks them)
    assert {"pair.0", "pair.1", "mixed.0.0", "deep.x.0.0", "deep.x.1.k"} <= set(
        cloudckpt.read_manifest(tmp_path / "ck").tensors
    )
    assert cloudckpt.verify(tmp_path / "ck").ok


def test_a_tuple_of_tensors_in_a_cloudckpt_checkpoint_is_one_dcp_item(tmp_path):
    cloudckpt.save(CONTAINERS, tmp_path / "ck")
    result = cloudckpt.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert_same(_reference(tmp_path / "dcp", tmp_path / "ref.pt"), CONTAINERS)
    assert (result.skipped, result.changed) == ((), ())
    md = dcp.FileSystemReader(tmp_path / "dcp").read_metadata()
    assert md.planner_data["pair"] == ("pair",) and md.planner_data["mixed"] == ("mixed",)
    dest = _zeros_like(CONTAINERS)
    _dcp(dcp.load, dest, storage_reader=dcp.FileSystemReader(tmp_path / "dcp"))
    assert_same(dest, CONTAINERS)


def test_what_dcp_keeps_differently_is_named(tmp_path):
    """int keys, an OrderedDict and empty dicts: DCP's own save changes them the same way."""
    state = {"opt": {"state": {0: {"m": T}}, "none": {}}, "od": collections.OrderedDict(a=T)}
    cloudckpt.save(state, tmp_path / "ck")
    result = cloudckpt.convert(tmp_path / "ck", tmp_path / "dcp", to="dcp")
    assert [c.split(":")[0] for c in result.changed] == ["'opt.state'", "'opt.none'", "'od'"]
    assert "come back str" in result.changed[0] and "empty mapping" in result.changed[1]
    assert "OrderedDict comes back a dict" in result.changed[2]
    assert_same(
        _reference(tmp_path / "dcp", tmp_path / "ref.pt"),
        {"opt": {"state": {"0": {"m": T}}}, "od": {"a": T}},
    )


def test_a_list_that_lost_an_empty_dict_is_rebuilt_and_named(tmp_path):
    """DCP drops the empty dict and dcp_to_torch_save then fails; the conversion rebuilds the
    rest and names the hole (None) or the lost entry."""
    src = _dcp_checkpoint({"a": [{}, 5], "b": [None, {}], "x": T}, tmp_path / "dcp")
    assert "failed" in _outcome(_reference, src, tmp_path / "ref.pt")
    result = cloudckpt.convert(src, tmp_path / "ck", to="cloudckpt", allow_pickle=True)
    assert_same(cloudckpt.load_full(tmp_path / "ck"), {"a": [None, 5], "b": [None], "x": T})
    assert [c.split(":")[0] for c in result.changed] == ["'a.0'", "'a'", "'b'"], result.changed


def test_one_name_for_two_leaves_is_refused_before_anything_is_written(tmp_path):
    src = _dcp_checkpoint({"a": (T,), "a.0": T + 1}, tmp_path / "dcp")
    with pytest.raises(DuplicateKeyError, match="both flatten to 'a.0'.*rename one"):
        cloudckpt.convert(src, tmp_path / "ck", to="cloudckpt", allow_pickle=True)
    assert not (tmp_path / "ck").exists()


def test_an_empty_bytes_value_is_named(tmp_path):
    """Limit: torch.save(b"") names builtins.bytes, which torch.load(weights_only=True)
    refuses: the value is named in skipped, the rest converted."""
    src = _dcp_checkpoint({"b": b"", "x": T}, tmp_path / "dcp")
    result = cloudckpt.convert(src, tmp_path / "ck", to="cloudckpt", allow_pickle=True)
    assert result.skipped == ("b: torch.load(weights_only=True) refuses it",)
    assert_same(cloudckpt.load_full(tmp_path / "ck"), {"x": T})


def test_planner_data_dcp_never_writes_keeps_names_flat_and_says_so():
    from cloudckpt.dcp.nesting import rebuild

    entries = [("a.b", 1), ("a.c", 2)]
    assert rebuild(entries, {"a.b": ("a", "b"), "a.c": ("a", "c")}) == ({"a": {"b": 1, "c": 2}}, [])
    for bad in (
        {"a.b": ("a", "b"), "a.c": ("a", 0)},  # a str and an int key into one node
        {"a.b": ("a",), "a.c": ("a", "c")},  # a leaf and a container
        {"a.b": ("a", "b"), "a.c": ("a", "b")},  # one path twice
        {"a.b": ("a", 10**12), "a.c": ("a", "c")},  # a list index past any item
        {"a.b": ("a", True), "a.c": ("a", "c")},  # not a str key or an index
        {"a.b": "a", "a.c": ("a", "c")},
    ):
        nested, notes = rebuild(entries, bad)
        assert nested == {"a.b": 1, "a.c": 2} and len(notes) == 1 and "kept flat" in notes[0]
