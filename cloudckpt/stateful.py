"""Values that save through ``state_dict()`` and restore through ``load_state_dict()``.

Like DCP's ``Stateful``: modules, optimizers, schedulers and user objects that have both methods
are replaced by their ``state_dict()`` before flattening, wherever they sit in the (nested) state
dict, and get ``load_state_dict()`` called with the filled dict after a load.
"""

from __future__ import annotations

from typing import Any

import torch


def is_stateful(value: Any) -> bool:
    """True for objects with callable ``state_dict`` and ``load_state_dict`` (not tensors)."""
    if isinstance(value, torch.Tensor):
        return False
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


def resolve_stateful(tree: Any) -> tuple[Any, list[tuple[tuple, Any]]]:
    """Return a copy of ``tree``'s containers with stateful values replaced by ``state_dict()``.

    Also returns ``(path, object)`` for every stateful value found (outermost first). Tensors and
    other leaves are not copied.
    """
    found: list[tuple[tuple, Any]] = []

    def walk(node: Any, path: tuple) -> Any:
        if is_stateful(node):
            found.append((path, node))
            return walk(node.state_dict(), path)
        if isinstance(node, dict):
            return type(node)((k, walk(v, path + (k,))) for k, v in node.items()) \
                if type(node) is not dict else {k: walk(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, tuple) and not hasattr(node, "_fields"):
            return tuple(walk(v, path + (i,)) for i, v in enumerate(node))
        return node

    return walk(tree, ()), found


def get_path(tree: Any, path: tuple) -> Any:
    """The node at ``path`` inside nested dicts / lists / tuples."""
    for key in path:
        tree = tree[key]
    return tree


def restore_stateful(resolved: Any, found: list[tuple[tuple, Any]]) -> None:
    """Call ``load_state_dict`` on each stateful object with its (now filled) sub-dict.

    Innermost objects first, so an outer object sees restored inner ones.
    """
    for path, obj in sorted(found, key=lambda pf: -len(pf[0])):
        obj.load_state_dict(get_path(resolved, path))
