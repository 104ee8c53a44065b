"""Pins end (issue 28): a lease is capped at a day, a pin whose save can never commit protects
nothing, and a listing with details shows the retained and pinned folders with what holds them.

On real runs (SeaweedFS and LocalStore): step 1 is deleted while a pin in its folder holds it.
A pin declaring a lease of 10^18 s keeps the folder for at most a day (prune a day and a minute
later reclaims everything); a pin of an attempt other than the one that committed its folder
(an impossible pin) keeps nothing, so the deletion collects the folder at once. In between,
``list(details=True)`` and ``cloudckpt ls --details`` list the retained folder and each pin's
holder, and plain ``list()`` / ``ls`` do not list it.
"""

from __future__ import annotations

import json
import time

import pytest
import torch

from cloudckpt import CheckpointManager, RetentionPolicy, SaveOptions
from cloudckpt.layout import (
    MAX_PIN_LEASE,
    MIN_PIN_LEASE,
    Pin,
    decode_pin,
    encode_pin,
    pin_key,
    step_dir,
)
from cloudckpt.runs.pruning import prune_run
from cloudckpt.runtime.loop import run_coroutine, shared_store
from tests.reliability.stores import cli

OPTIONS = SaveOptions(object_size=16 << 10, content_hashes=True)
ATTEMPT = "00000000000000aa"


@pytest.fixture(params=["s3", "local"])
def run(request, s3_url, storage, tmp_path):
    if request.param == "s3":
        return s3_url, storage
    return str(tmp_path / "run"), None


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(32, 64, generator=g) for i in range(3)}


def _keys(store, prefix: str = "") -> set[str]:
    async def go():
        return {i.key async for i in store.list(prefix)}

    return run_coroutine(go())


def _pin(store, home: int, folder: str, lease: float, attempt: str = ATTEMPT) -> str:
    key = step_dir(home) + pin_key(attempt, folder)
    run_coroutine(store.put(key, encode_pin(Pin(folder, attempt, lease))))
    return key


def test_leases_are_bounded_when_written_and_when_read():
    for lease in (1e18, float("inf"), 86400.5, 59.0, float("nan")):
        with pytest.raises(ValueError, match="pin_lease must be from 60 to 86400"):
            SaveOptions(pin_lease=lease)
    assert SaveOptions(pin_lease=MAX_PIN_LEASE).pin_lease == MAX_PIN_LEASE
    key = pin_key(ATTEMPT, "step-000000000002")
    for declared, read in ((1e18, MAX_PIN_LEASE), (1.0, MIN_PIN_LEASE), (600.0, 600.0)):
        assert (
            decode_pin(encode_pin(Pin("step-000000000002", ATTEMPT, declared)), key).lease == read
        )


def test_a_pin_with_a_huge_lease_holds_a_deleted_checkpoint_a_day_at_most(run, s3_server):
    url, storage = run
    mgr = CheckpointManager(url, storage=storage, save_options=OPTIONS)
    mgr.save(1, _state(1))
    mgr.save(2, _state(2))
    store = shared_store(url, storage)
    _pin(store, 1, "step-000000000009", 1e18)  # a save of step 9 that never commits
    data = _keys(store, step_dir(1) + "data/")
    mgr.delete(1)
    assert _keys(store, step_dir(1) + "data/") == data  # held: nothing of step 1 goes yet
    assert [i.step for i in mgr.list()] == [2]
    listed = {i.step: i for i in mgr.list(details=True)}
    assert sorted(listed) == [1, 2] and listed[1].retained and not listed[1].complete
    (held,) = listed[1].held_by
    assert held.startswith(
        "step-000000000009: save 00000000000000aa not committed, pinned until "
    ), held
    assert not listed[2].retained and listed[2].held_by == ()
    res = cli(s3_server, "ls", url, "--details")
    assert res.returncode == 0 and "RETAINED" in res.stdout, res
    assert "step 1: held by step-000000000009: save 00000000000000aa" in res.stderr
    res = cli(s3_server, "ls", url, "--details", "--json")
    rows = {r["step"]: r for r in json.loads(res.stdout)}
    assert rows[1]["retained"] and rows[1]["held_by"] == [held] and rows[2]["held_by"] == []
    assert "RETAINED" not in cli(s3_server, "ls", url).stdout
    policy = RetentionPolicy()
    run_coroutine(prune_run(store, policy, 0.0, now=time.time() + MAX_PIN_LEASE - 120))
    assert _keys(store, step_dir(1) + "data/") == data  # the capped lease is not over yet
    run_coroutine(prune_run(store, policy, 0.0, now=time.time() + MAX_PIN_LEASE + 61))
    assert not _keys(store, step_dir(1))  # reclaimed: the pin expired, so did the folder
    assert [i.step for i in mgr.list(details=True)] == [2]


def test_an_impossible_pin_holds_nothing(run):
    """A pin of an attempt that did not commit its folder (another one did, in create mode):
    deleting the pinned checkpoint takes everything at once, and a prune reclaims a folder such
    a pin alone retained."""
    url, storage = run
    mgr = CheckpointManager(url, storage=storage, abandoned_after=0, save_options=OPTIONS)
    for step in (1, 2, 3):
        mgr.save(step, _state(step))
    store = shared_store(url, storage)
    _pin(store, 1, step_dir(2)[:-1], 1e18)  # step 2 was committed by another attempt
    mgr.delete(1)
    assert not _keys(store, step_dir(1))
    # retained by an impossible pin alone (its manifest removed behind cloudckpt's back)
    _pin(store, 3, step_dir(2)[:-1], 1e18)
    run_coroutine(store.delete([step_dir(3) + "manifest.msgpack"]))
    assert mgr.list(details=True)[-1].held_by == (
        "step-000000000002: stale pin (protects nothing; prune removes it)",
    )
    removed = [i.step for i in mgr.prune()]
    assert removed == [3] and not _keys(store, step_dir(3))
