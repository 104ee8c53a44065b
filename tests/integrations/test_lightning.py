"""The Lightning integration with real Lightning on CPU against the local SeaweedFS: a run saved,
stopped and resumed from S3 takes the same steps (losses, optimizer and scheduler state) as one
that was never interrupted."""

from __future__ import annotations

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402

from tests.integrations.lightning_app import STEPS_PER_EPOCH, Outcome, train  # noqa: E402


def assert_same_state(a: object, b: object, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_resumed_like(resumed: Outcome, whole: Outcome, stopped_at: int) -> None:
    assert resumed.global_step == whole.global_step
    assert resumed.losses == whole.losses[stopped_at:]
    assert_same_state(resumed.optimizer, whole.optimizer, "optimizer")
    assert_same_state(resumed.scheduler, whole.scheduler, "scheduler")
    assert_same_state(resumed.weights, whole.weights, "weights")


@pytest.fixture(scope="module")
def uninterrupted(s3_server, tmp_path_factory) -> Outcome:
    """Three epochs without a stop (its checkpoints in a folder of their own)."""
    from tests.conftest import _test_prefix

    class _Node:
        name = "uninterrupted"

    class _Request:
        node = _Node()

    with pytest.MonkeyPatch.context() as mp:
        for key, value in s3_server.env().items():
            mp.setenv(key, value)
        return train(
            _test_prefix(s3_server, _Request()), epochs=3, root=str(tmp_path_factory.mktemp("w"))
        )


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_from_last_equals_uninterrupted(mode, s3_env, s3_url, tmp_path, uninterrupted):
    import cloudckpt
    from cloudckpt.integrations.lightning import library

    first = train(s3_url, epochs=1, mode=mode, root=str(tmp_path))
    assert first.losses == uninterrupted.losses[:STEPS_PER_EPOCH]
    names = [c.name for c in library.list_committed(s3_url)]
    assert sorted(names) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    manifest = cloudckpt.read_manifest(f"{s3_url}/last.ckpt")
    assert manifest.metadata["step"] == STEPS_PER_EPOCH

    resumed = train(s3_url, epochs=3, resume="last", mode=mode, root=str(tmp_path))
    assert_resumed_like(resumed, uninterrupted, STEPS_PER_EPOCH)
    names = sorted(c.name for c in library.list_committed(s3_url))
    assert names == [f"epoch={e}-step={4 * (e + 1)}.ckpt" for e in range(3)] + ["last.ckpt"]
