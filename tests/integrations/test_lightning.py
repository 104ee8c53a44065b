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


@pytest.mark.parametrize("mode", ["sync", "async", "lightning-async"])
def test_a_run_resumed_from_s3_equals_an_uninterrupted_one(
    mode, s3_env, s3_url, tmp_path, uninterrupted
):
    import cloudckpt
    from cloudckpt.integrations.lightning import library

    first = train(s3_url, epochs=1, mode=mode, root=str(tmp_path), save_top_k=1)
    assert first.losses == uninterrupted.losses[:STEPS_PER_EPOCH]
    names = [c.name for c in library.list_committed(s3_url)]
    assert sorted(names) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    manifest = cloudckpt.read_manifest(f"{s3_url}/last.ckpt")
    assert manifest.metadata["step"] == STEPS_PER_EPOCH

    # "last" (the newest committed last*.ckpt under dirpath), or a checkpoint's own URL
    resume = "last" if mode != "async" else f"{s3_url}/epoch=0-step=4.ckpt"
    resumed = train(s3_url, epochs=3, resume=resume, mode=mode, root=str(tmp_path), save_top_k=1)
    assert_resumed_like(resumed, uninterrupted, STEPS_PER_EPOCH)
    # save_top_k=1: each older checkpoint went through cloudckpt.delete, except the one resumed
    # from; last was replaced, or (resumed from a checkpoint that had no last yet) last-v1 made,
    # as Lightning does in a local folder
    names = sorted(c.name for c in library.list_committed(s3_url))
    if resume == "last":
        assert names == ["epoch=2-step=12.ckpt", "last.ckpt"]
        assert cloudckpt.read_manifest(f"{s3_url}/last.ckpt").metadata["step"] == 12
    else:
        assert names == ["epoch=0-step=4.ckpt", "epoch=2-step=12.ckpt", "last-v1.ckpt", "last.ckpt"]
        assert cloudckpt.read_manifest(f"{s3_url}/last-v1.ckpt").metadata["step"] == 12


# -- the plugin's surfaces, without a training run -------------------------------------------


def _module_checkpoint(model) -> dict:
    import lightning as L

    return {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": L.__version__,
        "state_dict": model.state_dict(),
        "hyper_parameters": dict(model.hparams),
    }


def test_load_from_checkpoint_reads_a_cloudckpt_url(s3_env, s3_url):
    from cloudckpt.integrations.lightning import CloudCheckpointIO, load_from_checkpoint
    from tests.integrations.lightning_app import Tiny

    torch.manual_seed(1)
    model = Tiny(lr=0.01, width=4)
    CloudCheckpointIO().save_checkpoint(_module_checkpoint(model), f"{s3_url}/m.ckpt")
    loaded = Tiny.load_from_checkpoint(f"{s3_url}/m.ckpt", lr=0.5)  # the CloudLoadable mixin
    assert loaded.hparams.lr == 0.5 and loaded.hparams.width == 4
    assert_same_state(loaded.state_dict(), model.state_dict())
    again = load_from_checkpoint(Tiny, f"{s3_url}/m.ckpt", map_location="cpu")
    assert again.hparams.lr == 0.01
    assert_same_state(again.state_dict(), model.state_dict())


def test_a_value_msgpack_cannot_hold_is_refused_with_its_key_and_the_ways_out(s3_env, s3_url):
    import argparse

    from cloudckpt.errors import UnsupportedValueError
    from cloudckpt.integrations.lightning import CloudCheckpointIO, library
    from tests.integrations.lightning_app import Tiny

    checkpoint = _module_checkpoint(Tiny(width=2))
    checkpoint["hyper_parameters"]["args"] = argparse.Namespace(depth=3)
    with pytest.raises(UnsupportedValueError) as caught:
        CloudCheckpointIO().save_checkpoint(checkpoint, f"{s3_url}/ns.ckpt")
    message = str(caught.value)
    assert "hyper_parameters.args" in message and "\n" not in message
    assert "CloudCheckpointIO(allow_pickle=True)" in message
    assert "save_hyperparameters(ignore=" in message
    assert not library.exists(f"{s3_url}/ns.ckpt")

    io = CloudCheckpointIO(allow_pickle=True)
    io.save_checkpoint(checkpoint, f"{s3_url}/ns.ckpt")
    back = io.load_checkpoint(f"{s3_url}/ns.ckpt")
    assert back["hyper_parameters"]["args"] == argparse.Namespace(depth=3)
    with pytest.raises(Exception, match="allow_pickle"):
        CloudCheckpointIO().load_checkpoint(f"{s3_url}/ns.ckpt")  # the reader must allow it too


