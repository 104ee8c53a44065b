"""Tensor leaves of a state dict -> pure piece descriptors (:class:`PieceSpec`) and local tensors.

No I/O and no collectives. A plain ``torch.Tensor`` is one piece covering the whole tensor
(replicated if other ranks hold it too); a ``DTensor`` gives the box(es) of its local shard (Shard /
Replicate / _StridedShard placements on any mesh; Partial is refused); a :class:`GlobalPiece` is a
piece the caller describes; a non-empty list or tuple made only of ``GlobalPiece`` is a ragged
holding of one tensor (:func:`is_tensor_leaf`). Each piece carries its local tensor (for DTensor,
views of ``to_local()``: they share storage, so a load fills the DTensor in place).

DTensor sharding is known in one place, :func:`dtensor_local_boxes`, through torch's private
helpers (:mod:`cloudckpt.statedict.torch_private`).
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cloudckpt.errors import PlanningError
from cloudckpt.planning.pieces import PieceSpec
from cloudckpt.statedict.dtypes import dtype_name
from cloudckpt.statedict.torch_private import (
    compute_local_shape_and_global_offset,
    shard_size_and_offsets,
    strided_shard_class,
)

#: ``(offsets, sizes, local_index)``: a box of a global tensor and where it sits in a local one.
Box = tuple[tuple[int, ...], tuple[int, ...], tuple[slice, ...]]


@dataclass(frozen=True)
class GlobalPiece:
    """A piece of a global tensor described explicitly: ``local`` holds the box starting at
    ``offsets`` with ``local.shape`` as sizes, inside a tensor of ``global_shape``."""

    local: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.local, torch.Tensor):
            raise PlanningError(
                f"GlobalPiece.local must be a torch.Tensor, got {type(self.local).__name__}"
            )
        shape = tuple(int(s) for s in self.global_shape)
        offsets = tuple(int(o) for o in self.offsets)
        object.__setattr__(self, "global_shape", shape)
        object.__setattr__(self, "offsets", offsets)
        sizes = tuple(self.local.shape)
        if not len(shape) == len(offsets) == len(sizes) or any(
            o < 0 or o + s > g for o, s, g in zip(offsets, sizes, shape)
        ):
            raise PlanningError(
                f"GlobalPiece of local shape {sizes} at offsets {offsets} does not fit in "
                f"global shape {shape}"
            )


def is_tensor_leaf(obj: object) -> bool:
    """True for what flattening turns into one tensor leaf: a tensor (DTensor too), a
    :class:`GlobalPiece`, or a non-empty list or tuple (not a subclass) of ``GlobalPiece``."""
    if isinstance(obj, (torch.Tensor, GlobalPiece)):
        return True
    return (
        isinstance(obj, (list, tuple))
        and type(obj) in (list, tuple)
        and len(obj) > 0
        and all(isinstance(p, GlobalPiece) for p in obj)
    )


def _is_dtensor(obj: object) -> bool:
    """Whether ``obj`` is a DTensor. ``torch.distributed.tensor`` is not imported for that
    (it costs a second or more: sympy, torch.fx): a DTensor exists only once its module has
    been imported by whoever made it."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    return dtensor is not None and isinstance(obj, dtensor)


def dtensor_local_boxes(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int] | None,
    placements: Sequence[Any],
) -> list[Box]:
    """The one place that knows DTensor sharding: boxes of the local shard of a DTensor.

    Returns ``[(offsets, sizes, local_index)]`` where ``local_index`` (a tuple of slices)
    selects the box inside the local tensor. One box unless a ``_StridedShard`` scatters the
    shard; ``coordinate=None`` (rank outside the mesh) gives no box.
    """
    global_shape = tuple(int(s) for s in global_shape)
    if coordinate is None:
        return []
    if any(p.is_partial() for p in placements):
        raise PlanningError(
            "Partial placements cannot be saved: reduce them first (redistribute to Replicate)"
        )
    strided = strided_shard_class()
    full = tuple(slice(None) for _ in global_shape)
    if strided is None or not any(isinstance(p, strided) for p in placements):
        sizes, offsets = compute_local_shape_and_global_offset(
            global_shape, tuple(mesh_shape), list(coordinate), placements
        )
        return [(offsets, sizes, full)]
    from torch.distributed.tensor import Shard

    local = list(global_shape)
    index: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, (Shard, strided)):
            continue
        d = p.dim
        local[d], index[d] = shard_size_and_offsets(
            local[d], mesh_shape[mesh_dim], coordinate[mesh_dim], p, index.get(d), global_shape[d]
        )
    runs_per_dim = []
    for d, extent in enumerate(global_shape):
        if d not in index:
            runs_per_dim.append([(0, 0, extent)])  # (local start, global start, length)
        elif local[d] == 0:
            return [
                (
                    tuple(
                        min(int(index[d][0]), extent) if j == d else 0
                        for j in range(len(global_shape))
                    ),
                    tuple(local),
                    full,
                )
            ]
        else:
            idx = np.asarray(index[d].tolist()[: local[d]], dtype=np.int64)
            cuts = np.flatnonzero(np.diff(idx) != 1) + 1
            bounds = np.concatenate(([0], cuts, [len(idx)])).tolist()
            runs_per_dim.append([(a, int(idx[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:])])
    boxes: list[Box] = []
    for combo in itertools.product(*runs_per_dim):
        boxes.append(
            (
                tuple(g for _, g, _ in combo),
                tuple(n for _, _, n in combo),
                tuple(slice(a, a + n) for a, _, n in combo),
            )
        )
    return boxes


def tensor_pieces(
    name: str, obj: Any, is_broadcastable: Callable[[torch.Tensor], bool]
) -> tuple[tuple[PieceSpec, torch.Tensor], ...]:
    """The pieces of the tensor leaf ``obj`` (see :func:`is_tensor_leaf`) named ``name``, each
    with its local tensor; ``is_broadcastable`` says whether a local tensor can be broadcast
    (the backend's device)."""
    if _is_dtensor(obj):
        local = obj.to_local()
        mesh = obj.device_mesh
        try:
            boxes = dtensor_local_boxes(
                tuple(obj.shape), tuple(mesh.shape), mesh.get_coordinate(), obj.placements
            )
        except PlanningError as exc:
            raise PlanningError(f"DTensor {name!r}: {exc}") from exc
        dtype = dtype_name(obj.dtype)
        bcast = bool(is_broadcastable(local))
        out: list[tuple[PieceSpec, torch.Tensor]] = []
        for offsets, sizes, index in boxes:
            view = local[index] if index else local
            if tuple(view.shape) != sizes:
                raise PlanningError(
                    f"DTensor {name!r}: local shard has shape {tuple(view.shape)}, expected {sizes}"
                )
            out.append((PieceSpec(name, dtype, tuple(obj.shape), offsets, sizes, bcast), view))
        return tuple(out)
    pieces = obj if isinstance(obj, (list, tuple)) else [obj]
    out = []
    for p in pieces:
        if isinstance(p, GlobalPiece):
            t, shape, offsets = p.local, p.global_shape, p.offsets
        else:
            t, shape, offsets = p, tuple(p.shape), (0,) * p.dim()
        out.append(
            (
                PieceSpec(
                    name,
                    dtype_name(t.dtype),
                    shape,
                    offsets,
                    tuple(t.shape),
                    bool(is_broadcastable(t)),
                ),
                t,
            )
        )
    return tuple(out)
