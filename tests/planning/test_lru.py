"""The one LRU of planning (plan header memos, the save plan cache): bound, recency, counters,
thread safety; and that both header codecs and SavePlanCache use it."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt.planning.load import plan_codec as load_plan
from cloudckpt.planning.lru import LRUCache
from cloudckpt.planning.memos import clear_header_caches
from cloudckpt.planning.save import local_plan
from cloudckpt.planning.save.cache import SavePlanCache


def test_holds_at_most_maxsize_and_evicts_the_least_recently_used():
    cache = LRUCache(3)
    for k in "abc":
        cache.put(k, k.upper())
    assert cache.get("a") == "A"  # a is now the most recent: b is the oldest
    cache.put("d", "D")
    assert len(cache) == 3
    assert "b" not in cache
    assert [cache.get(k) for k in "acd"] == ["A", "C", "D"]
    cache.put("c", "C2")  # put refreshes too: a is the oldest now
    cache.put("e", "E")
    assert "a" not in cache and cache.get("c") == "C2"


def test_counts_hits_and_misses_and_snapshot_keeps_recency():
    cache = LRUCache(2)
    assert cache.get("x") is None
    cache.put("x", 1)
    cache.put("y", 2)
    assert cache.get("x") == 1
    assert (cache.hits, cache.misses) == (1, 1)
    assert list(cache.snapshot()) == ["y", "x"]
    assert list(cache.snapshot()) == ["y", "x"]  # a snapshot does not touch recency
    cache.clear()
    assert len(cache) == 0 and (cache.hits, cache.misses) == (1, 1)


@pytest.mark.parametrize("maxsize", [0, -1, 1.5, "2", True])
def test_refuses_a_bad_size(maxsize):
    with pytest.raises(ValueError, match="maxsize"):
        LRUCache(maxsize)


@settings(max_examples=200, deadline=None)
@given(
    maxsize=st.integers(1, 5),
    ops=st.lists(st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 8)), max_size=60),
)
def test_behaves_like_a_reference_lru(maxsize, ops):
    cache, model = LRUCache(maxsize), []  # model: keys, least recent first
    for i, (op, key) in enumerate(ops):
        if op == "put":
            cache.put(key, (key, i))
            if key in model:
                model.remove(key)
            model.append(key)
            del model[:-maxsize]
        else:
            got = cache.get(key)
            if key in model:
                model.remove(key)
                model.append(key)
                assert got is not None and got[0] == key
            else:
                assert got is None
        assert list(cache.snapshot()) == model


def test_shared_between_threads_it_stays_bounded_and_consistent():
    cache, errors = LRUCache(8), []
    start = threading.Barrier(6)

    def hammer(seed: int) -> None:
        start.wait()
        try:
            for i in range(3000):
                key = (seed * 7 + i) % 13
                cache.put(key, key * 10)
                got = cache.get((key + seed) % 13)
                assert got is None or got == ((key + seed) % 13) * 10
                assert len(cache) <= 8
        except BaseException as exc:  # reported below: a thread's assert does not fail the test
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(cache) == 8
    assert cache.hits + cache.misses == 6 * 3000
    assert all(v == k * 10 for k, v in cache.snapshot().items())


def test_the_plan_codecs_and_the_save_plan_cache_use_it():
    assert isinstance(load_plan.HEADER_CACHE, LRUCache)
    assert isinstance(local_plan.HEADER_CACHE, LRUCache)
    assert isinstance(SavePlanCache()._plans, LRUCache)
    load_plan.HEADER_CACHE.put(b"k", ((), None))
    local_plan.HEADER_CACHE.put(b"k", None)
    clear_header_caches()
    assert len(load_plan.HEADER_CACHE) == len(local_plan.HEADER_CACHE) == 0
