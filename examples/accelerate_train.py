"""Train a tiny Llama with Accelerate, ``save_state`` / ``load_state`` on S3 through cloudckpt.

    python examples/accelerate_train.py --url s3://bucket/runs/acc --steps 6
    accelerate launch --num_processes 2 examples/accelerate_train.py --url s3://bucket/runs/acc

``cloudckpt.integrations.hf_accelerate.save_state(accelerator, url)`` every ``--save-every``
steps writes ``<url>/checkpoint_<n>`` (automatic checkpoint naming; ``--keep`` is
``total_limit``); on start ``load_state`` resumes from the newest complete one when there is one,
so running it again with more ``--steps`` continues the run. The model is built from a config
(no download), the data is random tokens fixed by a seed. Endpoint and credentials come from
the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).
"""

from __future__ import annotations

import argparse
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Progress:
    """The loop's position, saved with the checkpoint (``register_for_checkpointing``)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the run folder, s3://bucket/prefix")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-every", type=int, default=2)
    p.add_argument("--keep", type=int, default=2, help="total_limit")
    args = p.parse_args(argv)

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration
    from transformers import LlamaConfig, LlamaForCausalLM

    from cloudckpt.integrations.hf_accelerate import load_state, save_state

    torch.manual_seed(0)
    acc = Accelerator(
        project_config=ProjectConfiguration(automatic_checkpoint_naming=True, total_limit=args.keep)
    )
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    ids = torch.randint(0, 128, (64, 16), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(
        [{"input_ids": r, "labels": r} for r in ids],
        batch_size=4,
        generator=torch.Generator().manual_seed(2),  # an iterator then draws nothing global
    )
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    loaded = load_state(acc, args.url, missing_ok=True)  # the newest complete, if any
    if loaded:
        acc.print(f"accelerate_train: resumed from {loaded} at step {progress.step}")
    else:
        acc.print("accelerate_train: starting afresh")
    model.train()
    loss = None
    while progress.step < args.steps:
        for batch in acc.skip_first_batches(data, progress.step % len(data)):
            loss = model(**batch).loss
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            progress.step += 1
            if progress.step % args.save_every == 0:
                acc.print(f"accelerate_train: saved {save_state(acc, args.url)}")
            if progress.step >= args.steps:
                break
    if loss is not None:
        acc.print(f"accelerate_train: step {progress.step}, loss {loss.item():.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
