"""Broadcast group selection: which of a load's read-once broadcasts actually run.

Every distinct group of ranks a broadcast uses is a process group every rank must create, and
its rounds cost collectives, so a load keeps the broadcasts of at most ``max_groups`` groups:
the busiest (most bytes to move; ties to the smaller rank tuple), and of those only groups that
move at least ``min_group_bytes`` in all (however small each region is: small regions travel
together in a group's batches). Broadcasts left out are read by each of their ranks itself.
Pure: every rank computes the same selection from the same assignment.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from cloudckpt.planning.broadcast.readers import Broadcast


def select_broadcasts(
    broadcasts: Sequence[Broadcast],
    max_groups: int,
    *,
    only_group: tuple[int, ...] | None = None,
    min_group_bytes: int = 0,
) -> tuple[int, ...]:
    """Indices (ascending) of ``broadcasts`` whose group is among the ``max_groups`` (>= 0)
    busiest (the bytes of its broadcasts' regions summed) and moves at least
    ``min_group_bytes``. With ``only_group``, of those only the broadcasts to exactly that
    group are kept (a job that cannot create subgroups passes its whole channel)."""
    weight: dict[tuple[int, ...], int] = defaultdict(int)
    for b in broadcasts:
        weight[tuple(b.group)] += b.region.nbytes
    busiest = sorted(weight.items(), key=lambda gw: (-gw[1], gw[0]))[:max_groups]
    keep = {g for g, w in busiest if w >= min_group_bytes}
    if only_group is not None:
        keep &= {tuple(only_group)}
    return tuple(i for i, b in enumerate(broadcasts) if tuple(b.group) in keep)
