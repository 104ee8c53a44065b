"""State dicts as people write them, and what cloudckpt gives back (the documented rule).

``people_state()`` mixes every container kind a training script meets: ``OrderedDict``,
``defaultdict`` (a class or a lambda as factory), dict subclasses whose ``__init__`` takes
required arguments (as in torch's own tests), a mapping that is not a dict, list / tuple
subclasses and namedtuples, int keys, odd keys inside values; at the top level and nested.
``blank=True`` gives the same layout with zero tensors and other values, to load into.

``expected(tree, keep_types=...)`` is the rule written out, independent of the library:

- a mapping with only str / int keys, not inside a value, is a *structure* mapping: ``load``
  (``keep_types=True``) keeps the caller's own container; ``load_full`` rebuilds
  ``OrderedDict`` for OrderedDict and subclasses, ``dict`` for every other mapping;
- a list / tuple holding a tensor, not inside a value, is a *structure* sequence: kept by
  ``load``, rebuilt as ``list`` / ``tuple`` by ``load_full``;
- everything else is a *value*, stored whole: its mappings come back as ``dict``, its list and
  tuple subclasses as ``list`` / ``tuple`` (also with ``load``, which replaces values);
- key order is kept everywhere.

``problems(actual, expected)`` lists every difference (type, key order, tensor, value).
"""

from __future__ import annotations

from collections import OrderedDict, defaultdict, namedtuple
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import torch


class ArgsDict(dict):
    """A dict subclass whose ``__init__`` takes required arguments (as in torch's tests)."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = a, b


class ArgsOrderedDict(OrderedDict):
    """An OrderedDict subclass with a required argument."""

    def __init__(self, tag):
        super().__init__()
        self.tag = tag


class PlainSubDict(dict):
    """A dict subclass keeping dict's constructor."""


class Box(MutableMapping):
    """A mutable mapping that is not a dict."""

    def __init__(self, **items):
        self._d = dict(items)

    def __getitem__(self, k):
        return self._d[k]

    def __setitem__(self, k, v):
        self._d[k] = v

    def __delitem__(self, k):
        del self._d[k]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Seq(list):
    """A list subclass."""


class Row(tuple):
    """A tuple subclass built from an iterable."""


Pair = namedtuple("Pair", "first second")


def people_state(*, blank: bool = False, salt: int = 0) -> Any:
    """The state dict (see module doc); every tensor and value depends on ``salt``."""
    counter = iter(range(1000))

    def t(*shape, dtype=torch.float32):
        k = next(counter)
        n = 1
        for s in shape:
            n *= s
        if blank:
            return torch.zeros(shape, dtype=dtype)
        return (
            (torch.arange(n, dtype=torch.float64) + 100 * k + 10_000 * salt)
            .to(dtype)
            .reshape(shape)
        )

    def v(x):
        if not blank:
            return x
        return {int: -1, float: -1.0, str: "", bool: not x}.get(type(x), None)

    dd = defaultdict(list)  # a class as factory
    dd["w"] = t(3, 2)
    dd["n"] = v(3 + salt)
    dl = defaultdict(lambda: 0.5)  # a lambda as factory: not saved
    dl["bias"] = t(2)
    dl[7] = v("seven")  # int key
    ad = ArgsDict(1, 2)
    ad["z"] = t(2, 2, dtype=torch.bfloat16)
    ad["a"] = v(1.5)  # insertion order z, a: kept
    aod = ArgsOrderedDict("x")
    aod["second"] = t(1)
    aod["first"] = v(2)
    optim_state = defaultdict(dict)  # like torch.optim.Optimizer.state, int keys
    optim_state[1] = {"exp_avg": t(4), "step": t()}
    optim_state[0] = {"exp_avg": t(4), "step": t()}
    top = ArgsDict("top", None)  # the state dict itself is a subclass
    top["dd"] = dd
    top["dl"] = dl
    top["ad"] = ad
    top["aod"] = aod
    top["box"] = Box(w=t(3), k=v(4), inner=PlainSubDict(x=t(1), y=v("y")))
    top["optim"] = {
        "state": optim_state,
        # a list of dicts without tensors is one value: its dict subclasses come back as dict
        "param_groups": [
            defaultdict(float, lr=v(0.1), params=[0, 1]),
            PlainSubDict(lr=v(0.2), params=[2]),
        ],
    }
    top["odd_keys"] = defaultdict(int, {(1, 2): v(3), 1.5: v(4)})  # one value (tuple / float keys)
    top["seqs"] = Seq(
        [ArgsDict(0, 0), Pair(t(2), v(5)), Row((t(1), v("r"))), [PlainSubDict(q=t(1))]]
    )
    top["seqs"][0]["deep"] = OrderedDict(b=t(1), a=v(6))
    top["values"] = (Pair(1, 2), Seq([1, 2]), OrderedDict(k=v(9)))  # a tuple value, no tensor
    top["empty"] = defaultdict(list)
    top[3] = v(33)
    return top


