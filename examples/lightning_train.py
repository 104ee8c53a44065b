"""Train a small Lightning model with its checkpoints on S3 through cloudckpt, then resume.

    python examples/lightning_train.py --url s3://bucket/runs/lit --epochs 3
    python examples/lightning_train.py --url s3://bucket/runs/lit --epochs 6 --resume last
    python examples/lightning_train.py --demo        # both of the above, then compares the losses

What it shows (the lines cloudckpt adds are marked ``# cloudckpt``):

- ``Trainer(plugins=[CloudCheckpointIO(async_save=...)])``: every save, load and removal of the
  trainer goes through cloudckpt (no pickle, no s3fs, nothing staged on local disk);
- ``CloudModelCheckpoint(dirpath="s3://...", every_n_train_steps=..., save_top_k=1,
  save_last=True)``: Lightning's ``ModelCheckpoint`` with its folder on S3; older checkpoints are
  removed through ``cloudckpt.delete``, ``last.ckpt`` is replaced atomically;
- ``trainer.fit(..., ckpt_path="last")`` resumes from the newest committed ``last.ckpt``;
- ``MyModule.load_from_checkpoint("s3://.../last.ckpt")`` (the ``CloudLoadable`` mixin).

The data is synthetic and fixed (no shuffling), so ``--demo`` can check that a run stopped after
``--epochs`` and resumed takes exactly the steps of one that was never stopped.

Storage: endpoint and credentials come from the standard AWS variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ...) or the usual AWS chain. With no ``AWS_ENDPOINT_URL`` and no
``--url``, a private local SeaweedFS is started for this run only (its checkpoints vanish when the
run ends). Prints one line per epoch and one per event.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from cloudckpt.integrations.lightning import (  # cloudckpt
    CloudCheckpointIO,
    CloudLoadable,
    CloudModelCheckpoint,
)

DEFAULT_BUCKET = "cloudckpt-test"


class Regressor(CloudLoadable, L.LightningModule):  # cloudckpt: CloudLoadable (optional)
    def __init__(self, width: int = 64, lr: float = 0.01):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(16, width), torch.nn.GELU(), torch.nn.Linear(width, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().item())
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def on_train_epoch_end(self) -> None:
        print(f"epoch {self.current_epoch}: step {self.global_step} loss {self.losses[-1]:.5f}")

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def loader(batches: int) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 * batches, 16, generator=g)
    y = (x[:, :4].sum(dim=1, keepdim=True) - x[:, 4:].mean(dim=1, keepdim=True)).tanh()
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def fit(url: str, epochs: int, resume: str | None, args) -> Regressor:
    torch.manual_seed(0)
    model = Regressor()
    checkpoints = CloudModelCheckpoint(  # cloudckpt
        dirpath=url, every_n_train_steps=args.batches, save_top_k=1, save_last=True
    )
    trainer = L.Trainer(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        plugins=[CloudCheckpointIO(async_save=args.async_save)],  # cloudckpt
        callbacks=[checkpoints],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    start = time.perf_counter()
    trainer.fit(model, loader(args.batches), ckpt_path=resume)
    took = time.perf_counter() - start
    print(f"fit: {trainer.global_step} steps in {took:.1f} s; last checkpoint {url}/last.ckpt")
    return model


def resolve_url(args) -> tuple[str, object]:
    """The run URL, and a private server to stop at the end (or None)."""
    if args.url:
        return args.url.rstrip("/"), None
    if os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL_S3"):
        raise SystemExit("AWS_ENDPOINT_URL is set: pass --url s3://<bucket>/<prefix> as well")
    from cloudckpt.testing.servers.seaweed.server import S3Server

    print("lightning_train: no --url and no AWS_ENDPOINT_URL: starting a private SeaweedFS")
    server = S3Server()
    info = server.start()
    os.environ.update(info.env())
    return f"s3://{DEFAULT_BUCKET}/lightning/run-{int(time.time())}", server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", help="the checkpoint folder s3://bucket/prefix")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batches", type=int, default=8, help="steps per epoch (default 8)")
    p.add_argument("--resume", default=None, help='"last" or a checkpoint URL')
    p.add_argument("--async-save", action="store_true", help="cloudckpt's asynchronous saves")
    p.add_argument("--demo", action="store_true", help="stop, resume and compare the losses")
    args = p.parse_args(argv)
    url, server = resolve_url(args)
    try:
        with tempfile.TemporaryDirectory() as root:
            args.root = root
            if not args.demo:
                fit(url, args.epochs, args.resume, args)
                return 0
            whole = fit(f"{url}/whole", 2 * args.epochs, None, args)
            fit(f"{url}/cut", args.epochs, None, args)
            resumed = fit(f"{url}/cut", 2 * args.epochs, "last", args)
            same = resumed.losses == whole.losses[args.epochs * args.batches :]
            print(f"resumed run's losses equal the uninterrupted run's: {same}")
            back = Regressor.load_from_checkpoint(f"{url}/cut/last.ckpt")
            weights = all(
                torch.equal(a, b)
                for a, b in zip(back.state_dict().values(), resumed.state_dict().values())
            )
            print(f"load_from_checkpoint gives the trained weights: {weights}")
            return 0 if same and weights else 1
    finally:
        if server is not None:
            server.stop()  # type: ignore[attr-defined]


if __name__ == "__main__":
    raise SystemExit(main())
