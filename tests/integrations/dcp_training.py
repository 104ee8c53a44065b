"""A tiny FSDP2 training loop for the DCP trainer tests, run on gloo ranks: a 2-layer MLP sharded
with ``fully_shard``, AdamW and a LambdaLR schedule, each step's batch drawn from a generator
seeded by (step, rank) so that a resumed run sees the same data as an uninterrupted one."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

DIM, HIDDEN, OUT, BATCH = 16, 24, 4, 8


def build_model(seed: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(DIM, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT)
    )
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def build_optim(model: torch.nn.Module):
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    return optim, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, OUT, generator=g)


def train_step(model, optim, sched, step: int) -> float:
    x, y = batch(step)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    sched.step()
    optim.zero_grad()
    return float(loss.detach())


class AppState(Stateful):
    """What the trainer hands DCP: model and optimizer (``get_state_dict``: DTensors), scheduler
    and the step."""

    def __init__(self, model, optim, sched):
        self.model, self.optim, self.sched = model, optim, sched
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {
            "model": model_sd,
            "optim": optim_sd,
            "sched": self.sched.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(
            self.model,
            self.optim,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]


def full_state(model, optim, sched) -> dict[str, Any]:
    """Everything a resume must restore exactly, as plain full tensors and values."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    def full(v):
        if isinstance(v, DTensor):
            return v.full_tensor()
        if isinstance(v, dict):
            return {k: full(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return type(v)(full(x) for x in v)
        return v.clone() if isinstance(v, torch.Tensor) else v

    model_sd, optim_sd = get_state_dict(model, optim)
    sched_sd = {k: v for k, v in sched.state_dict().items() if k != "lr_lambdas"}
    return {"model": full(model_sd), "optim": full(optim_sd), "sched": sched_sd}


def same(a, b) -> bool:
    """Exact equality of nested dicts/lists of tensors and values."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b
