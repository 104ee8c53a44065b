"""Run by ``torchrun --nproc_per_node 2`` (gloo, CPU) from test_hf_trainer_ddp.py: an
uninterrupted run, a run stopped after its step-2 checkpoint and its resume from S3, all through
CloudckptTrainer; rank 0 writes what the test compares to the JSON file named by argv[2]."""

from __future__ import annotations

import json
import sys
import tempfile

import torch
import torch.distributed as dist

from cloudckpt.integrations.hf_trainer import CloudckptTrainer
from tests.integrations.hf_models import TokenData, losses, stop_at, tiny_model, trainer_args


def main(run_url: str, result: str) -> None:
    out: dict = {}
    trainers = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, url, callbacks, resume, seed in (
            ("full", f"{run_url}/full", [], None, 0),
            ("stopped", f"{run_url}/stopped", [stop_at(2)], None, 0),
            ("resumed", f"{run_url}/stopped", [], "latest", 5),
        ):
            t = CloudckptTrainer(
                checkpoint_url=url,
                model=tiny_model(seed),
                args=trainer_args(f"{tmp}/{name}", ddp_backend="gloo"),
                train_dataset=TokenData(),
                callbacks=callbacks,
            )
            t.train(resume_from_checkpoint=resume)
            trainers[name] = t
            out[name] = losses(t.state.log_history)
    full, resumed = trainers["full"], trainers["resumed"]
    a, b = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    out["optimizer_equal"] = (
        all(torch.equal(v, b["state"][k][n]) for k, e in a["state"].items() for n, v in e.items())
        and a["param_groups"] == b["param_groups"]
    )
    out["scheduler_equal"] = full.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()
    out["world_size"] = dist.get_world_size()
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, [out["optimizer_equal"], out["scheduler_equal"]])
    out["all_ranks"] = flags
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
