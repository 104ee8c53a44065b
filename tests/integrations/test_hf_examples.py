"""examples/hf_trainer_train.py and examples/accelerate_train.py against the local server: a
first run saves, a second run with more steps resumes from the newest complete checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloudckpt.integrations.run_folder import complete_checkpoints

REPO = Path(__file__).resolve().parents[2]


def _run(s3_server, script: str, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, f"examples/{script}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_the_trainer_example_saves_and_resumes(s3_server, s3_env, s3_url):
    first = _run(s3_server, "hf_trainer_train.py", "--url", s3_url, "--steps", "4")
    assert "starting afresh" in first and "step 4," in first
    second = _run(s3_server, "hf_trainer_train.py", "--url", s3_url, "--steps", "6")
    assert f"resuming from {s3_url}/checkpoint-4" in second and "step 6," in second
    names = [c.name for c in complete_checkpoints(s3_url, "checkpoint-")]
    assert names == ["checkpoint-4", "checkpoint-6"]  # --keep 2


@pytest.mark.slow
def test_the_accelerate_example_saves_and_resumes(s3_server, s3_env, s3_url):
    first = _run(s3_server, "accelerate_train.py", "--url", s3_url, "--steps", "4")
    assert "starting afresh" in first and "step 4," in first
    second = _run(s3_server, "accelerate_train.py", "--url", s3_url, "--steps", "6")
    assert f"resumed from {s3_url}/checkpoint_1 at step 4" in second and "step 6," in second
    names = [c.name for c in complete_checkpoints(s3_url, "checkpoint_")]
    assert names == ["checkpoint_1", "checkpoint_2"]  # --keep 2
