"""State dicts as people write them (pure: flatten, structure, resolve_stateful, restore order).

Every container kind (dict subclasses with their own ``__init__``, ``defaultdict`` with any
factory, mappings that are not dicts, list / tuple subclasses, namedtuples) flattens, survives
the manifest's codecs and rebuilds as the documented closest type, key order kept; the stateful
objects of a state dict are called in one order whatever order its dicts were built in.
"""

from __future__ import annotations

import random
from collections import OrderedDict, defaultdict
from types import MappingProxyType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cloudckpt.errors import PlanningError
from cloudckpt.manifest.values import decode_value, encode_value
from cloudckpt.statedict.flatten import (
    check_replaceable,
    copy_mapping,
    flatten_state_dict,
    plain_value,
    rebuild_tuple,
    set_by_path,
    unflatten_state_dict,
)
from cloudckpt.statedict.stateful import path_sort_key, resolve_stateful, restore_stateful
from tests.planning.containers import (
    ArgsDict,
    ArgsOrderedDict,
    Box,
    Pair,
    PlainSubDict,
    Row,
    Seq,
    exactly,
    expected,
    people_state,
    problems,
)


def through_manifest(flat):
    """The structure and leaves as a manifest holds them (through the exact value codec)."""

    def codec(value, key):
        return decode_value(
            encode_value(value, key=key, allow_pickle=False), key=key, allow_pickle=False
        )

    leaves = {n: leaf.pieces[0][1] for n, leaf in flat.tensors.items()}
    leaves.update({n: codec(leaf.value, n) for n, leaf in flat.values.items()})
    return codec(flat.structure, "structure"), leaves


def rebuilt(sd):
    structure, leaves = through_manifest(flatten_state_dict(resolve_stateful(sd)[0]))
    return unflatten_state_dict(structure, leaves)


def test_people_state_rebuilds_as_the_closest_types_with_key_order():
    sd = people_state()
    before = people_state()
    full = rebuilt(sd)
    assert problems(full, expected(sd, keep_types=False)) == []
    assert type(full) is dict and list(full) == list(sd)
    assert type(full["aod"]) is OrderedDict and list(full["aod"]) == ["second", "first"]
    assert list(full["ad"]) == ["z", "a"] and type(full["dl"]) is dict and 7 in full["dl"]
    assert full["odd_keys"] == {(1, 2): 3, 1.5: 4}
    assert full["optim"]["param_groups"] == [
        {"lr": 0.1, "params": [0, 1]},
        {"lr": 0.2, "params": [2]},
    ]
    assert type(full["seqs"]) is list and type(full["seqs"][1]) is tuple
    # the caller's dict is not touched
    assert problems(sd, exactly(before)) == []
    assert sd.a == "top" and sd["dl"]["missing"] == 0.5


def test_expected_rule_is_not_vacuous():
    """The checker sees a changed type, order, value and tensor."""
    sd = people_state()
    full = rebuilt(sd)
    exp = expected(sd, keep_types=False)
    full["aod"] = dict(full["aod"])
    assert problems(full, exp) == [".aod: dict, expected OrderedDict"]
    full = rebuilt(sd)
    full["ad"] = {"a": full["ad"]["a"], "z": full["ad"]["z"]}
    assert "keys" in problems(full, exp)[0]
    full = rebuilt(sd)
    full["dd"]["w"] = full["dd"]["w"] + 1
    full["optim"]["param_groups"][0]["lr"] = 0.3
    assert len(problems(full, exp)) == 2


def test_odd_keys_holding_tensors_are_refused_with_the_fix():
    with pytest.raises(
        PlanningError, match=r"key \(1, 2\) at \('t',\): .*str or int keys \(got tuple\); convert"
    ):
        flatten_state_dict({"t": defaultdict(list, {(1, 2): torch.ones(1)})})
    with pytest.raises(PlanningError, match="top-level key 1.5: .*got float"):
        flatten_state_dict(PlainSubDict({1.5: 1}))
    with pytest.raises(PlanningError, match="key True"):
        flatten_state_dict({"t": {True: torch.ones(1)}})  # bool is not int here
    flat = flatten_state_dict({"t": defaultdict(int, {(1, 2): 3})})
    assert list(flat.values) == ["t"] and type(flat.values["t"].value) is dict


def test_plain_value_converts_only_containers_and_keeps_identity_otherwise():
    v = [1, (2.0, "x"), {"k": [None, b"b"]}]
    assert plain_value(v) is v
    odd = Seq([Pair(1, defaultdict(int, a=1)), Row((1,)), MappingProxyType({"x": 1})])
    out = plain_value(odd)
    assert out == [(1, {"a": 1}), (1,), {"x": 1}]
    assert [type(x) for x in out] == [tuple, tuple, dict] and type(out) is list
    assert type(out[0][1]) is dict
    assert type(plain_value(torch.Size([2, 3]))) is tuple


