"""``SaveOptions(if_exists="replace")`` against the session's SeaweedFS: the manifest swap is the
commit, the replaced checkpoint's objects are collected after it, a crash before or after the
swap leaves one loadable checkpoint, a reader of the old one succeeds up to the swap, and the
manager replaces a step the same way."""

from __future__ import annotations

import pytest
import torch

import cloudckpt
import cloudckpt.api.commit as commit_mod
from cloudckpt import CheckpointManager, SaveOptions
from cloudckpt.errors import CheckpointError, CheckpointExists
from cloudckpt.layout import data_key_attempt

REPLACE = SaveOptions(if_exists="replace")


class Killed(BaseException):
    """The process dies here (the save's phase reports it as a ``CheckpointError``)."""


def _state(v: float) -> dict:
    return {"w": torch.full((256,), v), "b": torch.arange(16) * int(v), "v": v}


def _attempts(s3_server, url: str) -> set[str]:
    bucket, _, root = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + "/"):
        keys += [o["Key"][len(root) + 1 :] for o in page.get("Contents", [])]
    assert all(k == "manifest.msgpack" or data_key_attempt(k) for k in keys), keys
    return {data_key_attempt(k) for k in keys} - {None}


def _loads(url: str, v: float) -> None:
    full = cloudckpt.load_full(url)
    assert full["v"] == v and torch.equal(full["w"], _state(v)["w"]), full["v"]
    assert torch.equal(full["b"], _state(v)["b"])


def test_replace_swaps_then_collects_the_old_objects(s3_env, s3_url):
    url = f"{s3_url}/last"
    first = cloudckpt.save(_state(1), url)
    with pytest.raises(CheckpointExists):
        cloudckpt.save(_state(2), url)
    _loads(url, 1)
    second = cloudckpt.save(_state(2), url, options=REPLACE)
    assert second.attempt != first.attempt
    _loads(url, 2)
    assert _attempts(s3_env, url) == {second.attempt}
    with pytest.raises(ValueError, match="if_exists"):
        SaveOptions(if_exists="overwrite")  # type: ignore[arg-type]
    fresh = f"{s3_url}/fresh"  # nothing there yet: a plain save
    assert cloudckpt.save(_state(3), fresh, options=REPLACE).attempt in _attempts(s3_env, fresh)


def test_a_crash_before_or_after_the_swap_leaves_one_loadable_checkpoint(
    s3_env, s3_url, monkeypatch
):
    url = f"{s3_url}/last"
    first = cloudckpt.save(_state(1), url)
    seen = {}

    def read_then_die(store):  # every object of the new save is uploaded: the old still loads
        seen["old"] = cloudckpt.load_full(url)["v"]
        raise Killed

    monkeypatch.setattr(commit_mod, "replaced_attempts", read_then_die)
    with pytest.raises(CheckpointError, match="manifest"):
        cloudckpt.save(_state(2), url, options=REPLACE)
    assert seen["old"] == 1
    _loads(url, 1)
    orphans = _attempts(s3_env, url) - {first.attempt}
    assert len(orphans) == 1  # the killed save's objects, no manifest names them
    monkeypatch.undo()

    def swapped_then_die(url_, store, old, manifest):
        raise Killed

    monkeypatch.setattr(commit_mod, "collect_replaced", swapped_then_die)
    with pytest.raises(CheckpointError, match="manifest"):
        cloudckpt.save(_state(3), url, options=REPLACE)
    _loads(url, 3)  # after the swap: the new one, whole
    monkeypatch.undo()
    left = _attempts(s3_env, url)
    assert first.attempt in left and orphans <= left and len(left) == 3

    monkeypatch.setattr(commit_mod, "STALE_AFTER", 0.0)  # the leftovers are old by now
    fourth = cloudckpt.save(_state(4), url, options=REPLACE)
    _loads(url, 4)
    assert _attempts(s3_env, url) == {fourth.attempt}


def test_the_manager_replaces_a_step(s3_env, s3_url):
    mgr = CheckpointManager(s3_url, save_options=REPLACE, keep_last=2)
    for v in (1, 2):
        mgr.save(5, _state(v))
    mgr.save(6, _state(6))
    assert [(i.step, i.complete) for i in mgr.list()] == [(5, True), (6, True)]
    _loads(mgr.step_url(5), 2)
    assert len(_attempts(s3_env, mgr.step_url(5))) == 1
    plain = CheckpointManager(s3_url)
    with pytest.raises(CheckpointExists):
        plain.save(6, _state(7))
