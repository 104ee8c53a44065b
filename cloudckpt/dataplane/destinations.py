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

from cloudckpt.dataplane.buffers import byte_view, is_byte_viewable
from cloudckpt.dataplane.reader import fetch_regions, stored_dtype


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


class DestinationBytes:
    """Where read items can land as bytes: ``views(items)`` gives, for items of one stored
    region (each naming its destination ``dests[item.request_index]`` and its box there), the
    flat byte view of each item's box when every destination is byte-viewable
    (:func:`~cloudckpt.dataplane.buffers.is_byte_viewable`) and of ``dtype`` and every box is
    one contiguous run of its destination; else ``None``. The same answer, and the same bytes,
    as :func:`~cloudckpt.dataplane.buffers.byte_view` of each :func:`dest_view` when it is
    byte-viewable, at a fraction of the cost: one byte view per destination (not per item),
    sliced at each box's row-major byte offset, no narrowed tensor made."""

    def __init__(self, dests: Sequence[torch.Tensor]):
        self.dests = dests
        self._bases: dict[int, tuple[torch.dtype, tuple[int, ...], int, memoryview] | None] = {}

    def _base(self, index: int):
        """(dtype, row-major strides in elements, itemsize, byte view) of destination
        ``index``, or ``None`` when it is not byte-viewable (made once per destination)."""
        if index in self._bases:
            return self._bases[index]
        t = self.dests[index]
        base = None
        if is_byte_viewable(t):
            strides, step = [], 1
            for n in reversed(t.shape):
                strides.append(step)
                step *= n
            base = (t.dtype, tuple(reversed(strides)), t.element_size(), byte_view(t))
        self._bases[index] = base
        return base

    def views(self, items, dtype: torch.dtype) -> list[memoryview] | None:
        out = []
        for item in items:
            base = self._base(item.request_index)
            if base is None or base[0] != dtype:
                return None
            _, strides, itemsize, flat = base
            shape = self.dests[item.request_index].shape
            start, numel, partial = 0, 1, False
            for off, n, full, stride in zip(item.dest_offsets, item.lengths, shape, strides):
                if partial and n != full:
                    return None  # a dimension after a partial one is cut: not one run
                if n != 1:
                    partial = True
                start += off * stride
                numel *= n
            out.append(flat[start * itemsize : (start + numel) * itemsize])
        return out


async def fetch_into(store, manifest, reads, dests: Sequence[torch.Tensor], max_bytes: int) -> int:
    """Fetch each distinct region of ``reads`` once and copy it into every destination needing
    it (straight into the destinations when their layout allows: :class:`DestinationBytes`). Returns
    the bytes fetched."""
    by_region: dict[tuple, list] = defaultdict(list)
    for item in reads:
        by_region[region_key(item)].append(item)
    regions = [items[0] for items in by_region.values()]
    lands = DestinationBytes(dests)

    def consume(region, offsets, tensor):
        for item in by_region[region_key(region)]:
            sub_view(dest_view(dests, item), offsets, tensor.shape).copy_(tensor)

    def targets(region):
        return [dest_view(dests, item) for item in by_region[region_key(region)]]

    def landing(region):
        return lands.views(by_region[region_key(region)], stored_dtype(manifest, region.name))

    return await fetch_regions(
        store,
        manifest,
        regions,
        consume=consume,
        targets=targets,
        max_bytes=max_bytes,
        landing=landing,
    )
