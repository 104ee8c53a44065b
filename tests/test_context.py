"""The runtime context: one object holds cloudckpt's process state; reset returns it to the empty
state (after waiting for saves) and the next call starts afresh; process groups follow the
default process group. One process here (world of one, LocalStore and SeaweedFS); the default
group destroyed and created again in several processes is tests/e2e/test_reinit.py."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import cloudckpt
from cloudckpt.api import async_save as async_save_module
from cloudckpt.errors import StagingMemoryError
from cloudckpt.planning.load import plan_codec as load_plan
from cloudckpt.planning.save import local_plan
from cloudckpt.runtime import loop as runtime
from cloudckpt.runtime.context import GroupCache, current


def _state(step: int = 1) -> dict:
    return {
        "w": torch.randn(64, 64, generator=torch.Generator().manual_seed(step)),
        "b": torch.arange(10.0) + step,
        "step": step,
    }


def _load_equal(url: str, step: int) -> bool:
    expected = _state(step)
    blank = {"w": torch.zeros(64, 64), "b": torch.zeros(10), "step": 0}
    cloudckpt.load(blank, url)
    return all(torch.equal(blank[k], expected[k]) for k in ("w", "b")) and blank["step"] == step


def _cloudckpt_threads() -> list[str]:
    return [
        t.name
        for t in threading.enumerate()
        if t.name == "cloudckpt-loop" or t.name.startswith("cloudckpt-save_")
    ]


def test_reset_empties_every_piece_and_the_next_calls_start_afresh(s3_env, s3_url, tmp_path):
    ctx = current()
    cloudckpt.save(_state(1), f"{s3_url}/a")
    again = cloudckpt.save(_state(1), f"{s3_url}/b")
    assert again.plan_cached  # the cache is in use: reset must empty it
    cloudckpt.async_save(_state(2), str(tmp_path / "c")).result(timeout=120)
    assert _load_equal(f"{s3_url}/a", 1)
    assert ctx.loop.running and ctx.open_stores and len(ctx.save_plans)
    assert ctx.staging is not None and ctx.staging.nbytes > 0
    assert len(load_plan.HEADER_CACHE) > 0 and len(local_plan.HEADER_CACHE) > 0
    allocations, generation = ctx.staging_allocations, ctx.generation

    runtime.reset()

    assert not ctx.loop.running and ctx.open_stores == () and len(ctx.save_plans) == 0
    assert ctx.staging.nbytes == 0
    assert len(load_plan.HEADER_CACHE) == len(local_plan.HEADER_CACHE) == 0
    assert _cloudckpt_threads() == []
    assert ctx.generation == generation + 1
    assert ctx.pending_save() is None
    # afresh: a new loop and store, the plan computed again, new staging buffers
    after = cloudckpt.save(_state(1), f"{s3_url}/d")
    assert not after.plan_cached
    assert _load_equal(f"{s3_url}/d", 1) and _load_equal(str(tmp_path / "c"), 2)
    cloudckpt.async_save(_state(3), str(tmp_path / "e")).result(timeout=120)
    assert ctx.staging_allocations > allocations
    assert _load_equal(str(tmp_path / "e"), 3)
    runtime.reset()
    runtime.reset()  # idempotent


def test_reset_waits_for_the_async_save_in_flight(tmp_path, monkeypatch):
    order: list[str] = []
    release = threading.Event()
    real_finish = async_save_module.finish_save

    def held_finish(prepared):
        release.wait(60)
        result = real_finish(prepared)
        order.append("save done")
        return result

    monkeypatch.setattr(async_save_module, "finish_save", held_finish)
    handle = cloudckpt.async_save(_state(4), str(tmp_path / "ckpt"))

    def do_reset():
        runtime.reset()
        order.append("reset done")

    resetter = threading.Thread(target=do_reset)
    resetter.start()
    resetter.join(0.3)  # a reset that did not wait would be done by now
    release.set()
    resetter.join(120)
    assert order == ["save done", "reset done"]
    assert handle.done() and handle.result().bytes_written > 0
    assert _load_equal(str(tmp_path / "ckpt"), 4)


def test_reset_refuses_cloudckpt_own_threads():
    async def from_the_loop():
        current().reset()

    with pytest.raises(RuntimeError, match="own threads"):
        runtime.run_coroutine(from_the_loop())
    with pytest.raises(RuntimeError, match="own threads"):
        current().save_executor().submit(current().reset).result(60)
    runtime.reset()  # from the caller's thread it works


def test_a_manager_outlives_a_reset(s3_env, s3_url):
    mgr = cloudckpt.CheckpointManager(s3_url)
    mgr.save(1, _state(1))
    runtime.reset()  # closes the store the manager used
    mgr.save(2, _state(2))
    assert [c.step for c in mgr.list()] == [1, 2]
    blank = {"w": torch.zeros(64, 64), "b": torch.zeros(10), "step": 0}
    assert mgr.load(blank) == 2 and blank["step"] == 2


def test_staging_limit_follows_each_save_options(tmp_path):
    ctx = current()
    pool = ctx.staging_pool(100)
    assert ctx.staging_pool(100) is pool and pool.limit_bytes == 100
    assert ctx.staging_pool(None) is pool and pool.limit_bytes is None
    small = cloudckpt.SaveOptions(max_async_staging_bytes=1000)
    with pytest.raises(StagingMemoryError):
        cloudckpt.async_save(_state(5), str(tmp_path / "small"), options=small)
    cloudckpt.async_save(_state(5), str(tmp_path / "big")).result(timeout=120)  # no limit
    assert _load_equal(str(tmp_path / "big"), 5)
    assert ctx.staging.limit_bytes is None


class _World:
    """Stands for torch's default ProcessGroup object (identity is all GroupCache uses)."""


def test_group_cache_keeps_groups_for_one_world_and_drops_them_when_it_changes():
    cache, made = GroupCache(), []

    def make(name):
        def create():
            made.append(name)
            return object()

        return create

    first = _World()
    a = cache.get(first, "a", make("a"))
    assert cache.get(first, "a", make("a2")) is a and made == ["a"]
    b = cache.get(first, "b", make("b"))
    assert cache.snapshot(first) == {"a": a, "b": b}

    second = _World()  # destroy_process_group + init_process_group: a new default group
    assert cache.snapshot(second) == {}
    a2 = cache.get(second, "a", make("a-second"))
    assert a2 is not a and made == ["a", "b", "a-second"]
    assert cache.snapshot(second) == {"a": a2} and cache.snapshot(first) == {}

    del first, second  # the old world is gone: a new object at the same address is still new
    gc.collect()
    third = _World()
    assert cache.get(third, "a", make("a-third")) is not a2 and made[-1] == "a-third"


def test_group_cache_creates_each_group_once_under_concurrency():
    cache, world, made = GroupCache(), _World(), []
    start = threading.Barrier(8)

    def create():
        made.append(1)
        return object()

    got = []

    def worker():
        start.wait()
        got.append(cache.get(world, ("control", (0,), 60.0, "protocol"), create))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(made) == 1 and len({id(g) for g in got}) == 1
