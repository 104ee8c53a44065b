"""The nesting of a state dict as torch DCP keeps it, for :mod:`cloudckpt.dcp.convert`.

What DCP's default planner stores (``torch.distributed.checkpoint._traverse``): mappings are
walked, their keys named as ``str``; a list is walked when it holds a tensor, a mapping, or a
list that is walked; anything else is one item: a tensor (a tensor item), or a value stored with
``torch.save`` (a bytes item): every tuple (a tuple of tensors too), and a list whose tensors sit
inside tuples. ``planner_data`` maps each item's name to its path, and ``dcp_to_torch_save``
rebuilds the nesting from it in the order of ``state_dict_metadata`` with ``set_element``: a
``str`` key makes a dict, an ``int`` key a list.

DCP keeps no empty mapping (no item at all), no mapping kind (an ``OrderedDict`` comes back a
``dict``) and no ``int`` key of a walked mapping (``0`` comes back ``"0"``); a list that held a
dropped empty mapping makes ``dcp_to_torch_save`` fail. :func:`dcp_items` splits exactly as
DCP's planner does and names these changes. It does not add an item for an empty mapping: an
item the state dict given to ``dcp.load`` does not ask for makes DCP's planner retry with the
flattening of torch 2.3 and fail.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from cloudckpt.wording import plural


def dcp_name(path: tuple) -> str:
    """DCP's fully qualified name of the item at ``path``."""
    return ".".join(map(str, path))


def _shown(path: tuple) -> str:
    return repr(dcp_name(path)) if path else "the top level"


def _terminal(value) -> bool:
    # DCP's _is_terminal: a tuple is always a leaf, a list only when nothing inside is walked
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _terminal(entry):
            return False
        if isinstance(entry, torch.Tensor):
            return False
    return True


