"""Section of benchmarks/trainers.py: Hugging Face ``transformers.Trainer``.

A model of about ``mib / 3`` MiB of float32 parameters, AdamW after one step (so model plus
optimizer state is about ``mib`` MiB), no training loop: each save is one call of the Trainer's
``_save_checkpoint`` at a new ``global_step``, which is what ``save_steps`` runs, and the loop
waits for all of it. Baseline: the Trainer's own local checkpoint folder (safetensors weights,
``torch.save`` of optimizer, scheduler, RNG, the JSON trainer state) under ``args.tmp``; then
``CloudckptTrainer`` writing the same checkpoint to the local SeaweedFS, synchronously and with
``async_save=True`` (blocked: until the call returns; the upload is awaited outside the timer).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Meter, MiB, remove_dir  # noqa: E402

TITLE = "Hugging Face transformers.Trainer (a checkpoint at save_steps)"


def available() -> str | None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return "transformers is not installed (pip install 'cloudckpt[hf]')"
    return None


def _model(mib: int):
    import torch

    class Wide(torch.nn.Module):
        """Linear layers of ``mib / 3`` MiB in all; ``forward`` returns a loss as the Trainer
        wants."""

        def __init__(self) -> None:
            super().__init__()
            n = max(1, (mib * MiB // 3) // (4 * 1024 * 1024))  # 4 MiB layers
            self.layers = torch.nn.ModuleList(torch.nn.Linear(1024, 1024) for _ in range(n))

        def forward(self, x=None, labels=None):
            y = x
            for layer in self.layers:
                y = layer(y)
            return {"loss": y.pow(2).mean()}

    return Wide()


def _trainer(cls, out: str, mib: int, **kw):
    import torch
    from transformers import TrainingArguments

    args = TrainingArguments(
        output_dir=out, save_steps=1, report_to=[], use_cpu=True, disable_tqdm=True
    )
    t = cls(model=_model(mib), args=args, **kw)
    t.create_optimizer_and_scheduler(num_training_steps=1000)
    loss = t.model(x=torch.randn(2, 1024))["loss"]
    loss.backward()
    t.optimizer.step()  # AdamW's state exists now
    return t


def _time_saves(trainer, saves: int) -> tuple[float, int]:
    blocked, growth = [], 0
    for i in range(saves):
        trainer.state.global_step = i + 1
        with Meter() as m:
            trainer._save_checkpoint(trainer.model, None)
        blocked.append(m.result.seconds)
        growth = max(growth, m.result.rss_growth)
        wait = getattr(trainer, "wait_for_checkpoint", None)
        if wait is not None:  # an async upload: training would run meanwhile, not measured
            wait()
    return statistics.median(blocked), growth


def measure(server, args) -> list:
    from trainers import Row
    from transformers import Trainer

    from cloudckpt.integrations.hf_trainer import CloudckptTrainer

    for key, value in server.info.env().items():
        os.environ[key] = value
    local = os.path.join(args.tmp, "hf-trainer-local")
    rows = []
    t = _trainer(Trainer, local, args.mib)
    _time_saves(t, 1)  # warm-up: first-call costs of both paths are not a save's
    remove_dir(local)
    s, rss = _time_saves(t, args.saves)
    rows.append(Row(method="Trainer, local folder", blocked_s=s, rss_bytes=rss))
    remove_dir(local)
    url = server.info.url("bench-hf-trainer")
    c = _trainer(
        CloudckptTrainer, os.path.join(args.tmp, "hf-logs"), args.mib, checkpoint_url=f"{url}/warm"
    )
    _time_saves(c, 1)
    c.checkpoint_url = f"{url}/run"
    s, rss = _time_saves(c, args.saves)
    rows.append(Row(method="CloudckptTrainer, s3://", blocked_s=s, rss_bytes=rss))
    c.checkpoint_url, c.checkpoint_async = f"{url}/async", True
    s, rss = _time_saves(c, args.saves)
    rows.append(
        Row(
            method="CloudckptTrainer(async_save=True)",
            blocked_s=s,
            rss_bytes=rss,
            note="upload after the call",
        )
    )
    return rows
