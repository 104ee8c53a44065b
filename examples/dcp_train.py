"""A DCP training loop (the way torchtitan saves) checkpointed to S3 through cloudckpt.

    torchrun --nproc-per-node 2 examples/dcp_train.py --url s3://bucket/runs/dcp --steps 20
    python examples/dcp_train.py --url s3://bucket/runs/dcp --steps 20 --async   # one process

What it shows: the whole change from a plain ``dcp.save(state, checkpoint_id=folder)`` loop is
``cloudckpt.integrations.dcp_trainer.DCPRun``: ``run.load(state)`` resumes from the newest
complete step (every rank the same one), ``run.save(state, step)`` / ``run.async_save(...)``
writes ``<url>/step-<N>/`` in DCP's layout, and ``keep_last`` prunes in the background without
ever deleting the newest complete checkpoint. The model is sharded with FSDP2 when there is more
than one process (gloo on CPU); model, optimizer, LR schedule and step go through a ``Stateful``.

The data of step ``s`` on rank ``r`` is a function of ``(s, r)`` only: stop the run
(``--stop-at N``, or kill it) and start it again with the same arguments: it continues from the
last complete checkpoint and prints the same losses an uninterrupted run prints.

Endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``, ...); a
local server: ``python -m cloudckpt.testing.servers.seaweed``. Rank 0 prints ``step N loss X``
(``X`` exactly, as ``repr`` gives it) and ``resumed from step N`` / ``fresh start``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from cloudckpt.integrations.dcp_trainer import DCPRun


class Trainer(Stateful):
    """What goes into each checkpoint: model, optimizer, LR schedule and the step."""

    def __init__(self, world: int):
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
        )
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for layer in (self.model[0], self.model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=3e-3, foreach=False)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.optim, lambda s: 1 / (1 + 0.1 * s))
        self.step = 0

    def state_dict(self):
        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim, "sched": self.sched.state_dict(), "step": self.step}

    def load_state_dict(self, state):
        set_state_dict(
            self.model, self.optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        self.sched.load_state_dict(state["sched"])
        self.step = state["step"]

    def train_step(self, rank: int) -> float:
        g = torch.Generator().manual_seed(1000 * self.step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.optim.step()
        self.sched.step()
        self.optim.zero_grad()
        return float(loss.detach())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", required=True, help="the run: s3://bucket/prefix (or a folder)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--async", dest="use_async", action="store_true", help="dcp.async_save")
    ap.add_argument("--stop-at", type=int, default=None, help="stop after this step (a 'crash')")
    args = ap.parse_args()

    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1

    trainer = Trainer(world)
    state = {"trainer": trainer}
    run = DCPRun(args.url, keep_last=args.keep_last)
    resumed = run.load(state)
    if rank == 0:
        print(f"resumed from step {resumed}" if resumed is not None else "fresh start", flush=True)
    while trainer.step < args.steps:
        trainer.step += 1
        loss = trainer.train_step(rank)
        if rank == 0:
            print(f"step {trainer.step} loss {loss!r}", flush=True)
        if trainer.step % args.save_every == 0 or trainer.step == args.steps:
            if args.use_async:
                run.async_save(state, trainer.step)  # training goes on while it uploads
            else:
                run.save(state, trainer.step)
        if trainer.step == args.stop_at:
            break
    run.close()  # waits for the last asynchronous save and its pruning
    if rank == 0:
        kept = [c.step for c in run.list() if c.complete]
        print(f"complete checkpoints: {kept}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
