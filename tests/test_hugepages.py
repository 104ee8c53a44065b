"""runtime.hugepages: numpy's huge-page advice is off inside the block, restored after the last
overlapping block (threads included), and the save's coordinator plans and commits inside it."""

from __future__ import annotations

import threading

import pytest
import torch

import cloudckpt
import cloudckpt.api.save as save_api
import cloudckpt.api.save_planning as save_planning
from cloudckpt.runtime import hugepages
from cloudckpt.runtime.hugepages import without_huge_page_advice

switch = hugepages._switch()
pytestmark = pytest.mark.skipif(switch is None, reason="this numpy has no huge-page switch")


def advice() -> bool:
    """numpy's current setting, left as it was."""
    assert switch is not None
    now = bool(switch(True))
    switch(now)
    return now


@pytest.fixture(params=[True, False], ids=["advice-on", "advice-off"])
def setting(request):
    assert switch is not None
    before = bool(switch(request.param))
    yield request.param
    switch(before)


def test_off_inside_restored_after(setting):
    with without_huge_page_advice():
        assert advice() is False
        with without_huge_page_advice():
            assert advice() is False
        assert advice() is False
    assert advice() is setting


def test_restored_after_an_error(setting):
    with pytest.raises(KeyError), without_huge_page_advice():
        raise KeyError("x")
    assert advice() is setting


def test_overlapping_threads_restore_after_the_last_one(setting):
    inside, release, seen = threading.Event(), threading.Event(), []

    def other():
        with without_huge_page_advice():
            inside.set()
            release.wait(10)
            seen.append(advice())

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with without_huge_page_advice():
        pass
    assert advice() is False  # the other thread's block still runs
    release.set()
    t.join(10)
    assert seen == [False]
    assert advice() is setting


def test_the_coordinator_plans_and_commits_without_advice(tmp_path, monkeypatch, setting):
    seen: dict[str, bool] = {}

    def spy(name, fn):
        def wrapped(*a, **k):
            seen[name] = advice()
            return fn(*a, **k)

        return wrapped

    monkeypatch.setattr(
        save_planning, "plan_global_save", spy("plan", save_planning.plan_global_save)
    )
    monkeypatch.setattr(save_api, "assemble_manifest", spy("manifest", save_api.assemble_manifest))
    state = {"w": torch.arange(12.0).reshape(3, 4), "step": 3}
    cloudckpt.save(state, str(tmp_path / "ck"), options=cloudckpt.SaveOptions(use_plan_cache=False))
    assert seen == {"plan": False, "manifest": False}
    assert advice() is setting
    out = {"w": torch.zeros(3, 4), "step": 0}
    cloudckpt.load(out, str(tmp_path / "ck"))
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3
