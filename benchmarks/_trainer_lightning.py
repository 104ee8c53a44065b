"""The Lightning section of benchmarks/trainers.py: training blocked per save, by CheckpointIO.

The checkpoint is a real one: Lightning's own dict (`dump_checkpoint`) of a module of about
`mib`/3 MiB of float32 weights after one AdamW step (weights + two moments = `mib`), with its
loops, callbacks and scheduler. Each method saves it `saves` times under fresh names:

- baseline: Lightning's `TorchCheckpointIO` (its default: `torch.save` to a local file);
- `AsyncCheckpointIO(TorchCheckpointIO)`: Lightning's thread wrapper over the same;
- `CloudCheckpointIO` to S3, synchronous;
- `CloudCheckpointIO(async_save=True)`: cloudckpt's async save (blocked: the host copy);
- `AsyncCheckpointIO(CloudCheckpointIO)`: Lightning's wrapper around the plugin.

For asynchronous methods the time until the call returns is what training waits; the upload is
waited for after each save, outside the measurement (as the next save would).
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

from _common import Meter, warm_up_server

TITLE = "PyTorch Lightning: CheckpointIO plugins (blocked per save)"


def available() -> str | None:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return "lightning is not installed (pip install 'cloudckpt[lightning]')"
    return None


def _checkpoint(mib: int, tmp: str) -> dict[str, Any]:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    width = max(64, int(((mib << 20) / 3 / 4 / 4) ** 0.5))  # 4 square layers of float32

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters({"width": width})
            self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters())
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 10)}

    trainer = L.Trainer(
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp,
    )
    trainer.fit(Module(), DataLoader(TensorDataset(torch.randn(8, width)), batch_size=8))
    return trainer._checkpoint_connector.dump_checkpoint()


def measure(server, args) -> list:
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from trainers import Row

    from cloudckpt.integrations.lightning import CloudCheckpointIO

    os.environ.update(server.info.env())
    warm_up_server(server.info)
    checkpoint = _checkpoint(args.mib, args.tmp)
    run = f"s3://{server.info.bucket}/lightning-{int(time.time())}"
    local = os.path.join(args.tmp, "lightning")
    os.makedirs(local, exist_ok=True)

    def settle(io: Any) -> None:
        io.teardown() if isinstance(io, AsyncCheckpointIO) else getattr(io, "wait", lambda: 0)()

    methods = [
        ("TorchCheckpointIO, local file (baseline)", lambda: TorchCheckpointIO(), local),
        (
            "AsyncCheckpointIO(TorchCheckpointIO), local",
            lambda: AsyncCheckpointIO(TorchCheckpointIO()),
            local,
        ),
        ("CloudCheckpointIO, S3", lambda: CloudCheckpointIO(), run),
        ("CloudCheckpointIO(async_save=True), S3", lambda: CloudCheckpointIO(async_save=True), run),
        (
            "AsyncCheckpointIO(CloudCheckpointIO), S3",
            lambda: AsyncCheckpointIO(CloudCheckpointIO()),
            run,
        ),
    ]
    rows = []
    for index, (name, make, where) in enumerate(methods):
        io = make()
        io.save_checkpoint(checkpoint, f"{where}/warm-{index}.ckpt")  # first call's set-up
        settle(io)
        blocked, growth = [], 0
        for n in range(args.saves):
            with Meter() as m:
                io.save_checkpoint(checkpoint, f"{where}/m{index}-s{n}.ckpt")
            blocked.append(m.result.seconds)
            with Meter() as after:
                settle(io)
            growth = max(growth, m.result.rss_growth, after.result.peak_rss - m.result.rss_before)
        note = "writes after the call returns" if "async" in name.lower() else ""
        rows.append(
            Row(method=name, blocked_s=statistics.median(blocked), rss_bytes=growth, note=note)
        )
    return rows
