"""torch's private names, each reached through cloudckpt.statedict.torch_private: every helper
works with the installed torch, and a name torch lacks is a clear TorchPrivateAPIError."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from cloudckpt.statedict import torch_private
from cloudckpt.statedict.torch_private import (
    REQUIRED,
    TorchPrivateAPIError,
    compute_local_shape_and_global_offset,
    shard_size_and_offsets,
    storage_info_class,
    stream_transform_classes,
    strided_shard_class,
)


@pytest.mark.parametrize(("module", "name"), REQUIRED)
def test_every_required_name_exists_in_the_installed_torch(module, name):
    assert getattr(importlib.import_module(module), name) is not None


def test_local_shape_and_offset_of_a_sharded_dimension():
    # 10 rows over 4 ranks: 3, 3, 3, 1
    assert compute_local_shape_and_global_offset((10, 4), (4,), [1], [Shard(0)]) == (
        (3, 4),
        (3, 0),
    )
    assert compute_local_shape_and_global_offset((10, 4), (4,), [3], [Shard(0)]) == (
        (1, 4),
        (9, 0),
    )
    assert compute_local_shape_and_global_offset(
        (6, 4), (2, 2), [1, 0], [Shard(1), Replicate()]
    ) == (
        (6, 2),
        (0, 2),
    )


def test_shard_size_and_offsets_gives_each_local_element_its_global_index():
    size, index = shard_size_and_offsets(10, 4, 2, Shard(0), None, 10)
    assert size == 3 and [int(i) for i in index[:size]] == [6, 7, 8]


def test_strided_shard_is_a_placement_the_shard_helper_takes():
    strided = strided_shard_class()
    assert strided is not None  # the installed torch has it
    placement = strided(0, split_factor=2)
    assert isinstance(placement, Placement) and placement.dim == 0
    size, index = shard_size_and_offsets(8, 2, 0, placement, None, 8)
    assert size == 4 and sorted(int(i) for i in index[:size]) == [int(i) for i in index[:size]]


def test_storage_info_is_dcp_s_class():
    cls = storage_info_class()
    info = cls("__0_0.distcp", 4, 8)
    assert (info.relative_path, info.offset, info.length) == ("__0_0.distcp", 4, 8)


def test_stream_transform_classes_are_dcp_s_extension_registry():
    registry_cls, transform_cls = stream_transform_classes()
    registry = registry_cls()
    assert isinstance(registry.from_descriptor_list([]), list)
    assert isinstance(transform_cls, type)


def test_a_missing_module_is_a_typed_error_naming_it():
    with pytest.raises(TorchPrivateAPIError, match=r"no module torch\.no_such_module"):
        torch_private.private("torch.no_such_module", "_thing")
    assert issubclass(TorchPrivateAPIError, ImportError)


def test_a_missing_name_is_a_typed_error_naming_it_and_the_torch_version(monkeypatch):
    from torch.distributed.tensor import _utils

    monkeypatch.delattr(_utils, "_compute_local_shape_and_global_offset")
    with pytest.raises(TorchPrivateAPIError) as raised:
        compute_local_shape_and_global_offset((4,), (1,), [0], [Replicate()])
    message = str(raised.value)
    assert "torch.distributed.tensor._utils._compute_local_shape_and_global_offset" in message
    assert torch.__version__ in message


def test_missing_storage_info_and_extensions_are_typed_errors(monkeypatch):
    from torch.distributed.checkpoint import _extension, filesystem

    monkeypatch.delattr(filesystem, "_StorageInfo")
    monkeypatch.delattr(_extension, "ExtensionRegistry")
    with pytest.raises(TorchPrivateAPIError, match="_StorageInfo"):
        storage_info_class()
    with pytest.raises(TorchPrivateAPIError, match="ExtensionRegistry"):
        stream_transform_classes()


def test_a_torch_without_strided_shard_gives_none(monkeypatch):
    from torch.distributed.tensor import placement_types

    monkeypatch.delattr(placement_types, "_StridedShard")
    assert strided_shard_class() is None


def test_a_dtensor_box_without_strided_shard_still_uses_the_plain_helper(monkeypatch):
    from torch.distributed.tensor import placement_types

    from cloudckpt.statedict.pieces import dtensor_local_boxes

    monkeypatch.delattr(placement_types, "_StridedShard")
    assert dtensor_local_boxes((10,), (4,), (1,), [Shard(0)]) == [((3,), (3,), (slice(None),))]
