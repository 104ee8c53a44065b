"""The tier in one process (a world of one), the run in a local directory: the fallbacks."""

from __future__ import annotations

import logging
import os

import msgpack
import pytest
import torch

from cloudckpt import CheckpointManager, LocalTier
from cloudckpt.runs.tier.node import MARKER


def _state(seed: int) -> dict:
    return {"w": torch.full((64, 64), float(seed)), "meta": {"seed": seed}}


def test_one_process_saves_prunes_lists_and_loads(tmp_path):
    tier = LocalTier(path=str(tmp_path / "tier"), store_every=2, keep=1, background=True)
    mgr = CheckpointManager(str(tmp_path / "run"), local=tier)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    mgr.close()  # waits for the background copy of step 2
    listed = {i.step: (i.complete, i.tiers) for i in mgr.list()}
    assert sorted(listed) == [2, 3], listed  # keep=1: step 1 pruned from the tier, never stored
    assert listed[3] == (True, ("local", "peers")), listed  # not a store step
    # step 2 is in the store; pruned from the tier unless its copy was still running then
    assert listed[2][0] and listed[2][1][-1] == "store", listed
    state = _state(0)
    assert mgr.load(state) == 3 and state["meta"] == {"seed": 3}
    assert torch.equal(state["w"], _state(3)["w"])
    assert mgr.load(state, step=2) == 2 and torch.equal(state["w"], _state(2)["w"])


def test_a_newer_step_saved_without_the_tier_wins(tmp_path):
    """The tiers' newest step is chosen before the store's listing is in; a newer step complete
    in the store only makes the load choose again and read that one."""
    tier = LocalTier(path=str(tmp_path / "tier"), store_every=100)
    mgr = CheckpointManager(str(tmp_path / "run"), local=tier)
    mgr.save(3, _state(3))  # in the tier only
    CheckpointManager(str(tmp_path / "run")).save(5, _state(5))  # the store only
    state = _state(0)
    assert mgr.load(state) == 5 and torch.equal(state["w"], _state(5)["w"])
    assert mgr.load(state, step=3) == 3 and torch.equal(state["w"], _state(3)["w"])
    CheckpointManager(str(tmp_path / "run")).save(2, _state(2))  # older than the tier's
    assert mgr.load(state) == 5 and state["meta"] == {"seed": 5}


def test_a_foreign_tier_is_ignored_with_a_warning(tmp_path, caplog):
    path = tmp_path / "tier"
    path.mkdir()
    (path / MARKER).write_bytes(msgpack.packb({"format": 1, "job": "someone else"}))
    mgr = CheckpointManager(str(tmp_path / "run"), local=LocalTier(path=str(path)))
    with caplog.at_level(logging.WARNING):
        mgr.save(1, _state(1))
    assert "another job" in caplog.text
    assert os.listdir(path) == [MARKER]  # untouched
    assert [(i.step, i.tiers) for i in mgr.list()] == [(1, ("store",))]


def test_a_full_tier_falls_back_to_the_store_loudly(tmp_path, caplog):
    tier = LocalTier(path=str(tmp_path / "tier"), max_bytes=1)
    mgr = CheckpointManager(str(tmp_path / "run"), local=tier)
    with caplog.at_level(logging.WARNING):
        mgr.save(1, _state(1))
    assert "full" in caplog.text
    assert [(i.step, i.tiers) for i in mgr.list()] == [(1, ("store",))]
    state = _state(0)
    assert mgr.load(state) == 1 and torch.equal(state["w"], _state(1)["w"])


def test_bad_options_are_refused():
    for bad in ({"keep": 0}, {"every": 0}, {"replicas": -1}, {"path": ""}, {"max_bytes": -1}):
        with pytest.raises(ValueError):
            LocalTier(**{"path": "/x", **bad})
    with pytest.raises(ValueError, match="incremental"):
        CheckpointManager("/tmp/x", local=LocalTier(path="/x"), incremental=True)
