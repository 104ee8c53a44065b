"""The rank-0 guard: a collective save or load made by some ranks only, or with different calls,
fails within seconds on every rank that made it (``CollectiveMismatch``), on real gloo worlds;
honest ranks a few seconds late still save; a failed guarded call leaves later calls in step."""

from __future__ import annotations

import time

import msgpack
import pytest
import torch
import torch.distributed as dist

import cloudckpt
from cloudckpt.errors import CheckpointError, CollectiveMismatch, ProtocolError
from cloudckpt.groups import _call_of, _mismatch_message, _outcome
from cloudckpt.options import LoadOptions, SaveOptions


def _state(rank: int) -> dict:
    return {"w": torch.full((4, 3), float(rank + 1)), "step": 3}


def _outcome_of(fn) -> dict:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # the test asserts the exact types
        return {
            "error": type(exc).__name__,
            "mismatch": isinstance(exc, CollectiveMismatch),
            "bases": (isinstance(exc, RuntimeError), isinstance(exc, CheckpointError)),
            "message": str(exc),
            "seconds": time.monotonic() - start,
        }
    return {"error": None, "seconds": time.monotonic() - start}


def rank_guarded(url: str, plan: dict) -> dict:
    """Each rank does what ``plan[rank]`` says: ``None`` (nothing), ``("save"|"async"|"load"
    |"manager", url suffix, delay)``; joining waits ``plan["wait"]`` seconds."""
    import cloudckpt.api.async_save
    import cloudckpt.api.load  # noqa: F401 - every rank: a first import is no skew to measure

    rank = dist.get_rank()
    what = plan.get(str(rank))
    if what is None:
        return {"error": None, "seconds": 0.0}
    op, suffix, delay = what
    time.sleep(delay)
    target = url + suffix
    save_options = SaveOptions(join_timeout=plan.get("wait", 10.0))
    load_options = LoadOptions(join_timeout=plan.get("wait", 10.0))
    if op == "save":
        return _outcome_of(lambda: cloudckpt.save(_state(rank), target, options=save_options))
    if op == "async":
        return _outcome_of(
            lambda: cloudckpt.async_save(_state(rank), target, options=save_options).result()
        )
    if op == "load":
        return _outcome_of(lambda: cloudckpt.load(_state(0), target, options=load_options))
    manager = cloudckpt.CheckpointManager(target, load_options=load_options)
    return _outcome_of(lambda: manager.load(_state(0)))


def test_a_save_on_rank0_only_fails_fast_then_both_save(world2, s3_url, s3_env):
    r0, r1 = world2.run(rank_guarded, s3_url, {"0": ("save", "/a", 0), "wait": 1.0})
    assert r0["mismatch"] and r0["bases"] == (True, True) and r1["error"] is None
    assert r0["seconds"] < 30  # the default timeout would be 600 s
    message = r0["message"]
    assert "\n" not in message
    assert "saves and loads are collective" in message and "rank 1 " in message
    assert "pass process_group='self' to save from one rank" in message
    assert "/a" in message and "1.0 s" in message
    # nothing was written, and the next save of both ranks (rank 1 a call behind) works
    assert not cloudckpt.exists(s3_url + "/a")
    both = world2.run(rank_guarded, s3_url, {"0": ("save", "/b", 0), "1": ("save", "/b", 0)})
    assert [r["error"] for r in both] == [None, None]
    # rank 1 alone loads: it fails, naming rank 0; then both load
    r0, r1 = world2.run(rank_guarded, s3_url, {"1": ("load", "/b", 0), "wait": 1.0})
    assert r1["mismatch"] and "rank 0 " in r1["message"] and r0["error"] is None
    both = world2.run(rank_guarded, s3_url, {"0": ("load", "/b", 0), "1": ("load", "/b", 0)})
    assert [r["error"] for r in both] == [None, None]


