"""Concurrency: two 2-rank jobs saving the same step at once, and prune running concurrently with
saves and loads.

- Same step, two jobs: exactly one commits; every rank of the other raises ``CheckpointExists``
  (whether it lost at the existence check or at the create-mode manifest put); the committed
  checkpoint is the winner's, refers only to the winner's objects and loads bit-exact on 2
  ranks. In CI both jobs are held at their manifest put until both got there (a rendezvous
  inside the coordinators), so the race is at the commit itself; the long mode adds unsynchronised
  races.
- Prune (``keep_last=2``) looping in the background while a 2-rank job saves and loads steps and
  another thread loads the latest: every save commits, every load of a kept step is exact, a load
  racing a deletion fails with a cloudckpt error or is exact (never wrong data), and at the end
  every checkpoint that is complete verifies.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.testing.ranks.world import ProcessWorld
from tests.reliability.conftest import SAVE_OPTIONS
from tests.reliability.ranks import load_step, save_step
from tests.reliability.states import differences, full_expected

pytestmark = pytest.mark.timeout(600)

STATE = {"big_bytes": 2 << 20, "small_bytes": 96 << 10}


@pytest.fixture(scope="module")
def other_job(s3_server):
    """A second 2-rank job next to the session's world2."""
    world = ProcessWorld(2, env=s3_server.env(), timeout=180.0)
    yield world
    world.close()