def dcp_items(nested: Mapping) -> tuple[list[tuple[tuple, object]], list[str]]:
    """DCP's items of the state dict ``nested``, in order: ``(path, leaf)`` as DCP's planner
    splits it. Second result: what DCP keeps differently (module doc), one ``"name: what"`` per
    mapping concerned."""
    items: list[tuple[tuple, object]] = []
    changed: list[str] = []

    def walk(path: tuple, value) -> None:
        if isinstance(value, Mapping):
            if type(value) is not dict:
                changed.append(
                    f"{_shown(path)}: a {type(value).__name__} comes back a dict "
                    "(DCP records no mapping kind)"
                )
            ints = [k for k in value if type(k) is not str]
            if ints:
                changed.append(
                    f"{_shown(path)}: {plural(len(ints), 'key')} not str (such as "
                    f"{ints[0]!r}) come back str (DCP's paths name keys as str)"
                )
            if not value and path:
                changed.append(f"{_shown(path)}: an empty mapping, which DCP does not store")
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif _terminal(value):
            items.append((path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    try:
        walk((), nested)
    finally:
        walk = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle
    return items, changed


def materialize(value, full: Callable[[torch.Tensor], torch.Tensor]):
    """``value`` with each tensor inside (in dicts, lists and tuples) replaced by ``full(t)``;
    containers without tensors are kept as they are."""
    if isinstance(value, torch.Tensor):
        return full(value)
    if isinstance(value, Mapping):
        items = [(k, materialize(v, full)) for k, v in value.items()]
        if all(a is b for (_, a), b in zip(items, value.values())):
            return value
        if type(value) is dict:
            return dict(items)
        # Mapping declares no constructor; a state dict's mappings (OrderedDict, ...) take pairs
        return type(value)(items)  # type: ignore[call-arg]
    if isinstance(value, (list, tuple)):
        items = [materialize(v, full) for v in value]
        if all(a is b for a, b in zip(items, value)):
            return value
        return items if isinstance(value, list) else tuple(items)
    return value


class Incoherent(Exception):
    """Paths of ``planner_data`` that DCP's own saves never write (see :func:`rebuild`)."""


def rebuild(entries: list[tuple[str, object]], planner_data) -> tuple[dict, list[str]]:
    """The state dict ``dcp_to_torch_save`` builds from ``entries`` (``(fqn, leaf)`` in the
    order of ``state_dict_metadata``): each leaf at ``planner_data[fqn]``, or at the top level
    under its name where ``planner_data`` has no entry; a ``str`` key makes a dict, an ``int``
    key a list, holes in a list are ``None`` (noted). Paths DCP never writes (not a tuple of
    ``str`` / ``int``, a leaf and a container at one path, a ``str`` key into a list or an
    ``int`` key into a dict, one path twice, more holes than items) leave every name flat at the
    top level (noted), as do paths deeper than cloudckpt nests (100). Second result: the notes."""
    try:
        return _set_elements(entries, planner_data if isinstance(planner_data, dict) else {})
    except Incoherent as exc:
        flat = {}
        for fqn, leaf in entries:
            flat[fqn] = leaf
        return flat, [f"the DCP checkpoint's planner_data: {exc}; names kept flat"]


_HOLE = object()
MAX_DEPTH = 100  # as cloudckpt.statedict.flatten.flatten_state_dict


def _set_elements(entries, planner_data: dict) -> tuple[dict, list[str]]:
    root: dict = {}
    made = {id(root): root}  # the containers built here (not leaves), by id
    holes_left = len(entries) + 1024

    def make(kind):
        node = kind()
        made[id(node)] = node
        return node

    def child(container, key, kind, path):
        nonlocal holes_left
        if isinstance(container, dict):
            if type(key) is not str:
                raise Incoherent(f"int key {key!r} into the mapping at {_shown(path)}")
            if key not in container:
                container[key] = _HOLE if kind is None else make(kind)
            return container[key]
        if type(key) is not int:
            raise Incoherent(f"str key {key!r} into the list at {_shown(path)}")
        if key >= len(container):
            holes_left -= key - len(container)
            if holes_left < 0:
                raise Incoherent("list indices far past the number of items")
            container.extend([_HOLE] * (key + 1 - len(container)))
        if container[key] is _HOLE and kind is not None:
            container[key] = make(kind)
        return container[key]

    for fqn, leaf in entries:
        path = planner_data.get(fqn, (fqn,))
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not all(type(k) is str or (type(k) is int and k >= 0) for k in path)
        ):
            raise Incoherent(f"the path of {fqn!r} is not a tuple of str keys and list indices")
        path = tuple(path)
        if len(path) > MAX_DEPTH:
            raise Incoherent(f"the path of {fqn!r} is deeper than {MAX_DEPTH} levels")
        node = root
        for depth, key in enumerate(path[:-1]):
            node = child(node, key, dict if type(path[depth + 1]) is str else list, path[:depth])
            if id(node) not in made:
                raise Incoherent(f"{_shown(path[: depth + 1])} is both a leaf and a container")
        if child(node, path[-1], None, path[:-1]) is not _HOLE:
            raise Incoherent(f"two items at {_shown(path)}")
        node[path[-1]] = leaf

    notes: list[str] = []

    def fill(node, path: tuple) -> None:  # only through the containers built here
        for key, v in node.items() if isinstance(node, dict) else enumerate(node):
            if v is _HOLE:
                node[key] = None
                notes.append(
                    f"{_shown(path + (key,))}: not in the DCP checkpoint (DCP stores "
                    "no empty mapping), rebuilt as None"
                )
            elif id(v) in made:
                fill(v, path + (key,))
        if isinstance(node, list) and _terminal(node):
            # DCP splits a list only when it holds a tensor or a mapping: it held a mapping
            # DCP dropped (an empty one); dcp_to_torch_save fails on such a checkpoint
            notes.append(
                f"{_shown(path)}: a list that held an empty mapping DCP did not "
                "store; rebuilt without it"
            )

    try:
        fill(root, ())
    finally:
        fill = None  # type: ignore[assignment]  # the closure refers to itself: break the cycle
    return root, notes
