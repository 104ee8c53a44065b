"""statedict: flattening, structure, GlobalPiece, DTensor boxes (with torch's fake process
group)."""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import numpy as np
import pytest
import torch
import torch.distributed as dist

from cloudckpt.errors import DuplicateKeyError, MissingKeysError, PlanningError
from cloudckpt.manifest.dtypes import DTYPE_ITEMSIZE
from cloudckpt.manifest.values import decode_value, encode_value
from cloudckpt.planning.save.global_plan import plan_global_save
from cloudckpt.planning.save.local_plan import LocalSavePlan
from cloudckpt.statedict.dtypes import dtype_name, torch_dtype
from cloudckpt.statedict.flatten import (
    flatten_state_dict,
    merge_structures,
    set_by_path,
    unflatten_state_dict,
)
from cloudckpt.statedict.pieces import GlobalPiece, dtensor_local_boxes
from tests.planning.layouts import shard_boxes


def leaves_of(flat):
    out = {n: leaf.pieces[0][1] for n, leaf in flat.tensors.items()}
    out.update({n: leaf.value for n, leaf in flat.values.items()})
    return out


def test_flatten_names_values_and_exact_structure():
    sd = {
        "model": OrderedDict(w=torch.ones(3, 2), b=torch.zeros(2)),
        "optim": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 2)}},
            "param_groups": [
                {"lr": 0.1, "betas": (0.9, 0.99), "params": ["model.w"], "foreach": None}
            ],
        },
        "mixed": (torch.ones(1), 5),
        "step": 7,
        "empty": {},
    }
    flat = flatten_state_dict(sd)
    assert list(flat.tensors) == [
        "model.w",
        "model.b",
        "optim.state.0.step",
        "optim.state.0.exp_avg",
        "mixed.0",
    ]
    assert list(flat.values) == ["optim.param_groups", "mixed.1", "step"]
    assert flat.tensors["optim.state.0.exp_avg"].path == ("optim", "state", 0, "exp_avg")
    assert flat.values["optim.param_groups"].value is sd["optim"]["param_groups"]
    spec = flat.tensors["model.w"].pieces[0][0]
    assert (spec.dtype, spec.global_shape, spec.offsets, spec.sizes, spec.broadcastable) == (
        "float32",
        (3, 2),
        (0, 0),
        (3, 2),
        True,
    )
    assert flat.tensors["optim.state.0.step"].pieces[0][0].global_shape == ()
    # the structure survives the exact value codec and rebuilds exact containers and key types
    structure = decode_value(
        encode_value(flat.structure, key="s", allow_pickle=False), key="s", allow_pickle=False
    )
    rebuilt = unflatten_state_dict(structure, leaves_of(flat))
    assert type(rebuilt["model"]) is OrderedDict and list(rebuilt["model"]) == ["w", "b"]
    assert type(rebuilt["mixed"]) is tuple and rebuilt["mixed"][1] == 5
    assert 0 in rebuilt["optim"]["state"] and rebuilt["empty"] == {}
    assert rebuilt["optim"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert flat.pieces() == [leaf.pieces[0][0] for leaf in flat.tensors.values()]
    assert flat.local_tensors()[0] is sd["model"]["w"]


def test_unflatten_reports_missing_leaves():
    flat = flatten_state_dict({"a": torch.ones(1), "b": 2})
    with pytest.raises(MissingKeysError) as exc:
        unflatten_state_dict(flat.structure, {"a": 1})
    assert exc.value.keys == ("b",)


@pytest.mark.parametrize(
    "sd",
    [
        {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}},
        {"a": {0: torch.ones(1), "0": 3}},
    ],
)
def test_colliding_paths_raise_duplicate_key(sd):
    with pytest.raises(DuplicateKeyError) as exc:
        flatten_state_dict(sd)
    assert "both flatten to" in str(exc.value)


def test_odd_keys_are_values_unless_they_hold_tensors():
    flat = flatten_state_dict({"table": {(1, 2): "x", 1.5: None}})
    assert list(flat.values) == ["table"]
    with pytest.raises(PlanningError, match=r"\(1, 2\)"):
        flatten_state_dict({"table": {(1, 2): torch.ones(1)}})
    with pytest.raises(PlanningError, match="top-level key"):
        flatten_state_dict({None: 1})


def test_global_pieces_and_ragged_lists():
    a, b = torch.ones(2, 3), torch.zeros(1, 3)
    flat = flatten_state_dict(
        {
            "w": [GlobalPiece(a, (5, 3), (0, 0)), GlobalPiece(b, (5, 3), (4, 0))],
            "v": GlobalPiece(torch.ones(2), (4,), (2,)),
        }
    )
    pieces = flat.tensors["w"].pieces
    assert [(p.offsets, p.sizes) for p, _ in pieces] == [((0, 0), (2, 3)), ((4, 0), (1, 3))]
    assert pieces[0][1] is a
    assert flat.tensors["v"].pieces[0][0].offsets == (2,)
    with pytest.raises(PlanningError, match="does not fit"):
        GlobalPiece(torch.ones(3), (4,), (2,))
    with pytest.raises(PlanningError, match="does not fit"):
        GlobalPiece(torch.ones(3), (4, 1), (0,))


def test_broadcastable_predicate():
    flat = flatten_state_dict({"w": torch.ones(1)}, is_broadcastable=lambda t: False)
    assert flat.tensors["w"].pieces[0][0].broadcastable is False


