"""CheckpointManager on a local directory (LocalStore): the same listing, retention and
deletion contracts without a server."""

from __future__ import annotations

import os

import torch

from cloudckpt import CheckpointManager, RetentionPolicy
from cloudckpt.layout import step_dir


def test_local_run_retention_and_abandoned(tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), retention=RetentionPolicy(keep_last=1, keep_steps={2}))
    for step in (1, 2, 3, 4):
        mgr.save(step, {"w": torch.full((8,), float(step)), "step": step})
    assert [(i.step, i.complete) for i in mgr.list()] == [(2, True), (4, True)]
    leftover = run / step_dir(5) / "data" / "00000000feedf00d"
    leftover.mkdir(parents=True)
    (leftover / "r00000-0000.bin").write_bytes(b"partial")
    assert [(i.step, i.complete) for i in mgr.list()] == [(2, True), (4, True), (5, False)]
    assert mgr.latest().step == 4
    sd = {"w": torch.zeros(8), "step": 0}
    assert mgr.load(sd) == 4 and sd["step"] == 4 and torch.equal(sd["w"], torch.full((8,), 4.0))
    assert mgr.prune() == []  # step 5 is within the grace period
    eager = CheckpointManager(f"file://{run}", keep_last=1, abandoned_after=0)
    assert [(i.step, i.complete) for i in eager.prune()] == [(2, True), (5, False)]
    assert sorted(os.listdir(run)) == [step_dir(4).rstrip("/")]
    assert eager.info(4).world_size == 1
