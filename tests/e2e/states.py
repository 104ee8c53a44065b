"""Deterministic state dicts for end-to-end tests, laid out for any world size.

Every tensor's global value is a pure function of its name, so any rank of any world can build
both what it saves and what it expects to load. ``build_state(world, rank, mesh)`` returns a
state dict mixing every kind of holding cloudckpt supports; ``blank_like`` returns the same layout
filled with garbage, to be loaded into.
"""

from __future__ import annotations

import hashlib
import math

import torch

import cloudckpt

# name -> (global shape, dtype)
SPECS = {
    "dt_shard0": ((33, 8), torch.float32),  # uneven Shard(0)
    "dt_shard1": ((6, 10), torch.bfloat16),  # Shard(1)
    "dt_rep": ((5, 3), torch.float16),  # Replicate()
    "dt_small_rows": ((3, 4), torch.float32),  # fewer rows than ranks for worlds of 4
    "explicit": ((10, 4), torch.int64),  # GlobalPiece row blocks
    "ragged": ((4, 6), torch.float32),  # flat range decomposed into boxes
    "plain_scalar": ((), torch.float32),
    "plain_empty": ((0, 3), torch.float32),
    "plain_bool": ((7,), torch.bool),
    "plain_noncontig": ((4, 5), torch.float64),
    "opt.state.0.exp_avg": ((33, 8), torch.float32),
    "opt.state.0.step": ((), torch.float32),
}


def global_tensor(name: str) -> torch.Tensor:
    shape, dtype = SPECS[name]
    seed = int.from_bytes(hashlib.blake2b(name.encode(), digest_size=4).digest(), "little")
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype == torch.bool:
        return (torch.rand(n, generator=g) > 0.5).reshape(shape)
    if dtype == torch.int64:
        return torch.randint(-(10**9), 10**9, (n,), generator=g).reshape(shape)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype).reshape(shape)


