"""The Lightning integration on 2 gloo processes (DDP; ModelParallelStrategy with FSDP2): a run
saved, stopped and resumed from S3 takes the steps of one never interrupted, on every rank."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

from tests.integrations.lightning_app import STEPS_PER_EPOCH, rank_train  # noqa: E402
from tests.integrations.test_lightning import assert_resumed_like  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sharded"])
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