def _race(job_a, job_b, run_url, step, storage, barrier_dir) -> dict:
    """Both jobs save ``step`` of ``run_url`` at once (gens 1 and 2); returns outcomes by gen."""
    url = CheckpointManager(run_url, storage=storage).step_url(step)
    outcomes: dict = {}
    errors: dict = {}

    def go(world, gen):
        try:
            outcomes[gen] = world.run(
                save_step,
                url,
                step,
                gen,
                storage=storage,
                options=SAVE_OPTIONS,
                run_url=run_url,
                state_kw=STATE,
                barrier_dir=barrier_dir,
            )
        except BaseException as exc:  # reported below, with the other job's outcome
            errors[gen] = exc

    threads = [
        threading.Thread(target=go, args=(job_a, 1)),
        threading.Thread(target=go, args=(job_b, 2)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return outcomes


def _check_one_winner(outcomes, run_url, step, storage, world) -> int:
    won = [gen for gen, results in outcomes.items() if all(o["ok"] for o in results)]
    assert len(won) == 1, outcomes
    winner = won[0]
    for gen, results in outcomes.items():
        if gen != winner:
            for outcome in results:
                assert not outcome["ok"] and "CheckpointExists" in outcome["error"], outcome
    mgr = CheckpointManager(run_url, storage=storage)
    url = mgr.step_url(step)
    attempt = outcomes[winner][0]["attempt"]
    manifest = cloudckpt.read_manifest(url, storage=storage)
    assert manifest.metadata.get("step") == step
    assert all(key.startswith(f"data/{attempt}/") for key in manifest.objects)
    full = cloudckpt.load_full(url, storage=storage)
    assert differences(full, full_expected(2, step, winner, **STATE)) == []
    loaded = world.run(load_step, url, step, winner, storage=storage, state_kw=STATE)
    assert [o.get("bad") for o in loaded] == [[], []], loaded
    return winner


@pytest.mark.parametrize("backend", ["s3", "file"])
def test_two_jobs_saving_the_same_step_exactly_one_commits(
    world2, other_job, s3_server, storage, tmp_path, backend, figures
):
    if backend == "s3":
        run_url, options = (
            s3_server.url(f"race-{os.getpid()}-{random.getrandbits(32):08x}"),
            storage,
        )
    else:
        run_url, options = str(tmp_path / "run"), None
    rounds = 2 if backend == "s3" else 1
    winners = []
    for step in range(rounds):
        barrier = tmp_path / f"barrier-{step}"
        barrier.mkdir()
        outcomes = _race(world2, other_job, run_url, step, options, str(barrier))
        assert len(os.listdir(barrier)) == 2, "both coordinators reached their manifest put"
        winners.append(_check_one_winner(outcomes, run_url, step, options, world2))
        figures.add("concurrent same-step saves (at the commit)")
    mgr = CheckpointManager(run_url, storage=options)
    assert [(i.step, i.complete) for i in mgr.list()] == [(s, True) for s in range(rounds)]


@pytest.mark.slow
@pytest.mark.parametrize("round_", range(10))
def test_two_jobs_racing_unsynchronised_long(
    world2, other_job, s3_server, storage, round_, figures
):
    run_url = s3_server.url(f"race-long-{os.getpid()}-{round_}")
    for step in range(2):
        outcomes = _race(world2, other_job, run_url, step, storage, None)
        _check_one_winner(outcomes, run_url, step, storage, world2)
        figures.add("concurrent same-step saves (unsynchronised)")


def _prune_loop(mgr: CheckpointManager, stop: threading.Event, stats: dict) -> None:
    try:
        while not stop.is_set():
            stats["removed"] += len(mgr.prune())
            stats["rounds"] += 1
    except BaseException as exc:  # the test asserts there was none
        stats["error"] = exc


def _latest_loader(mgr: CheckpointManager, storage, stop: threading.Event, stats: dict) -> None:
    """Load whatever is latest, again and again; a load racing a deletion may fail, typed."""
    try:
        while not stop.is_set():
            latest = mgr.latest()
            if latest is None:
                continue
            try:
                full = cloudckpt.load_full(latest.url, storage=storage)
            except cloudckpt.CloudCkptError:
                stats["failed"] += 1
                continue
            gen = full["meta"]["gen"]
            assert differences(full, full_expected(2, latest.step, gen, **STATE)) == [], latest
            stats["exact"] += 1
    except BaseException as exc:
        stats["error"] = exc


@pytest.mark.parametrize(
    "steps", [pytest.param(5, id="ci"), pytest.param(25, id="long", marks=pytest.mark.slow)]
)
def test_prune_concurrent_with_saves_and_loads(world2, s3_server, storage, steps, figures):
    run_url = s3_server.url(f"prune-race-{os.getpid()}-{random.getrandbits(32):08x}")
    pruner = CheckpointManager(run_url, storage=storage, keep_last=2)
    reader = CheckpointManager(run_url, storage=storage)
    stop = threading.Event()
    prune_stats = {"rounds": 0, "removed": 0}
    load_stats = {"exact": 0, "failed": 0}
    threads = [
        threading.Thread(target=_prune_loop, args=(pruner, stop, prune_stats)),
        threading.Thread(target=_latest_loader, args=(reader, storage, stop, load_stats)),
    ]
    for t in threads:
        t.start()
    try:
        for step in range(steps):
            url = reader.step_url(step)
            saved = world2.run(
                save_step,
                url,
                step,
                1,
                storage=storage,
                options=SAVE_OPTIONS,
                run_url=run_url,
                state_kw=STATE,
            )
            assert all(o["ok"] for o in saved), saved
            loaded = world2.run(load_step, url, step, 1, storage=storage, state_kw=STATE)
            assert [o.get("bad") for o in loaded] == [[], []], loaded
            if step:  # the step before is still kept (keep_last=2)
                loaded = world2.run(
                    load_step,
                    reader.step_url(step - 1),
                    step - 1,
                    1,
                    storage=storage,
                    state_kw=STATE,
                )
                assert [o.get("bad") for o in loaded] == [[], []], loaded
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert "error" not in prune_stats, prune_stats["error"]
    assert "error" not in load_stats, load_stats["error"]
    assert prune_stats["rounds"] >= 2 and load_stats["exact"] >= 1, (prune_stats, load_stats)
    final = pruner.prune()
    infos = reader.list()
    assert [(i.step, i.complete) for i in infos] == [(steps - 2, True), (steps - 1, True)], (
        infos,
        final,
    )
    for info in infos:
        report = cloudckpt.verify(info.url, storage=storage)
        assert report.ok, report.problems
    figures.add("prune rounds concurrent with saves and loads", prune_stats["rounds"])
    figures.add("loads concurrent with prune (exact)", load_stats["exact"])
    figures.add("loads concurrent with prune (failed cleanly)", load_stats["failed"])