def test_dtype_names_round_trip():
    for name in DTYPE_ITEMSIZE:
        if isinstance(getattr(torch, name, None), torch.dtype):
            assert dtype_name(torch_dtype(name)) == name
            assert torch.empty(0, dtype=torch_dtype(name)).element_size() == DTYPE_ITEMSIZE[name]
    with pytest.raises(PlanningError, match="not supported"):
        dtype_name(torch.complex32)
    with pytest.raises(PlanningError, match="not supported"):
        torch_dtype("float128")


def test_merge_structures_of_ranks_holding_different_keys():
    a = flatten_state_dict(
        {"model": {"layers": {0: {"w": torch.ones(1)}}}, "step": 1, "extra": [torch.ones(1)]}
    )
    b = flatten_state_dict(
        {"model": {"layers": {1: {"w": torch.ones(1)}}}, "step": 1, "extra": [torch.ones(1), 2]}
    )
    merged = merge_structures([a.structure, b.structure])
    leaves = {**leaves_of(a), **leaves_of(b)}
    assert unflatten_state_dict(merged, leaves) == {
        "model": {
            "layers": {0: {"w": leaves["model.layers.0.w"]}, 1: {"w": leaves["model.layers.1.w"]}}
        },
        "step": 1,
        "extra": [leaves["extra.0"], 2],
    }
    assert merge_structures([a.structure]) == a.structure and merge_structures([]) is None


def test_set_by_path_rebuilds_tuples():
    root = {"a": [1, (2, {"x": (3, 4)})]}
    set_by_path(root, ("a", 1, 1, "x", 0), 9)
    assert root == {"a": [1, (2, {"x": (9, 4)})]}
    set_by_path(root, ("a", 1, 0), 5)
    assert root["a"][1] == (5, {"x": (9, 4)}) and type(root["a"][1]) is tuple
    set_by_path(root, ("b",), 1)
    assert root["b"] == 1


# --- DTensor -------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_rank(rank: int, world: int):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


PLACEMENTS = [
    ((4,), [("S", 0)]),
    ((4,), [("S", 1)]),
    ((4,), [("R",)]),
    ((2, 2), [("S", 0), ("S", 1)]),
    ((2, 2), [("R",), ("S", 0)]),
    ((2, 2), [("S", 0), ("S", 0)]),
    ((2, 3), [("S", 1), ("R",)]),
]


def torch_placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Shard(p[1]) if p[0] == "S" else Replicate() for p in spec]


@pytest.mark.parametrize("mesh_shape,spec", PLACEMENTS)
@pytest.mark.parametrize("shape", [(7, 5), (3, 2), (1, 9)])
def test_dtensor_boxes_match_the_reference_and_cover_exactly(mesh_shape, spec, shape):
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    world = int(np.prod(mesh_shape))
    reference = shard_boxes(shape, mesh_shape, spec)
    plans = []
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape)
            placements = torch_placements(spec)
            local_shape, _ = compute_local_shape_and_global_offset(shape, mesh, placements)
            dt = DTensor.from_local(
                torch.zeros(local_shape),
                mesh,
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=(shape[1], 1),
            )
            ((spec_, local),) = flatten_state_dict({"w": dt}).tensors["w"].pieces
        assert spec_.sizes == reference[rank][1]
        if all(spec_.sizes):
            assert spec_.offsets == reference[rank][0]
        assert local.data_ptr() == dt.to_local().data_ptr()
        plans.append(LocalSavePlan(rank=rank, world_size=world, pieces=[spec_]))
    plan_global_save(plans, rank=0)  # raises CoverageError unless the boxes tile the tensor


def test_strided_shard_boxes_tile_the_tensor():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    for placements in (
        [_StridedShard(0, split_factor=2), Shard(0)],
        [Shard(0), _StridedShard(0, split_factor=2)],
    ):
        plans = []
        for coord in np.ndindex(2, 2):
            boxes = dtensor_local_boxes((8, 5), (2, 2), list(coord), placements)
            pieces = [PieceSpecFor(o, s) for o, s, _ in boxes]
            plans.append(LocalSavePlan(rank=len(plans), world_size=4, pieces=pieces))
        plan_global_save(plans, rank=0)
    boxes = dtensor_local_boxes(
        (8, 5), (2, 2), [0, 0], [Shard(0), _StridedShard(0, split_factor=2)]
    )
    assert [(o, s) for o, s, _ in boxes] == [((0, 0), (1, 5)), ((2, 0), (1, 5))]
    assert [idx[0] for _, _, idx in boxes] == [slice(0, 1), slice(1, 2)]
    assert dtensor_local_boxes((8, 5), (2, 2), None, placements) == []


def PieceSpecFor(offsets, sizes):
    from cloudckpt.planning.pieces import PieceSpec

    return PieceSpec("w", "float32", (8, 5), offsets, sizes)


def test_partial_placement_is_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(PlanningError, match="Partial"):
        dtensor_local_boxes((4,), (2,), [0], [Partial()])


def test_without_nesting_the_leaves_are_the_same():
    """``nesting=False`` (a load: it fills the caller's containers) records no structure and
    finds the very same tensors, pieces and values."""
    sd = {
        "model": {"w": torch.ones(2, 3), "layers": [torch.zeros(4), {"b": torch.ones(1)}]},
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
        "step": 3,
    }
    full, bare = flatten_state_dict(sd), flatten_state_dict(sd, nesting=False)
    assert bare.structure is None and full.structure is not None
    assert full.pieces() == bare.pieces()
    assert [t.data_ptr() for t in full.local_tensors()] == [
        t.data_ptr() for t in bare.local_tensors()
    ]
    assert {k: (v.path, v.value) for k, v in full.values.items()} == {
        k: (v.path, v.value) for k, v in bare.values.items()
    }