# -- the rule -----------------------------------------------------------------------------------


@dataclass
class Exp:
    """An expected container: its exact type and its children (``(key, child)`` pairs for a
    mapping, children for a sequence)."""

    type: type
    children: list


def _holds_tensor(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return True
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v) for v in obj)
    return False


def expected(obj, *, keep_types: bool, in_value: bool = False):
    """What a load gives back for ``obj`` (see module doc)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, Mapping):
        structural = not in_value and all(type(k) in (str, int) for k in obj)
        if not structural:
            return Exp(
                dict,
                [(k, expected(v, keep_types=keep_types, in_value=True)) for k, v in obj.items()],
            )
        kind = type(obj) if keep_types else OrderedDict if isinstance(obj, OrderedDict) else dict
        return Exp(kind, [(k, expected(v, keep_types=keep_types)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        structural = not in_value and _holds_tensor(obj)
        plain = list if isinstance(obj, list) else tuple
        kind = type(obj) if structural and keep_types else plain
        return Exp(kind, [expected(v, keep_types=keep_types, in_value=not structural) for v in obj])
    return obj


def exactly(obj):
    """``obj`` itself as an expectation: every container of its exact type (nothing replaced)."""
    if isinstance(obj, Mapping):
        return Exp(type(obj), [(k, exactly(v)) for k, v in obj.items()])
    if isinstance(obj, (list, tuple)):
        return Exp(type(obj), [exactly(v) for v in obj])
    return obj


def problems(actual, exp, path: str = "") -> list[str]:
    """Every difference between ``actual`` and the expectation ``exp``."""
    where = path or "<root>"
    if isinstance(exp, Exp):
        if type(actual) is not exp.type:
            return [f"{where}: {type(actual).__name__}, expected {exp.type.__name__}"]
        if isinstance(actual, Mapping):
            keys = list(actual.keys())
            want = [k for k, _ in exp.children]
            if keys != want:
                return [f"{where}: keys {keys!r}, expected {want!r}"]
            return [
                p for k, child in exp.children for p in problems(actual[k], child, f"{path}.{k}")
            ]
        if len(actual) != len(exp.children):
            return [f"{where}: {len(actual)} items, expected {len(exp.children)}"]
        return [
            p
            for i, child in enumerate(exp.children)
            for p in problems(actual[i], child, f"{path}.{i}")
        ]
    if isinstance(exp, torch.Tensor):
        if (
            not isinstance(actual, torch.Tensor)
            or actual.dtype != exp.dtype
            or not torch.equal(actual, exp)
        ):
            return [f"{where}: tensor differs"]
        return []
    if type(actual) is not type(exp) or actual != exp:
        return [f"{where}: {actual!r}, expected {exp!r}"]
    return []


def structure_containers(obj, in_value: bool = False) -> list:
    """The mutable structure containers of ``obj`` (those a load in place must keep)."""
    out = []
    if isinstance(obj, Mapping):
        if not in_value and all(type(k) in (str, int) for k in obj):
            out.append(obj)
            for v in obj.values():
                out += structure_containers(v)
    elif isinstance(obj, list) and _holds_tensor(obj):
        out.append(obj)
        for v in obj:
            out += structure_containers(v)
    elif isinstance(obj, tuple) and _holds_tensor(obj):
        for v in obj:
            out += structure_containers(v)
    return out


def check_loaded_in_place(blank, containers_before: list, salt: int = 0) -> list[str]:
    """Problems of a ``people_state(blank=True)`` after a load in place of a checkpoint of
    ``people_state(salt=salt)``: values and types, and the caller's containers kept."""
    found = problems(blank, expected(people_state(salt=salt), keep_types=True))
    after = structure_containers(blank)
    if len(after) != len(containers_before) or any(
        a is not b for a, b in zip(after, containers_before)
    ):
        found.append("the caller's containers were replaced")
    return found