# -- copies of containers (resolve_stateful) ----------------------------------------------------


def test_copy_mapping_keeps_type_and_attributes_when_it_can():
    dd = defaultdict(lambda: 7, a=1)
    out = copy_mapping(dd, [("a", 2)])
    assert type(out) is defaultdict and out["a"] == 2 and out["new"] == 7 and dd["a"] == 1
    ad = ArgsDict(1, 2)
    ad["x"] = 1
    out = copy_mapping(ad, [("x", 3)])
    assert type(out) is ArgsDict and (out.a, out.b, out["x"], ad["x"]) == (1, 2, 3, 1)
    od = OrderedDict(a=1)
    od._metadata = {"": {"version": 1}}  # what torch's Module.state_dict() carries
    out = copy_mapping(od, [("a", 5)])
    assert type(out) is OrderedDict and out._metadata == {"": {"version": 1}} and od["a"] == 1
    aod = ArgsOrderedDict("t")  # copy.copy calls ArgsOrderedDict(): a bare instance instead
    aod["k"] = 1
    out = copy_mapping(aod, [("k", 2)])
    assert type(out) is ArgsOrderedDict and out.tag == "t" and out["k"] == 2 and aod["k"] == 1

    class Doubling(dict):  # __setitem__ changes the value
        def __setitem__(self, k, v):
            super().__setitem__(k, v * 2)

    class NoCopy(OrderedDict):
        def __copy__(self):
            raise RuntimeError("no")

    class Stubborn(NoCopy):  # and no bare instance either
        def __new__(cls, token):
            return super().__new__(cls)

        def __init__(self, token):
            super().__init__()

    assert type(copy_mapping(Doubling(a=1), [("a", 1)])) is dict
    assert type(copy_mapping(NoCopy(a=1), [("a", 1)])) is NoCopy
    assert type(copy_mapping(Stubborn(0), [("a", 1)])) is OrderedDict
    assert type(copy_mapping(Box(a=1), [("a", 1)])) is dict
    assert type(copy_mapping(MappingProxyType({"a": 1}), [("a", 1)])) is dict


def test_rebuild_tuple_and_set_by_path_keep_tuple_types():
    assert (
        rebuild_tuple(Pair(1, 2), [3, 4]) == Pair(3, 4)
        and type(rebuild_tuple(Pair(1, 2), [3, 4])) is Pair
    )
    assert type(rebuild_tuple(Row((1,)), [2])) is Row
    assert type(rebuild_tuple(torch.Size([1]), [2])) is torch.Size

    class Fixed(tuple):
        def __new__(cls):
            return super().__new__(cls, (0,))

    assert type(rebuild_tuple(Fixed(), [1])) is tuple  # cannot be built from items: plain tuple
    root = {"a": Seq([Pair(1, Row((2, 3)))])}
    set_by_path(root, ("a", 0, 1, 0), 9)
    assert type(root["a"]) is Seq and type(root["a"][0]) is Pair and type(root["a"][0][1]) is Row
    assert root["a"][0][1] == (9, 3)


def test_check_replaceable_refuses_read_only_mappings_only():
    root = {"ro": MappingProxyType({"n": 1, "t": (1, [2])}), "rw": Box(t=(1, 2)), "l": [(1,)]}
    for path in [("rw", "t", 0), ("l", 0, 0), ("ro", "t", 1, 0)]:
        check_replaceable(root, path)
    for path in [("ro", "n"), ("ro", "t", 0)]:
        with pytest.raises(
            PlanningError,
            match=r"value 'ro\.[nt].*' sits in a read-only mappingproxy: .*pass a dict",
        ):
            check_replaceable(root, path)


class Probe:
    """A stateful object that logs its calls; its state dict can hold more probes."""

    def __init__(self, name, log, inner=None):
        self.name, self.log, self.inner = name, log, inner
        self.loaded = None

    def state_dict(self):
        self.log.append(("state_dict", self.name))
        return {"w": torch.ones(1), **(self.inner or {})}

    def load_state_dict(self, sd):
        self.log.append(("load_state_dict", self.name))
        self.loaded = sd


def test_stateful_state_dict_types_reach_load_state_dict():
    class Typed:
        def state_dict(self):
            out = ArgsDict("a", "b")
            out["w"] = torch.ones(2)
            out["dd"] = defaultdict(list, n=1)
            return out

        def load_state_dict(self, sd):
            self.got = sd

    obj = Typed()
    module = torch.nn.Linear(2, 2)
    resolved, found = resolve_stateful({"obj": obj, "m": module})
    restore_stateful(resolved, found)
    assert type(obj.got) is ArgsDict and obj.got.a == "a" and type(obj.got["dd"]) is defaultdict
    assert hasattr(resolved["m"], "_metadata")  # torch's module version info is kept


