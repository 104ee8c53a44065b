"""Fine-tune a tiny Llama with ``transformers.Trainer``, its checkpoints on S3 through cloudckpt.

    python examples/hf_trainer_train.py --url s3://bucket/runs/hf --steps 6
    torchrun --nproc-per-node 2 examples/hf_trainer_train.py --url s3://bucket/runs/hf

Every ``--save-steps`` steps the Trainer's checkpoint (model, optimizer, scheduler, RNG states,
trainer state) goes to ``<url>/checkpoint-<step>`` straight from memory; ``--keep`` is
``save_total_limit`` (older complete checkpoints are deleted through cloudckpt). On start the
run resumes from the newest complete checkpoint under ``--url`` when there is one, so running it
again with more ``--steps`` continues the run. The model is built from a config (no download),
the data is random tokens fixed by a seed. Endpoint and credentials come from the standard AWS
variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...) or the usual AWS chain.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, seq: int, vocab: int):
        self.ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--url", required=True, help="the run folder, s3://bucket/prefix")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--keep", type=int, default=2, help="save_total_limit")
    args = p.parse_args(argv)

    from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

    from cloudckpt.integrations.hf_trainer import CloudckptTrainer

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    with tempfile.TemporaryDirectory() as logs:  # the Trainer's output_dir: logs only
        trainer = CloudckptTrainer(
            checkpoint_url=args.url,
            model=LlamaForCausalLM(config),
            args=TrainingArguments(
                output_dir=logs,
                max_steps=args.steps,
                save_steps=args.save_steps,
                save_total_limit=args.keep,
                per_device_train_batch_size=4,
                logging_steps=1,
                learning_rate=1e-2,
                report_to=[],
                use_cpu=not torch.cuda.is_available(),
                disable_tqdm=True,
            ),
            train_dataset=Tokens(64, 16, config.vocab_size),
        )
        resume = trainer.latest_checkpoint()
        if trainer.is_world_process_zero():
            print(f"hf_trainer_train: resuming from {resume}" if resume else "starting afresh")
        out = trainer.train(resume_from_checkpoint=resume)
        if trainer.is_world_process_zero():
            print(f"hf_trainer_train: step {out.global_step}, loss {out.training_loss:.4f}")
            print(f"hf_trainer_train: newest checkpoint {trainer.latest_checkpoint()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
