"""Every private name of torch that cloudckpt uses, and the only module that imports one.

torch has no stability promise for these (and cloudckpt sets no upper bound on torch), so each
is reached through one function here, and ``tests/test_torch_private.py`` checks each against
the installed torch.

Contract:
- Names are looked up when a function is called, never at import: importing this module never
  fails on another torch.
- A required name that the installed torch lacks raises :class:`TorchPrivateAPIError` (an
  ``ImportError``) naming the module, the name and the torch version.
- An optional name (:func:`strided_shard_class`: a placement older torch does not have) gives
  ``None`` instead: nothing can hold an instance of a class torch does not define.

=========================================================  =======================================
private name                                               used for
=========================================================  =======================================
``torch.distributed.tensor._utils``                        a DTensor's local shard boxes
  ``._compute_local_shape_and_global_offset``,             (:mod:`cloudckpt.statedict.pieces`)
  ``._get_shard_size_and_offsets``
``torch.distributed.tensor.placement_types._StridedShard``  the same (optional)
``torch.distributed.checkpoint.filesystem._StorageInfo``   DCP's ``.metadata`` (``cloudckpt.dcp``)
``torch.distributed.checkpoint._extension``                DCP stream transforms (``dcp.reads``)
  ``.ExtensionRegistry``, ``.StreamTransformExtension``
``torch.distributed.distributed_c10d._get_default_store``  the join handshake (``cloudckpt.groups``)
=========================================================  =======================================
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the real types, for the checker only
    from torch.distributed.checkpoint._extension import (
        ExtensionRegistry,
        StreamTransformExtension,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.tensor.placement_types import Placement, _StridedShard

_UTILS = "torch.distributed.tensor._utils"
_PLACEMENTS = "torch.distributed.tensor.placement_types"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_EXTENSION = "torch.distributed.checkpoint._extension"
_C10D = "torch.distributed.distributed_c10d"

#: Every required ``(module, name)`` above (the test checks each exists).
REQUIRED = (
    (_UTILS, "_compute_local_shape_and_global_offset"),
    (_UTILS, "_get_shard_size_and_offsets"),
    (_FILESYSTEM, "_StorageInfo"),
    (_EXTENSION, "ExtensionRegistry"),
    (_EXTENSION, "StreamTransformExtension"),
    (_C10D, "_get_default_store"),
)


class TorchPrivateAPIError(ImportError):
    """A private torch name cloudckpt relies on is missing from the installed torch."""


def _module(module: str, name: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise TorchPrivateAPIError(
            f"torch {torch.__version__} has no module {module} (cloudckpt needs {module}.{name})"
        ) from exc


def private(module: str, name: str) -> Any:
    """``module.name`` from the installed torch, or :class:`TorchPrivateAPIError`."""
    try:
        return getattr(_module(module, name), name)
    except AttributeError as exc:
        raise TorchPrivateAPIError(
            f"torch {torch.__version__} has no {module}.{name}, which cloudckpt needs"
        ) from exc


def compute_local_shape_and_global_offset(
    global_shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    coordinate: list[int],
    placements: Sequence[Placement],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local sizes, global offsets)`` of the local shard of a DTensor without strided shards
    on the rank at ``coordinate`` of the mesh."""
    compute = private(_UTILS, "_compute_local_shape_and_global_offset")
    sizes, offsets = compute(global_shape, mesh_shape, coordinate, placements)
    return tuple(int(s) for s in sizes), tuple(int(o) for o in offsets)


def shard_size_and_offsets(
    local_size: int,
    mesh_dim_size: int,
    rank: int,
    placement: Placement,
    previous_offsets: torch.Tensor | None,
    zero_global_offset: int,
) -> tuple[int, torch.Tensor]:
    """One mesh dimension's ``Shard`` / ``_StridedShard`` applied to one tensor dimension:
    ``(local size, global index of each local element)``; ``previous_offsets`` is that index
    after the mesh dimensions before (``None`` before the first); an empty shard's index starts
    at ``zero_global_offset``."""
    get = private(_UTILS, "_get_shard_size_and_offsets")
    size, offsets = get(
        local_size, mesh_dim_size, rank, placement, previous_offsets, zero_global_offset, False
    )
    return int(size), offsets


def strided_shard_class() -> type[_StridedShard] | None:
    """torch's ``_StridedShard`` placement, or ``None`` for a torch without it."""
    try:
        return private(_PLACEMENTS, "_StridedShard")
    except TorchPrivateAPIError:
        return None


def storage_info_class() -> type[_StorageInfo]:
    """DCP's ``_StorageInfo`` (where an item lies: relative path, offset, length)."""
    return private(_FILESYSTEM, "_StorageInfo")


def stream_transform_classes() -> tuple[type[ExtensionRegistry], type[StreamTransformExtension]]:
    """DCP's ``ExtensionRegistry`` and ``StreamTransformExtension`` (stream transforms of a
    ``.distcp`` item, e.g. compression)."""
    return private(_EXTENSION, "ExtensionRegistry"), private(_EXTENSION, "StreamTransformExtension")


def default_store() -> Any:
    """The key-value store the default process group rendezvoused through (a ``TCPStore``,
    usually behind a ``PrefixStore``): every rank of the job reaches it."""
    return private(_C10D, "_get_default_store")()
