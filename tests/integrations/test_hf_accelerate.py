"""Accelerate's save_state / load_state through cloudckpt on the local SeaweedFS (a tiny Llama
with dropout, CPU): a run stopped after its step-2 checkpoint and resumed from S3 gives the
losses of an uninterrupted run; total_limit prunes; wrong checkpoints fail in one line."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
from cloudckpt.errors import CheckpointNotFound, ManifestError
from cloudckpt.integrations.run_folder import complete_checkpoints
from tests.integrations.hf_models import TokenData, assert_same_optimizer, tiny_model

pytest.importorskip("accelerate")


class Progress:
    """The loop's own position, registered for checkpointing."""

    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def run(url, *, steps=4, save_every=2, stop_after=None, resume=False, seed=0, total_limit=2):
    """A plain Accelerate loop; returns (losses by step, accelerator, model, optimizer, sched)."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from cloudckpt.integrations.hf_accelerate import load_state, save_state

    torch.manual_seed(123)
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            automatic_checkpoint_naming=True, total_limit=total_limit
        ),
    )
    model = tiny_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    # its own generator: creating an iterator then draws no number from torch's global one (the
    # resumed loop creates its iterator after load_state restored that one)
    data = torch.utils.data.DataLoader(
        TokenData(), batch_size=4, generator=torch.Generator().manual_seed(0)
    )
    model, opt, data, sched = acc.prepare(model, opt, data, sched)
    progress = Progress()
    acc.register_for_checkpointing(progress)
    if resume:
        load_state(acc, url)
    out = {}
    batches = acc.skip_first_batches(data, progress.step)
    model.train()
    for batch in batches:
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        progress.step += 1
        out[progress.step] = loss.item()
        if progress.step % save_every == 0:
            save_state(acc, url)
        if progress.step in (steps, stop_after):
            break
    return out, acc, model, opt, sched


def test_a_resume_from_s3_continues_as_the_uninterrupted_run(s3_env, s3_url):
    full, _, full_model, full_opt, full_sched = run(f"{s3_url}/full", total_limit=1)
    first, *_ = run(f"{s3_url}/stopped", stop_after=2)
    again, acc, model, opt, sched = run(f"{s3_url}/stopped", resume=True, seed=5)
    assert list(first) == [1, 2] and list(again) == [3, 4]
    assert again == {s: full[s] for s in (3, 4)}  # dropout: the RNG states came back
    assert_same_optimizer(full_opt.state_dict(), opt.state_dict())
    assert full_sched.state_dict() == sched.state_dict()
    for k, v in full_model.state_dict().items():
        assert torch.equal(v, model.state_dict()[k]), k
    # total_limit=1 left the newest only; the resumed run went on naming checkpoint_1
    assert [c.name for c in complete_checkpoints(f"{s3_url}/full", "checkpoint_")] == [
        "checkpoint_1"
    ]
    names = [c.name for c in complete_checkpoints(f"{s3_url}/stopped", "checkpoint_")]
    assert names == ["checkpoint_0", "checkpoint_1"]
    stored = cloudckpt.load_full(f"{s3_url}/stopped/checkpoint_1")
    assert stored["custom"] == [{"step": 4}]
    assert set(stored["rng"]) == {"rank0"}


def test_load_state_errors_are_one_liners(s3_env, s3_url):
    from accelerate import Accelerator

    from cloudckpt.integrations.hf_accelerate import load_state

    acc = Accelerator(cpu=True)
    with pytest.raises(CheckpointNotFound) as err:
        load_state(acc, f"{s3_url}/nothing-here")
    assert "\n" not in str(err.value)
    model = acc.prepare(tiny_model())
    cloudckpt.save({"models": [], "optimizers": []}, f"{s3_url}/other")
    with pytest.raises(ManifestError, match="holds 0 models where the accelerator has 1"):
        load_state(acc, f"{s3_url}/other")
    assert cloudckpt.read_manifest(f"{s3_url}/other")  # nothing deleted
    del model
