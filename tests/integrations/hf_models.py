"""Tiny Hugging Face models and data for the trainer tests (built from a config: no download)."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

LLAMA = dict(
    hidden_size=32,
    num_hidden_layers=2,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    attention_dropout=0.1,  # random ops: a resume is exact only if the RNG states come back
)
SEQ = 16


def tiny_model(seed: int = 0):
    """A 2-layer Llama with dropout, the same weights for the same seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA, attn_implementation="eager"))
    return model


class TokenData(torch.utils.data.Dataset):
    """``n`` random token rows (fixed by ``seed``), as causal-LM examples."""

    def __init__(self, n: int = 32, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, LLAMA["vocab_size"], (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def losses(log_history: list[dict]) -> dict[int, float]:
    """step -> training loss logged at that step."""
    return {e["step"]: e["loss"] for e in log_history if "loss" in e}


def trainer_args(output_dir, **overrides):
    """Arguments of a short deterministic CPU run: 4 steps of 4 rows, a checkpoint every 2."""
    from transformers import TrainingArguments

    kw = dict(
        output_dir=str(output_dir),
        max_steps=4,
        per_device_train_batch_size=4,
        save_steps=2,
        logging_steps=1,
        learning_rate=1e-2,
        warmup_steps=2,
        seed=7,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def stop_at(step: int):
    """A TrainerCallback that stops training after ``step`` (after its checkpoint is saved)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True

    return StopAt()


def assert_same_optimizer(a: dict, b: dict) -> None:
    """Two ``optimizer.state_dict()``s are equal, tensors bit for bit."""
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for k, entry in a["state"].items():
        assert entry.keys() == b["state"][k].keys()
        for name, value in entry.items():
            assert torch.equal(value, b["state"][k][name]), (k, name)
