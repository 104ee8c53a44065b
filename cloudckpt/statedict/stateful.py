"""Values that save through ``state_dict()`` and restore through ``load_state_dict()``.

Like DCP's ``Stateful``: modules, optimizers, schedulers and user objects that have both methods
are replaced by their ``state_dict()`` before flattening, wherever they sit in the (nested) state
dict, and get ``load_state_dict()`` called with the filled dict after a load.

Order, the same on every rank whatever order each rank built its dicts in (these methods may run
collectives: FSDP's ``get_state_dict`` / ``set_state_dict`` do). Paths compare element by element
(:func:`path_sort_key`): ints (list positions, int keys) numerically, before strs (by code point),
before keys of any other type (by type name, then ``repr``).

- ``state_dict()`` runs in path order, an object before the stateful objects its own state dict
  holds (they are found only once it has run).
- ``load_state_dict()`` runs in path order, except that an object comes after the stateful
  objects inside its state dict, so it sees them restored.

Containers on the way are copied (a load never writes into a dict that ``state_dict()``
returned), so ``load_state_dict()`` gets the types its ``state_dict()`` gave: dicts and their
subclasses as the same type with the same attributes and factory when that can be built
faithfully (:func:`~cloudckpt.statedict.flatten.copy_mapping`), else, and for mappings that are not
dicts, as an ``OrderedDict`` (OrderedDict subclasses) or a plain ``dict``. Lists become lists;
tuples are rebuilt (namedtuples as themselves) only when something inside changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from cloudckpt.statedict.flatten import copy_mapping, rebuild_tuple

#: containers nested deeper than this are left as they are (flattening then refuses them).
MAX_DEPTH = 100


def is_stateful(value: Any) -> bool:
    """True for objects with callable ``state_dict`` and ``load_state_dict`` (not tensors)."""
    if isinstance(value, torch.Tensor):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    )


def key_sort_key(key: Any) -> tuple:
    """Total order of one path element: ints, then strs, then anything else (type name, repr)."""
    if type(key) is int:
        return (0, key)
    if type(key) is str:
        return (1, key)
    return (2, f"{type(key).__module__}.{type(key).__qualname__}", repr(key))


def path_sort_key(path: tuple) -> tuple:
    """Sort key of a path: element by element (:func:`key_sort_key`); a path sorts before the
    paths that extend it."""
    return tuple(key_sort_key(k) for k in path)


def _restore_sort_key(path: tuple) -> tuple:
    # a terminator above every element key: a path sorts after the paths that extend it
    return path_sort_key(path) + ((3,),)


def resolve_stateful(tree: Any) -> tuple[Any, list[tuple[tuple, Any]]]:
    """Return a copy of ``tree``'s containers with stateful values replaced by ``state_dict()``.

    Also returns ``(path, object)`` for every stateful value found, in the order their
    ``state_dict()`` ran (see module doc: path order, outer first). Tensors and other leaves are
    not copied; the copy keeps every mapping's key order.
    """
    found: list[tuple[tuple, Any]] = []

    def walk(node: Any, path: tuple, depth: int) -> Any:
        if is_stateful(node):
            found.append((path, node))
            return walk(node.state_dict(), path, depth)
        if depth > MAX_DEPTH:
            return node
        if isinstance(node, Mapping):
            items = list(node.items())
            if all(_is_leaf(v) for _, v in items):  # nothing to resolve below (a module's tensors)
                return copy_mapping(node, items)
            done: list[Any] = [None] * len(items)
            # visit keys in path order, so state_dict() runs in the same order on every rank
            for i in sorted(range(len(items)), key=lambda j: key_sort_key(items[j][0])):
                k, v = items[i]
                done[i] = walk(v, path + (k,), depth + 1)
            return copy_mapping(node, [(k, v) for (k, _), v in zip(items, done)])
        if isinstance(node, list):
            return [walk(v, path + (i,), depth + 1) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            out = [walk(v, path + (i,), depth + 1) for i, v in enumerate(node)]
            changed = any(a is not b for a, b in zip(out, node))
            return rebuild_tuple(node, out) if changed else node
        return node

    try:
        return walk(tree, (), 0), found
    finally:
        walk = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle


_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def _is_leaf(value: Any) -> bool:
    """Cheaply known to hold no stateful object: a tensor or a plain scalar."""
    return type(value) in _SCALARS or isinstance(value, torch.Tensor)


def get_path(tree: Any, path: tuple) -> Any:
    """The node at ``path`` inside nested dicts / lists / tuples."""
    for key in path:
        tree = tree[key]
    return tree


def restore_stateful(resolved: Any, found: list[tuple[tuple, Any]]) -> None:
    """Call ``load_state_dict`` on each stateful object with its (now filled) sub-dict.

    In path order, each object after the stateful objects inside its own state dict (see module
    doc), whatever the order of ``found``.
    """
    for path, obj in sorted(found, key=lambda pf: _restore_sort_key(pf[0])):
        obj.load_state_dict(get_path(resolved, path))