def test_stateful_order_fixed_example():
    log = []
    sd = {
        "z": Probe("z", log),
        10: Probe("10", log),
        2: Probe("2", log),
        "a": [
            Probe("a.0", log, {"x": Probe("a.0.x", log), "b": Probe("a.0.b", log)}),
            Probe("a.1", log),
        ],
    }
    resolved, found = resolve_stateful(sd)
    assert [p for p, _ in found] == [
        (2,),
        (10,),
        ("a", 0),
        ("a", 0, "b"),
        ("a", 0, "x"),
        ("a", 1),
        ("z",),
    ]
    assert [n for _, n in log] == ["2", "10", "a.0", "a.0.b", "a.0.x", "a.1", "z"]
    log.clear()
    restore_stateful(resolved, found[::-1])
    assert [n for _, n in log] == ["2", "10", "a.0.b", "a.0.x", "a.0", "a.1", "z"]
    assert list(resolved) == ["z", 10, 2, "a"] and list(resolved["a"][0]) == ["w", "x", "b"]


# -- generated trees ----------------------------------------------------------------------------

_MAPPINGS = {
    "dict": dict,
    "OrderedDict": OrderedDict,
    "defaultdict": lambda items: defaultdict(list, items),
    "lambda_defaultdict": lambda items: defaultdict(lambda: None, items),
    "PlainSubDict": PlainSubDict,
    "ArgsDict": lambda items: _filled(ArgsDict(0, 1), items),
    "ArgsOrderedDict": lambda items: _filled(ArgsOrderedDict("t"), items),
    "Box": lambda items: (
        Box(**dict(items)) if all(type(k) is str for k, _ in items) else dict(items)
    ),
}
_SEQUENCES = {
    "list": list,
    "tuple": tuple,
    "Seq": Seq,
    "Row": Row,
    "Pair": lambda items: Pair(*items) if len(items) == 2 else tuple(items),
}


def _filled(mapping, items):
    for k, v in items:
        mapping[k] = v
    return mapping


_keys = st.one_of(st.text(alphabet="abc", min_size=1, max_size=2), st.integers(0, 12))
_leaves = st.one_of(
    st.integers(-3, 3),
    st.text(max_size=2),
    st.none(),
    st.floats(allow_nan=False),
    st.integers(0, 4).map(lambda n: ("tensor", n)),
)


def _specs():
    return st.recursive(
        _leaves,
        lambda children: st.one_of(
            st.tuples(
                st.just("map"),
                st.sampled_from(sorted(_MAPPINGS)),
                st.lists(st.tuples(_keys, children), max_size=4, unique_by=lambda kv: kv[0]),
            ),
            st.tuples(
                st.just("seq"), st.sampled_from(sorted(_SEQUENCES)), st.lists(children, max_size=3)
            ),
            st.tuples(
                st.just("probe"),
                st.lists(
                    st.tuples(st.sampled_from("pq"), children),
                    max_size=2,
                    unique_by=lambda kv: kv[0],
                ),
            ),
        ),
        max_leaves=14,
    )


def realize(spec, rng: random.Random, log: list, name: str = "r"):
    """Build the tree a spec describes, mapping items inserted in the order ``rng`` picks."""
    if isinstance(spec, tuple) and spec and spec[0] == "tensor":
        return torch.arange(float(spec[1]))
    if not isinstance(spec, tuple):
        return spec
    kind = spec[0]
    if kind == "seq":
        return _SEQUENCES[spec[1]](
            [realize(c, rng, log, f"{name}.{i}") for i, c in enumerate(spec[2])]
        )
    items = list(spec[2] if kind == "map" else spec[1])
    rng.shuffle(items)
    built = [(k, realize(c, rng, log, f"{name}.{k}")) for k, c in items]
    if kind == "map":
        return _MAPPINGS[spec[1]](built)
    return Probe(name, log, dict(built))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.tuples(_keys, _specs()), min_size=1, max_size=5, unique_by=lambda kv: kv[0]),
    st.sampled_from(sorted(_MAPPINGS)),
    st.integers(0, 2**32),
)
def test_generated_trees_rebuild_by_the_rule_and_call_stateful_in_one_order(top, top_kind, seed):
    logs, results = [], []
    for order in (seed, seed + 1):  # the same tree, built in two key orders
        log: list = []
        sd = realize(("map", top_kind, top), random.Random(order), log)
        resolved, found = resolve_stateful(sd)
        saved_order = list(log)
        log.clear()
        restore_stateful(resolved, list(reversed(found)))
        logs.append((saved_order, list(log)))
        paths = [p for p, _ in found]
        assert paths == sorted(paths, key=path_sort_key)
        assert [n for _, n in saved_order] == [obj.name for _, obj in found]
        # and the resolved tree rebuilds by the documented rule
        structure, leaves = through_manifest(flatten_state_dict(resolved))
        assert (
            problems(unflatten_state_dict(structure, leaves), expected(resolved, keep_types=False))
            == []
        )
        results.append(resolved)
    assert logs[0] == logs[1]
