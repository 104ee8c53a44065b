"""A load's destinations: the tensors read items fill, and reading regions into them.

A :class:`~cloudckpt.planning.ReadItem` copies a stored box into part of destination
``request_index``; :func:`dest_view` is that part (a view, no copy). :func:`fetch_into` reads
each distinct region of a list of items once (see :func:`cloudckpt.dataplane.reader.fetch_regions`)
and copies it into every destination needing it, converting dtype. Only verified bytes reach a
destination. No collective.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from cloudckpt.dataplane.reader import fetch_regions


def region_key(item) -> tuple:
    """What identifies a read item's stored region (tensor, chunk, box)."""
    return (item.name, item.chunk_index, tuple(item.src_offsets), tuple(item.lengths))


def dest_view(dests: Sequence[torch.Tensor], item) -> torch.Tensor:
    """The part of destination ``item.request_index`` that ``item`` fills."""
    view = dests[item.request_index]
    shape = view.shape
    for dim, (off, n) in enumerate(zip(item.dest_offsets, item.lengths)):
        if off or n != shape[dim]:
            view = view.narrow(dim, off, n)
    return view


def sub_view(view: torch.Tensor, offsets, lengths) -> torch.Tensor:
    """The box ``offsets`` + ``lengths`` of ``view``."""
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        if off or n != view.shape[dim]:
            view = view.narrow(dim, off, n)
    return view


async def fetch_into(store, manifest, reads, dests: Sequence[torch.Tensor], max_bytes: int) -> int:
    """Fetch each distinct region of ``reads`` once and copy it into every destination needing
    it (straight into the destinations when their layout allows). Returns the bytes fetched."""
    by_region: dict[tuple, list] = defaultdict(list)
    for item in reads:
        by_region[region_key(item)].append(item)
    regions = [items[0] for items in by_region.values()]

    def consume(region, offsets, tensor):
        for item in by_region[region_key(region)]:
            sub_view(dest_view(dests, item), offsets, tensor.shape).copy_(tensor)

    def targets(region):
        return [dest_view(dests, item) for item in by_region[region_key(region)]]

    return await fetch_regions(
        store, manifest, regions, consume=consume, targets=targets, max_bytes=max_bytes
    )
