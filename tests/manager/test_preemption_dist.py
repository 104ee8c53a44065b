"""SIGTERM on one rank of two: both ranks save the same step and exit; a world of one resumes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch

from cloudckpt import CheckpointManager


def train_until_preempted(url: str, progress_dir: str) -> dict | None:
    """Runs on every rank: resume, train (w += 1 per step), stop when any rank gets SIGTERM."""
    import torch.distributed as dist

    from cloudckpt.preemption import Preempted, PreemptionHandler

    rank = dist.get_rank()
    mgr = CheckpointManager(url, keep_last=2)
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    with PreemptionHandler(mgr, check_every=1) as handler:
        start = handler.resume(sd) or 0
        try:
            for step in range(start + 1, 100_000):
                sd["w"] += 1
                sd["progress"]["step"] = step
                Path(progress_dir, f"rank{rank}").write_text(str(step))
                time.sleep(0.01)
                handler.checkpoint_if_preempted(step, sd)
        except Preempted as exc:
            return {"step": exc.step, "code": exc.code, "signum": exc.signum,
                    "w": float(sd["w"][0]), "resumed_from": start}
    return None


def resume_everywhere(url: str) -> tuple[int | None, float]:
    mgr = CheckpointManager(url)
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    step = mgr.load(sd)
    return step, float(sd["w"][0])


def test_sigterm_on_one_rank_saves_same_step_and_resumes(world2, s3_env, s3_url, tmp_path):
    outcome: dict = {}

    def run():
        try:
            outcome["results"] = world2.run(train_until_preempted, s3_url, str(tmp_path),
                                            timeout=180)
        except BaseException as exc:  # surfaced by the asserts below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    marker = tmp_path / "rank1"
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text() and int(marker.read_text()) >= 5):
        assert thread.is_alive(), outcome
        assert time.monotonic() < deadline, "rank 1 made no progress"
        time.sleep(0.02)
    os.kill(world2.pids[1], signal.SIGTERM)
    thread.join(180)
    assert "error" not in outcome, outcome.get("error")
    r0, r1 = outcome["results"]
    assert r0["step"] == r1["step"] >= 5
    assert r0["code"] == r1["code"] == 143
    assert r1["signum"] == signal.SIGTERM and r0["signum"] is None
    assert r0["w"] == r1["w"] == r0["step"]

    # both ranks agree on the latest step when resuming together
    assert world2.run(resume_everywhere, s3_url) == [(r0["step"], float(r0["step"]))] * 2

    # restart with world size 1 (this process)
    mgr = CheckpointManager(s3_url)
    assert [i.step for i in mgr.list()] == [r0["step"]]
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    assert mgr.load(sd) == r0["step"]
    assert torch.equal(sd["w"], torch.full((16,), float(r0["step"])))
    assert sd["progress"] == {"step": r0["step"]}
