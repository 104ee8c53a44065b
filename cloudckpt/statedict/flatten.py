"""Nested state dicts <-> dotted names, and the container rules.

No I/O and no collectives. :func:`flatten_state_dict` walks mappings (always), and lists /
tuples that contain a tensor somewhere; everything else is a value leaf (a whole list of floats
is one value). Leaf names join the path with dots (``"optim.state.0.exp_avg"``; list indices and
int keys as numbers). A ``structure`` (msgpack-able) records the nesting with container kinds and
key types, so :func:`unflatten_state_dict` rebuilds it. Tensor leaves (what
:func:`~cloudckpt.statedict.pieces.is_tensor_leaf` accepts) become pieces in
:mod:`cloudckpt.statedict.pieces`.

Containers as people write them. Any ``Mapping`` with str / int keys is a dict node (its key
order kept): ``dict``, ``OrderedDict``, ``defaultdict``, a subclass whose ``__init__`` takes
required arguments, a mapping that is not a dict. A mapping with any other key type is one value
leaf, unless it holds a tensor (refused: :class:`~cloudckpt.errors.PlanningError`). Subclasses of
``list`` and ``tuple`` (namedtuples too) count as lists and tuples. Only the kind is recorded
(``"o"`` for an ``OrderedDict`` or subclass, ``"d"`` for every other mapping), so rebuilding from
the structure alone gives the closest type that can be built: ``OrderedDict`` for OrderedDict
and its subclasses, ``dict`` for every other mapping (a ``defaultdict`` loses its factory),
``list`` / ``tuple`` for their subclasses. Inside a value leaf, containers are stored the same
way (:func:`plain_value`): mappings as ``dict``, list and tuple subclasses as ``list`` /
``tuple``. A load *in place* keeps the caller's own containers: it fills them.

Structure nodes: ``["d", [[key, node], ...]]`` dict, ``["o", ...]`` OrderedDict,
``["l", [node, ...]]`` list, ``["t", [...]]`` tuple, ``["x", name]`` tensor leaf,
``["v", name]`` value leaf.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from cloudckpt.errors import DuplicateKeyError, MissingKeysError, PlanningError
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.statedict.pieces import GlobalPiece, is_tensor_leaf, tensor_pieces
from cloudckpt.wording import plural


@dataclass(frozen=True, slots=True)
class TensorLeaf:
    name: str
    path: tuple
    pieces: tuple[tuple[PieceSpec, torch.Tensor], ...]


@dataclass(frozen=True, slots=True)
class ValueLeaf:
    name: str
    path: tuple
    value: object


@dataclass(frozen=True)
class FlatStateDict:
    tensors: dict[str, TensorLeaf]
    values: dict[str, ValueLeaf]
    structure: object

    def pieces(self) -> list[PieceSpec]:
        """Every tensor piece, leaf by leaf (the order a local save plan uses)."""
        return [spec for leaf in self.tensors.values() for spec, _ in leaf.pieces]

    def local_tensors(self) -> list[torch.Tensor]:
        """The local tensor of each piece, parallel to :meth:`pieces`."""
        return [t for leaf in self.tensors.values() for _, t in leaf.pieces]


def copy_mapping(like: Mapping, items: list[tuple]) -> dict:
    """A new mutable mapping holding ``items`` (in order), as close to ``like``'s type as can be
    built: for a dict subclass, the same type with the same attributes (a shallow ``copy.copy``,
    else a bare instance made without calling ``__init__``), when it takes the items back
    unchanged; else ``OrderedDict`` (OrderedDict subclasses) or ``dict``."""
    if type(like) is dict:
        return dict(items)
    common: dict | None = None  # the common ones, directly
    if type(like) is OrderedDict:
        common = OrderedDict(items)
    elif isinstance(like, defaultdict) and type(like) is defaultdict:
        common = defaultdict(like.default_factory, items)
    if common is not None:
        if getattr(like, "__dict__", None):  # e.g. the _metadata of a module's state dict
            common.__dict__.update(like.__dict__)
        return common
    if isinstance(like, dict):
        for make in (copy.copy, _bare_copy):
            try:
                out = make(like)
                if type(out) is not type(like) or out is like:
                    continue
                out.clear()
                for k, v in items:
                    out[k] = v
                got = list(out.items())
                if len(got) == len(items) and all(
                    gk is k and gv is v for (gk, gv), (k, v) in zip(got, items)
                ):
                    return out
            except Exception:  # noqa: BLE001 - a user class's copy or __setitem__ may raise anything
                continue
    return OrderedDict(items) if isinstance(like, OrderedDict) else dict(items)


def _bare_copy(like: dict) -> dict:
    """An empty instance of ``like``'s class with a copy of its attributes, made the way pickle
    does (``__new__``, no ``__init__``): for subclasses whose ``__init__`` needs arguments."""
    out = type(like).__new__(type(like))
    if hasattr(like, "__dict__"):
        out.__dict__.update(like.__dict__)
    if isinstance(like, defaultdict) and isinstance(out, defaultdict):
        out.default_factory = like.default_factory
    return out


def rebuild_tuple(like: tuple, items: list) -> tuple:
    """A tuple of ``items`` of ``like``'s type when it can be built (namedtuples by field,
    other subclasses from the items), else a plain tuple."""
    if type(like) is tuple:
        return tuple(items)
    cls: Any = type(like)  # a namedtuple class has _make
    try:
        out = cls._make(items) if hasattr(like, "_fields") else cls(items)
        if (
            type(out) is type(like)
            and len(out) == len(items)
            and all(a is b for a, b in zip(out, items))
        ):
            return out
    except Exception:  # noqa: BLE001 - a user class's constructor may raise anything
        pass
    return tuple(items)


def _holds_tensor(obj: object, depth: int = 0) -> bool:
    if isinstance(obj, (torch.Tensor, GlobalPiece)):
        return True
    if depth > 100:
        return False
    if isinstance(obj, Mapping):
        return any(_holds_tensor(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_holds_tensor(v, depth + 1) for v in obj)
    return False


def plain_value(value: Any, depth: int = 0) -> Any:
    """``value`` with its containers as the exact types the value codec stores: mappings as
    ``dict``, list and tuple subclasses as ``list`` / ``tuple`` (see module doc); ``value``
    itself when it holds no other container type. Scalars are not touched (the codec refuses
    the types it cannot keep, naming them)."""
    if depth > 200:  # the codec refuses it, saying so
        return value
    t = type(value)
    if isinstance(value, Mapping):
        items = [
            (k, v if type(v) in _SCALARS else plain_value(v, depth + 1)) for k, v in value.items()
        ]
        if t is dict and all(a is b for (_, a), b in zip(items, value.values())):
            return value
        return dict(items)
    if isinstance(value, (list, tuple)):
        items = [v if type(v) in _SCALARS else plain_value(v, depth + 1) for v in value]
        if (t is list or t is tuple) and all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def flatten_state_dict(
    sd: Mapping,
    *,
    is_broadcastable: Callable[[torch.Tensor], bool] = lambda t: t.device.type == "cpu",
    nesting: bool = True,
) -> FlatStateDict:
    """Flatten a nested state dict (see module doc). Raises
    :class:`~cloudckpt.errors.DuplicateKeyError` when two paths give the same dotted name and
    :class:`~cloudckpt.errors.PlanningError` for keys that are neither str nor int in a dict
    holding tensors. ``nesting=False`` leaves ``structure`` None (a load fills the caller's
    own containers and needs no record of them)."""
    if not isinstance(sd, Mapping):
        raise PlanningError(f"a state dict must be a mapping, got {type(sd).__name__}")
    tensors: dict[str, TensorLeaf] = {}
    values: dict[str, ValueLeaf] = {}
    paths: dict[str, tuple] = {}

    def claim(path: tuple) -> str:
        name = ".".join(str(k) for k in path)
        if name in paths:
            raise DuplicateKeyError(f"paths {paths[name]!r} and {path!r} both flatten to {name!r}")
        paths[name] = path
        return name

    def walk(obj: Any, path: tuple, depth: int) -> Any:
        if depth > 100:
            raise PlanningError(
                f"state dict nested deeper than 100 levels under {path[:6]!r}: a container that "
                "holds itself? break the cycle or flatten the nesting"
            )
        if is_tensor_leaf(obj):
            name = claim(path)
            tensors[name] = TensorLeaf(name, path, tensor_pieces(name, obj, is_broadcastable))
            return ["x", name] if nesting else None
        if isinstance(obj, Mapping):
            keys = list(obj.keys())
            if any(type(k) not in (str, int) for k in keys):
                if _holds_tensor(obj):
                    bad = next(k for k in keys if type(k) not in (str, int))
                    raise PlanningError(
                        f"key {bad!r} at {path!r}: a dict holding tensors needs str or int keys "
                        f"(got {type(bad).__name__}); convert the keys, e.g. to str"
                    )
            else:
                if not nesting:
                    for k, v in obj.items():
                        walk(v, path + (k,), depth + 1)
                    return None
                tag = "o" if isinstance(obj, OrderedDict) else "d"
                return [tag, [[k, walk(v, path + (k,), depth + 1)] for k, v in obj.items()]]
        elif isinstance(obj, (list, tuple)) and _holds_tensor(obj):
            items = [walk(v, path + (i,), depth + 1) for i, v in enumerate(obj)]
            return ["l" if isinstance(obj, list) else "t", items] if nesting else None
        name = claim(path)
        values[name] = ValueLeaf(name, path, plain_value(obj))
        return ["v", name] if nesting else None

    bad = [k for k in sd.keys() if type(k) not in (str, int)]
    if bad:
        raise PlanningError(
            f"top-level key {bad[0]!r}: a state dict needs str or int keys "
            f"(got {type(bad[0]).__name__}); convert the keys, e.g. to str"
        )
    try:
        return FlatStateDict(tensors, values, walk(sd, (), 0))
    finally:
        walk = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle


def unflatten_state_dict(structure: Any, leaves: Mapping[str, object]) -> dict:
    """Rebuild the nesting recorded by :func:`flatten_state_dict`, taking each leaf's object
    from ``leaves`` by name. Missing leaves raise :class:`~cloudckpt.errors.MissingKeysError`."""
    missing: list[str] = []

    def build(node: Any) -> Any:
        if not isinstance(node, (list, tuple)) or len(node) != 2:
            raise PlanningError(f"malformed structure node {node!r}")
        tag, body = node
        if tag in ("x", "v"):
            if body not in leaves:
                missing.append(body)
                return None
            return leaves[body]
        if tag in ("d", "o"):
            out = OrderedDict() if tag == "o" else {}
            for key, child in body:
                out[key] = build(child)
            return out
        if tag in ("l", "t"):
            items = [build(child) for child in body]
            return items if tag == "l" else tuple(items)
        raise PlanningError(f"unknown structure tag {tag!r}")

    try:
        root = build(structure)
    finally:
        build = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle
    if missing:
        raise MissingKeysError(
            f"{plural(len(missing), 'leaf', 'leaves')} missing: {', '.join(map(repr, missing))}",
            keys=tuple(missing),
        )
    return root


def merge_structures(structures: Iterable[Any]) -> Any:
    """Union of several ranks' structures (ranks may hold different keys, e.g. pipeline stages).

    Dict nodes merge key by key (order of first appearance, ranks in the given order); list and
    tuple nodes merge element by element (extra elements appended); where two ranks disagree on a
    node's kind, the first one wins. Pure: the inputs are not modified.
    """

    out = None
    for structure in structures:
        out = _merge_nodes(out, structure)
    return out


def _merge_nodes(a: Any, b: Any) -> Any:
    """One node of :func:`merge_structures` (a module function: a recursive closure would be a
    reference cycle, left for the garbage collector)."""
    if a is None:
        return b
    if b is None or a[0] != b[0] or a[0] in ("x", "v"):
        return a
    if a[0] in ("d", "o"):
        entries: dict = {}
        for key, node in list(a[1]) + list(b[1]):
            k = (type(key).__name__, key)
            entries[k] = [key, _merge_nodes(entries[k][1], node)] if k in entries else [key, node]
        return [a[0], list(entries.values())]
    body = (
        [_merge_nodes(x, y) for x, y in zip(a[1], b[1])]
        + list(a[1][len(b[1]) :])
        + list(b[1][len(a[1]) :])
    )
    return [a[0], body]


def set_by_path(root: Any, path: Iterable[Any], value: object) -> None:
    """Set ``value`` at ``path`` inside ``root`` (mappings and lists in place; tuples on the way
    are rebuilt and stored back into their parent)."""
    path = tuple(path)
    if not path:
        raise PlanningError("empty path")
    chain = [root]
    for key in path[:-1]:
        chain.append(chain[-1][key])
    new = value
    for depth in range(len(path) - 1, -1, -1):
        container, key = chain[depth], path[depth]
        if isinstance(container, tuple):
            items = list(container)
            items[key] = new
            new = rebuild_tuple(container, items)
            if depth == 0:
                raise PlanningError("cannot set inside a top-level tuple")
            continue
        container[key] = new
        return


def check_replaceable(root: Any, path: Iterable[Any]) -> None:
    """Raise :class:`~cloudckpt.errors.PlanningError` unless :func:`set_by_path` can replace the
    value at ``path`` inside ``root``: the innermost container on the way that is not a tuple
    (tuples are rebuilt) must take item assignment (a ``mappingproxy`` or a read-only
    ``Mapping`` does not)."""
    path = tuple(path)
    chain = [root]
    for key in path[:-1]:
        chain.append(chain[-1][key])
    for depth in range(len(path) - 1, -1, -1):
        container = chain[depth]
        if isinstance(container, tuple):
            continue
        if callable(getattr(type(container), "__setitem__", None)):
            return
        name = ".".join(str(k) for k in path)
        raise PlanningError(
            f"value {name!r} sits in a read-only {type(container).__name__}: a load cannot "
            "replace it; pass a dict there (tensors inside are filled in place)"
        )
    raise PlanningError("cannot set inside a top-level tuple")
