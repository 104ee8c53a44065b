"""A tiny Lightning training run the integration tests (and their worker ranks) share.

`train(url, ...)` runs a fixed model on fixed data (4 steps an epoch, no shuffling) through
cloudckpt's Lightning plugin and returns what a test compares: the loss of every step, the final
optimizer and scheduler state and the model's weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from cloudckpt.integrations.lightning import (
    CloudCheckpointIO,
    CloudLoadable,
    CloudModelCheckpoint,
    CloudModelParallelStrategy,
)

STEPS_PER_EPOCH = 4


class Tiny(CloudLoadable, L.LightningModule):
    def __init__(
        self, lr: float = 0.05, width: int = 16, sharded: bool = False, dropout: float = 0.0
    ):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, width),
            torch.nn.ReLU(),
            torch.nn.Dropout(dropout),  # random ops: a resume is exact only with the RNG states
            torch.nn.Linear(width, 1),
        )
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if not self.hparams.sharded:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(ranks: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH * ranks, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(x.shape[0], 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


@dataclass
class Outcome:
    losses: list[float]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    weights: dict[str, torch.Tensor]
    global_step: int
    callback: dict[str, Any] = field(default_factory=dict)


def train(
    url: str,
    *,
    epochs: int,
    resume: str | None = None,
    mode: str = "sync",
    root: str = "/tmp",
    save_top_k: int = -1,
    ranks: int = 1,
) -> Outcome:
    """Train to `epochs` (resuming from `resume`), saving every epoch's end and `last` at `url`.
    `mode`: "sync", "async" (cloudckpt's async save), "lightning-async" (Lightning's
    AsyncCheckpointIO around the plugin), "ddp", "sharded" or "sharded-async" (run on every rank
    of a world)."""
    torch.manual_seed(0)
    # one process: dropout (the plugin restores the saving rank's generators); DDP restores rank
    # 0's only, the sharded strategy none
    one_process = mode in ("sync", "async", "lightning-async")
    model = Tiny(sharded=mode.startswith("sharded"), dropout=0.25 if one_process else 0.0)
    ckpt = CloudModelCheckpoint(
        dirpath=url, every_n_train_steps=STEPS_PER_EPOCH, save_top_k=save_top_k, save_last=True
    )
    kwargs: dict[str, Any] = {"accelerator": "cpu", "devices": ranks}
    if mode.startswith("sharded"):
        kwargs["strategy"] = CloudModelParallelStrategy(
            data_parallel_size=ranks, tensor_parallel_size=1, async_save=mode == "sharded-async"
        )
    else:
        plugin: Any = CloudCheckpointIO(async_save=mode == "async")
        if mode == "lightning-async":
            from lightning.pytorch.plugins.io import AsyncCheckpointIO

            plugin = AsyncCheckpointIO(plugin)
        kwargs["plugins"] = [plugin]
        if mode == "ddp":
            kwargs["strategy"] = "ddp"
    trainer = L.Trainer(
        max_epochs=epochs,
        callbacks=[ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
        num_sanity_val_steps=0,
        **kwargs,
    )
    trainer.fit(model, data(ranks), ckpt_path=resume)
    opt = trainer.optimizers[0]
    if mode.startswith("sharded"):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer = get_optimizer_state_dict(model, opt, options=full)
        weights = get_model_state_dict(model, options=full)
    else:
        optimizer = opt.state_dict()
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Outcome(
        losses=model.losses,
        optimizer=optimizer,
        scheduler=trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        weights=weights,
        global_step=trainer.global_step,
        callback=ckpt.state_dict(),
    )


def rank_train(url: str, root: str, mode: str, epochs: int, resume: str | None) -> Outcome:
    """`train` on one rank of a test world (Lightning finds the processes already started)."""
    import torch.distributed as dist

    return train(
        url,
        epochs=epochs,
        resume=resume,
        mode=mode,
        root=root,
        save_top_k=1,
        ranks=dist.get_world_size(),
    )
