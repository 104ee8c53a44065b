"""What a load fills on this rank (:class:`Wanted`): the flattened state dict, each requested
piece with its destination tensor, the stateful objects found on the way, and how the loaded
non-tensor values are put back (:meth:`Wanted.restore`). Used by :mod:`cloudckpt.api.load`;
no collective, no I/O."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Any

from cloudckpt.statedict.flatten import check_replaceable, flatten_state_dict, set_by_path
from cloudckpt.statedict.stateful import resolve_stateful, restore_stateful
from cloudckpt.transport import ControlChannel


@dataclass(frozen=True)
class Wanted:
    """What a load fills on this rank: the flattened state dict, each requested piece with its
    destination tensor, and the stateful objects found on the way."""

    resolved: Any
    found: list
    flat: Any
    requests: list
    dests: list

    @classmethod
    def of(cls, state_dict, channel: ControlChannel) -> Wanted:
        resolved, found = resolve_stateful(state_dict)
        flat = flatten_state_dict(
            resolved, is_broadcastable=_broadcast_predicate(channel), nesting=False
        )
        requests, dests = [], []
        for leaf in flat.tensors.values():
            for spec, tensor in leaf.pieces:
                requests.append(spec)
                dests.append(tensor)
        return cls(resolved=resolved, found=found, flat=flat, requests=requests, dests=dests)

    def check_replaceable(self, state_dict, manifest) -> None:
        """Refuse, before any data moves, a stored value the caller's containers cannot take."""
        for name, leaf in self.flat.values.items():
            if name in manifest.values and not _under_stateful(leaf.path, self.found):
                check_replaceable(state_dict, leaf.path)

    def restore_can_fail(self, state_dict) -> bool:
        """Whether :meth:`restore` runs code that may raise: ``load_state_dict()`` of a
        stateful object, or a value set through a container other than a plain ``dict``,
        ``OrderedDict``, ``defaultdict`` or ``list`` (tuples on the way are rebuilt, never
        failing), in the caller's containers or their copies."""
        if self.found:
            return True
        return not all(
            _plain_containers(root, leaf.path)
            for leaf in self.flat.values.values()
            for root in (state_dict, self.resolved)
        )

    def restore(self, state_dict, manifest) -> None:
        """Set the loaded non-tensor values, then ``load_state_dict()`` on stateful objects."""
        for name, leaf in self.flat.values.items():
            if name in manifest.values:
                _assign_value(
                    state_dict, self.resolved, self.found, leaf.path, manifest.values[name]
                )
        restore_stateful(self.resolved, self.found)


def _broadcast_predicate(channel: ControlChannel):
    """Destinations the job's broadcast backend can carry: CUDA for NCCL, CPU for gloo."""
    device_type = "cuda" if channel.backend == "nccl" else "cpu"
    return lambda t: t.device.type == device_type


def _assign_value(original, resolved, found, path: tuple, value) -> None:
    """Set a loaded non-tensor value in the resolved tree, and in the caller's own containers
    unless the path goes through a stateful object (which gets it via load_state_dict)."""
    set_by_path(resolved, path, value)
    if not _under_stateful(path, found):
        set_by_path(original, path, value)  # checked replaceable at planning


_PLAIN_SETITEM = (dict, OrderedDict, defaultdict, list)


def _plain_containers(root, path: tuple) -> bool:
    """Whether every container holding the value at ``path`` takes item assignment without
    running code of its own (see :meth:`Wanted.restore_can_fail`)."""
    node = root
    for key in path:
        if not (type(node) in _PLAIN_SETITEM or isinstance(node, tuple)):
            return False
        node = node[key]
    return True


def _under_stateful(path: tuple, found) -> bool:
    return any(path[: len(p)] == p for p, _ in found)