def test_a_missing_or_damaged_checkpoint_is_a_one_line_error_and_nothing_is_removed(s3_env, s3_url):
    from cloudckpt.errors import CheckpointNotFound, CloudCkptError
    from cloudckpt.integrations.lightning import CloudCheckpointIO, library
    from cloudckpt.layout import MANIFEST_KEY
    from cloudckpt.runtime.loop import run_coroutine, shared_store
    from tests.integrations.lightning_app import Tiny

    io = CloudCheckpointIO()
    with pytest.raises(CheckpointNotFound) as caught:
        io.load_checkpoint(f"{s3_url}/nope.ckpt")
    assert s3_url in str(caught.value) and "\n" not in str(caught.value)

    io.save_checkpoint(_module_checkpoint(Tiny(width=2)), f"{s3_url}/good.ckpt")
    store = shared_store(s3_url)
    for body in (b"", b"\x00" * 64, b"\x81\xa1a\xc1", b"\xdd\xff\xff\xff\xff"):
        run_coroutine(store.put(f"bad.ckpt/{MANIFEST_KEY}", body))
        with pytest.raises(CloudCkptError) as caught:
            io.load_checkpoint(f"{s3_url}/bad.ckpt")
        assert "\n" not in str(caught.value)
    assert library.exists(f"{s3_url}/good.ckpt")


def test_a_removal_waits_for_the_save_in_flight_and_is_dropped_if_it_fails(s3_env, s3_url):
    from concurrent.futures import Future

    from cloudckpt.api.async_save import SaveHandle
    from cloudckpt.errors import CheckpointError
    from cloudckpt.integrations.lightning import CloudCheckpointIO, library
    from tests.integrations.lightning_app import Tiny

    io = CloudCheckpointIO(async_save=True)
    io.save_checkpoint(_module_checkpoint(Tiny(width=2)), f"{s3_url}/old.ckpt")
    io.wait()
    failing: Future = Future()
    io._pending = SaveHandle(failing, f"{s3_url}/new.ckpt", 0.0, 0)
    io.remove_checkpoint(f"{s3_url}/old.ckpt")  # Lightning removes right after a save call
    assert library.exists(f"{s3_url}/old.ckpt")
    failing.set_exception(CheckpointError("the upload failed"))
    with pytest.raises(CheckpointError, match="the upload failed"):
        io.teardown()
    assert library.exists(f"{s3_url}/old.ckpt")  # the newest complete checkpoint stays

    io.remove_checkpoint(f"{s3_url}/old.ckpt")  # nothing in flight: at once
    assert not library.exists(f"{s3_url}/old.ckpt")
    io.remove_checkpoint(f"{s3_url}/old.ckpt")  # already gone: no error, as Lightning's own


def test_last_is_the_newest_committed_and_half_written_ones_are_not_seen(s3_env, s3_url):
    import lightning as L

    from cloudckpt.errors import ConfigError
    from cloudckpt.integrations.lightning import CloudCheckpointIO, CloudModelCheckpoint
    from cloudckpt.runtime.loop import run_coroutine, shared_store
    from tests.integrations.lightning_app import Tiny

    io = CloudCheckpointIO()
    io.save_checkpoint(_module_checkpoint(Tiny(width=2)), f"{s3_url}/last.ckpt")
    io.save_checkpoint(_module_checkpoint(Tiny(width=2)), f"{s3_url}/epoch=0-step=4.ckpt")
    run_coroutine(shared_store(s3_url).put("last-v1.ckpt/data/0/half", b"x" * 10))
    callback = CloudModelCheckpoint(dirpath=f"{s3_url}/", save_last=True)
    assert callback.dirpath == s3_url
    trainer = L.Trainer(plugins=[io], logger=False, enable_progress_bar=False)
    found = callback._find_last_checkpoints(trainer)
    assert found == {f"cloudckpt+{s3_url}/last.ckpt"}
    assert callback.file_exists(f"{s3_url}/epoch=0-step=4.ckpt", trainer)
    assert not callback.file_exists(f"{s3_url}/last-v1.ckpt", trainer)

    plain = L.Trainer(logger=False, enable_progress_bar=False)  # saves with torch.save
    with pytest.raises(ConfigError, match=r"plugins=\[CloudCheckpointIO\(\)\]"):
        callback._find_last_checkpoints(plain)


def test_an_s3_error_reaches_the_user_as_cloudckpts_one_line_error(s3_env, s3_url):
    import cloudckpt
    from cloudckpt.errors import CloudCkptError
    from cloudckpt.integrations.lightning import CloudCheckpointIO
    from tests.integrations.lightning_app import Tiny

    wrong = cloudckpt.StorageOptions(
        endpoint_url=s3_env.endpoint_url,
        access_key_id=s3_env.env()["AWS_ACCESS_KEY_ID"],
        secret_access_key="not-the-secret",
        addressing_style="path",
    )
    io = CloudCheckpointIO(storage=wrong)
    with pytest.raises(CloudCkptError) as caught:
        io.save_checkpoint(_module_checkpoint(Tiny(width=2)), f"{s3_url}/denied.ckpt")
    assert "\n" not in str(caught.value)
    with pytest.raises(CloudCkptError) as caught:
        io.load_checkpoint(f"{s3_url}/denied.ckpt")
    assert "\n" not in str(caught.value)
