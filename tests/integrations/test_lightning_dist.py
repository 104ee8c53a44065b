"""The Lightning integration on 2 gloo processes (DDP; ModelParallelStrategy with FSDP2): a run
saved, stopped and resumed from S3 takes the steps of one never interrupted, on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.lightning_app import STEPS_PER_EPOCH, rank_train  # noqa: E402
from tests.integrations.test_lightning import assert_resumed_like  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "sharded"])
def test_resume_on_two_ranks_equals_uninterrupted(mode, world2, s3_env, s3_url, tmp_path):
    import cloudckpt
    from cloudckpt.integrations.lightning import library

    root = str(tmp_path)
    whole = world2.run(rank_train, f"{s3_url}/whole", root, mode, 3, None)
    first = world2.run(rank_train, f"{s3_url}/cut", root, mode, 1, None)
    for rank in range(2):
        assert first[rank].losses == whole[rank].losses[:STEPS_PER_EPOCH]
    resumed = world2.run(rank_train, f"{s3_url}/cut", root, mode, 3, "last")
    for rank in range(2):
        assert_resumed_like(resumed[rank], whole[rank], STEPS_PER_EPOCH)
    manifest = cloudckpt.read_manifest(f"{s3_url}/cut/last.ckpt")
    assert manifest.metadata["step"] == 3 * STEPS_PER_EPOCH
    assert manifest.metadata.get("sharded", False) is (mode == "sharded")
    names = sorted(c.name for c in library.list_committed(f"{s3_url}/cut", None))
    assert names == ["epoch=2-step=12.ckpt", "last.ckpt"]


@pytest.mark.slow
def test_the_example_stops_resumes_and_loads_as_it_says(s3_server, s3_url):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), PYTHONPATH=str(repo), OMP_NUM_THREADS="1")
    res = subprocess.run(
        [sys.executable, "examples/lightning_train.py", "--url", s3_url, "--demo", "--epochs", "2"],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "resumed run's losses equal the uninterrupted run's: True" in res.stdout
    assert "load_from_checkpoint gives the trained weights: True" in res.stdout
