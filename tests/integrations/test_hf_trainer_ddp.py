"""CloudckptTrainer under DDP: 2 gloo processes (torchrun, CPU) save every rank's part of each
checkpoint collectively, and a resume from S3 continues as the uninterrupted run did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import cloudckpt

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_ddp_two_processes_resume_from_s3_exactly(s3_server, s3_env, s3_url, tmp_path):
    result = tmp_path / "result.json"
    env = dict(os.environ, **s3_server.env(), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    cmd += ["--master_port", str(29500 + os.getpid() % 1000)]
    cmd += ["tests/integrations/hf_trainer_ddp.py", s3_url, str(result)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(result.read_text())
    assert out["world_size"] == 2
    full, stopped, resumed = out["full"], out["stopped"], out["resumed"]
    assert sorted(stopped) == ["1", "2"]
    assert [resumed[s] for s in ("3", "4")] == [full[s] for s in ("3", "4")]
    assert out["all_ranks"] == [[True, True], [True, True]]
    stored = cloudckpt.load_full(f"{s3_url}/stopped/checkpoint-2")
    assert set(stored["rng"]) == {"rank0", "rank1"}  # each rank's generators
    assert cloudckpt.read_manifest(f"{s3_url}/stopped/checkpoint-2").world_size == 2
