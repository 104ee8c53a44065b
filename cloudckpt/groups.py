"""Process groups as cloudckpt sees them: which ranks a ``process_group`` argument names.

The one place cloudckpt resolves a process group. ``None`` (or ``torch.distributed``'s
``WORLD``) is every rank; a group object its ranks; ``"self"`` (:data:`SELF`) this process
alone, with no collective even when ``torch.distributed`` is initialised. Without
``torch.distributed`` initialised every group is this process alone. No collective here.
"""

from __future__ import annotations

import torch.distributed as dist

SELF = "self"
"""The ``process_group`` that names this process alone: no collective, even when
``torch.distributed`` is initialised."""


def distributed() -> bool:
    """Whether ``torch.distributed`` is initialised in this process."""
    return dist.is_available() and dist.is_initialized()


def is_self(process_group) -> bool:
    """Whether ``process_group`` is :data:`SELF`; ``ValueError`` for any other string."""
    if isinstance(process_group, str):
        if process_group != SELF:
            raise ValueError(
                f"process_group must be a torch.distributed process group, None (the world) "
                f"or {SELF!r} (this process alone), got {process_group!r}"
            )
        return True
    return False


def group_ranks(process_group=None) -> tuple[int, ...]:
    """The global ranks of ``process_group`` (default: the world) in group order; ``(0,)``
    without ``torch.distributed``; this process's own global rank for :data:`SELF`. The one
    place cloudckpt resolves a process group."""
    if not distributed():
        is_self(process_group)  # a bad string fails the same with or without a job
        return (0,)
    if is_self(process_group):
        return (dist.get_rank(),)
    if process_group is None or process_group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    return tuple(dist.get_process_group_ranks(process_group))


def group_rank(process_group=None) -> int:
    """This process's rank within ``process_group`` (0 is the coordinator; 0 without
    ``torch.distributed``). No collective. Raises ``ValueError`` for a non-member."""
    if not distributed() or is_self(process_group):
        return 0
    return group_ranks(process_group).index(dist.get_rank())