def _row_split(rows: int, world: int, rank: int) -> tuple[int, int]:
    per = -(-rows // world)
    start = min(rank * per, rows)
    return start, min(start + per, rows) - start


def _ragged_boxes(shape, world, rank):
    """Boxes covering this rank's contiguous range of the flattened tensor."""
    rows, cols = shape
    total = rows * cols
    per = -(-total // world)
    lo, hi = min(rank * per, total), min((rank + 1) * per, total)
    boxes = []
    pos = lo
    while pos < hi:
        r, c = divmod(pos, cols)
        if c == 0 and hi - pos >= cols:
            n_rows = (hi - pos) // cols
            boxes.append(((r, 0), (n_rows, cols)))
            pos += n_rows * cols
        else:
            n = min(cols - c, hi - pos)
            boxes.append(((r, c), (1, n)))
            pos += n
    return boxes


def build_state(world: int, rank: int, *, blank: bool = False) -> dict:
    """The state dict rank ``rank`` of a ``world``-rank job holds (garbage values if ``blank``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def value(name):
        t = global_tensor(name)
        return (
            torch.full_like(t, 7)
            if blank and t.dtype != torch.bool
            else (torch.zeros_like(t) if blank else t)
        )

    mesh = init_device_mesh("cpu", (world,))
    sd: dict = {}
    sd["dt_shard0"] = distribute_tensor(value("dt_shard0"), mesh, [Shard(0)])
    sd["dt_shard1"] = distribute_tensor(value("dt_shard1"), mesh, [Shard(1)])
    sd["dt_rep"] = distribute_tensor(value("dt_rep"), mesh, [Replicate()])
    sd["dt_small_rows"] = distribute_tensor(value("dt_small_rows"), mesh, [Shard(0)])
    start, n = _row_split(10, world, rank)
    sd["explicit"] = cloudckpt.GlobalPiece(
        value("explicit")[start : start + n].clone(), (10, 4), (start, 0)
    )
    full = value("ragged")
    sd["ragged"] = [
        cloudckpt.GlobalPiece(full[o[0] : o[0] + s[0], o[1] : o[1] + s[1]].clone(), (4, 6), o)
        for o, s in _ragged_boxes((4, 6), world, rank)
    ]
    sd["plain_scalar"] = value("plain_scalar")
    sd["plain_empty"] = value("plain_empty")
    sd["plain_bool"] = value("plain_bool")
    sd["plain_noncontig"] = value("plain_noncontig").t().contiguous().t()  # a transposed view
    sd["opt"] = {
        "state": {
            0: {
                "exp_avg": distribute_tensor(value("opt.state.0.exp_avg"), mesh, [Shard(0)]),
                "step": value("opt.state.0.step"),
            }
        },
        "param_groups": [
            {
                "lr": 0.0 if blank else 1e-3,
                "betas": (0.0, 0.0) if blank else (0.9, 0.999),
                "eps": 1e-8,
                "amsgrad": False,
                "foreach": None,
                "params": ["x"] if blank else ["dt_shard0"],
            }
        ],
    }
    sd["meta"] = {
        "epoch": 0 if blank else 3,
        "name": "" if blank else "run-α",
        "blob": b"" if blank else b"\x00\xff",
        "ids": [0, 0, 0] if blank else [1, 2, 3],
        "nested": {"t": (0, (0, 0)) if blank else (1, (2, 3))},
    }
    return sd


EXPECTED_META = {
    "epoch": 3,
    "name": "run-α",
    "blob": b"\x00\xff",
    "ids": [1, 2, 3],
    "nested": {"t": (1, (2, 3))},
}
EXPECTED_GROUPS = [
    {
        "lr": 1e-3,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "amsgrad": False,
        "foreach": None,
        "params": ["dt_shard0"],
    }
]


def check_state(sd: dict) -> list[str]:
    """Compare a loaded state dict against the global values; return the names that differ."""
    from torch.distributed.tensor import DTensor

    bad: list[str] = []

    def check_piece(name, local, offsets):
        full = global_tensor(name)
        view = full
        for d, (o, n) in enumerate(zip(offsets, local.shape)):
            view = view.narrow(d, o, n)
        if local.dtype != full.dtype or not torch.equal(local, view):
            bad.append(name)

    def check_tensor(name, t):
        if isinstance(t, DTensor):
            from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

            _, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            check_piece(name, t.to_local(), tuple(offsets))
        elif isinstance(t, cloudckpt.GlobalPiece):
            check_piece(name, t.local, t.offsets)
        else:
            check_piece(name, t, (0,) * t.dim())

    for name in (
        "dt_shard0",
        "dt_shard1",
        "dt_rep",
        "dt_small_rows",
        "explicit",
        "plain_scalar",
        "plain_empty",
        "plain_bool",
        "plain_noncontig",
    ):
        check_tensor(name, sd[name])
    for piece in sd["ragged"]:
        check_tensor("ragged", piece)
    check_tensor("opt.state.0.exp_avg", sd["opt"]["state"][0]["exp_avg"])
    check_tensor("opt.state.0.step", sd["opt"]["state"][0]["step"])
    if sd["opt"]["param_groups"] != EXPECTED_GROUPS:
        bad.append("opt.param_groups")
    if sd["meta"] != EXPECTED_META or type(sd["meta"]["nested"]["t"]) is not tuple:
        bad.append("meta")
    return bad


def full_state_expected() -> dict:
    """What ``load_full`` must return for a checkpoint of :func:`build_state`."""
    out = {name: global_tensor(name) for name in SPECS if "." not in name}
    out["opt"] = {
        "state": {
            0: {
                "exp_avg": global_tensor("opt.state.0.exp_avg"),
                "step": global_tensor("opt.state.0.step"),
            }
        },
        "param_groups": EXPECTED_GROUPS,
    }
    out["meta"] = EXPECTED_META
    return out