@pytest.mark.slow  # sleeps by design: 1.5 s of skew, a rank 2.5 s late, two 1 s waits
def test_honest_skew_saves_and_a_late_rank_fails_in_bounded_time(world2, s3_url):
    plan = {"0": ("save", "/skew", 0), "1": ("save", "/skew", 1.5), "wait": 8.0}
    assert [r["error"] for r in world2.run(rank_guarded, s3_url, plan)] == [None, None]
    # later than join_timeout: both fail (rank 1 after waiting for a call of its own), bounded
    plan = {"0": ("save", "/late", 0), "1": ("save", "/late", 2.5), "wait": 1.0}
    r0, r1 = world2.run(rank_guarded, s3_url, plan)
    assert r0["mismatch"] and r1["mismatch"]
    assert "rank 1 " in r0["message"] and "rank 0 " in r1["message"]
    assert "came late" in r1["message"] and r1["seconds"] < 20
    plan = {"0": ("save", "/after", 0), "1": ("save", "/after", 0)}
    assert [r["error"] for r in world2.run(rank_guarded, s3_url, plan)] == [None, None]


def test_different_calls_fail_on_every_rank_naming_what_differs(world3, s3_url):
    # the checkpoint the loads would read
    setup = {str(r): ("save", "/ck", 0) for r in range(3)}
    assert [r["error"] for r in world3.run(rank_guarded, s3_url, setup)] == [None] * 3
    plan = {"0": ("save", "/x", 0), "1": ("load", "/ck", 0), "2": ("save", "/x", 0), "wait": 5}
    results = world3.run(rank_guarded, s3_url, plan)
    assert all(r["mismatch"] for r in results)
    assert len({r["message"] for r in results}) == 1
    message = results[0]["message"]
    assert "operation and URL differ" in message
    assert "ranks 0, 2 called save of" in message and "rank 1 called load of" in message
    plan = {"0": ("save", "/y", 0), "1": ("save", "/y", 0), "2": ("save", "/z", 0), "wait": 5}
    results = world3.run(rank_guarded, s3_url, plan)
    assert all(r["mismatch"] for r in results)
    assert "the URL differs" in results[2]["message"]
    plan = {"0": ("async", "/v", 0), "1": ("save", "/v", 0), "2": ("save", "/v", 0), "wait": 5}
    results = world3.run(rank_guarded, s3_url, plan)
    assert all(r["mismatch"] for r in results)
    assert "rank 0 called async_save" in results[1]["message"]
    # two ranks of three, and the manager's load: the ranks that called fail, naming the third
    plan = {"0": ("manager", "", 0), "2": ("manager", "", 0), "wait": 1.5}
    results = world3.run(rank_guarded, s3_url, plan)
    assert results[0]["mismatch"] and results[2]["mismatch"] and results[1]["error"] is None
    assert "rank 1 " in results[0]["message"] and "CheckpointManager.load" in results[0]["message"]
    ok = {str(r): ("save", "/w", 0) for r in range(3)}
    assert [r["error"] for r in world3.run(rank_guarded, s3_url, ok)] == [None] * 3


@pytest.mark.parametrize(
    "state",
    [
        b"",
        b"zz",
        b"a",
        b"a" + msgpack.packb([5]),
        b"a" + msgpack.packb(["0"]),
        b"a" + msgpack.packb({"x": 1}),
        b"m" + msgpack.packb([]),
        b"m" + msgpack.packb([["save", "u"]]),
        b"m" + msgpack.packb([["save", 3, [0]]]),
        b"m\xc1",
        b"a" + b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G entries
    ],
)
def test_a_malformed_decision_in_the_store_is_a_protocol_error(state):
    with pytest.raises(ProtocolError, match="malformed join decision"):
        _outcome(state, 2)


def test_decisions_and_unreadable_entries():
    assert _outcome(b"go", 2) == ("go", [])
    assert _outcome(b"a" + msgpack.packb([1]), 2) == ("abort", [1])
    calls = [["save", "s3://b/x", [0]], ["load", "s3://b/x", [1]]]
    assert _outcome(b"m" + msgpack.packb(calls), 2) == ("mismatch", calls)
    for raw in (b"\xc1", msgpack.packb([1, 2]), msgpack.packb("save"), b""):
        call, url = _call_of(raw)
        assert "unreadable" in call and url == ""
    message = _mismatch_message([[*_call_of(b"\xc1"), [1]], ["save", "s3://b/x", [0]]], (0, 1))
    assert "rank 1 called an unreadable call" in message and "rank 0 called save of" in message
