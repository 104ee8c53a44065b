"""Deleting never breaks a kept checkpoint of an incremental run (issue 18).

A run of incremental saves (``CheckpointManager(incremental=True)``, its own retention after each
save) of a fine-tuning state: 3 of 8 tensors frozen, each other one updated at random steps. A
concurrent pruning *process* (``incremental_run.pruner_main``) prunes with random ``keep_last``
and deletes random complete checkpoints, the newest included, all the time a save runs. The saver
(a one-rank world) is killed (SIGKILL) at random: at a random instant (from outside), right after
its base is pinned, right before its manifest is sent, right after the commit; a killed step is
saved again half of the time. After every step, with the pruner paused (SIGSTOP, wherever it is):

1. every committed checkpoint loads exactly (``load_full``: every byte read, every crc checked);
2. a full clean-up (prune without retention, abandoned after 0 s, stale attempts, every pin,
   all judged an hour later so that the killed saves' pins have expired) leaves nothing that no
   committed checkpoint needs (``incremental_run.garbage``: the raw listing against the
   committed manifests), and every committed checkpoint still loads.

The pruner then resumes where it stopped, with what it had decided before the pause.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest

import cloudckpt
from cloudckpt import CheckpointManager, RetentionPolicy
from cloudckpt.errors import CheckpointExists
from cloudckpt.layout import step_dir
from cloudckpt.runs.cleanup import remove_stale_attempts, sweep_pins
from cloudckpt.runs.pruning import prune_run
from cloudckpt.runtime.loop import run_coroutine, shared_store
from cloudckpt.testing.ranks.world import ProcessWorld, RankFailedError
from tests.reliability.incremental_run import run_garbage, save_step, state
from tests.reliability.stores import REPO

pytestmark = pytest.mark.timeout(900)

KILLS = (None, None, "timed", "after_pin", "before_commit", "after_commit")
LATER = 3600.0  # the clean-up judges pins and ages this much later than now


@pytest.fixture(scope="module")
def saver_world(s3_server):
    """A one-rank world of its own: kills tear it down again and again."""
    world = ProcessWorld(1, env=s3_server.env(), timeout=120.0, failure_grace=10.0)
    yield world
    world.close()


class Pruner:
    """The concurrent pruning process, paused (SIGSTOP) and resumed (SIGCONT) by the test."""

    def __init__(self, url: str, seed: int, s3_server, log_path):
        env = {**os.environ, **s3_server.env(), "PYTHONPATH": str(REPO)}
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.reliability.incremental_run", url, str(seed)],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pause(self) -> None:
        assert self.proc.poll() is None, open(self.log_path).read()[-2000:]
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> tuple[int, list[str]]:
        """(prunes done, error lines)."""
        self.proc.send_signal(signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(timeout=30)
        lines = open(self.log_path).read().splitlines()
        return lines.count("pruned"), [line for line in lines if line != "pruned"]


def _save(
    world: ProcessWorld, url: str, step: int, seed: int, storage, kill, delay: float, keep_last
) -> str:
    """One save of ``step``; returns "ok", "exists" or "killed"."""
    if kill != "timed":
        try:
            world.run(save_step, url, step, seed, storage, kill, keep_last)
            return "ok"
        except RankFailedError as exc:
            if "CheckpointExists" in str(exc):
                return "exists"
            assert kill is not None and "signal 9" in str(exc), exc
            return "killed"
    pids, outcome = world.pids or (world.start() or world.pids), {}

    def run() -> None:
        try:
            world.run(save_step, url, step, seed, storage, None, keep_last)
            outcome["ok"] = True
        except RankFailedError as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    time.sleep(delay)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    thread.join(120)
    assert not thread.is_alive()
    if "ok" in outcome:
        world.close()  # the kill came after the call returned: the harness did not see it
        return "ok"
    assert "signal 9" in str(outcome["error"]) or "CheckpointExists" in str(outcome["error"]), (
        outcome["error"]
    )
    return "exists" if "CheckpointExists" in str(outcome["error"]) else "killed"


def _check(url: str, storage, seed: int, figures) -> list[int]:
    """The checks of the module docstring; returns the committed steps."""
    mgr = CheckpointManager(url, storage=storage)
    committed = [i.step for i in mgr.list() if i.complete]
    for step in committed:
        assert _same(cloudckpt.load_full(mgr.step_url(step), storage=storage), state(seed, step)), (
            step
        )
    store = shared_store(url, storage)
    later = time.time() + LATER
    run_coroutine(prune_run(store, RetentionPolicy(), 0.0, now=later))
    for step in committed:
        run_coroutine(remove_stale_attempts(store, step_dir(step), now=later))
    run_coroutine(sweep_pins(store, now=later, thorough=True))
    assert run_garbage(store) == []
    assert [i.step for i in mgr.list() if i.complete] == committed
    for step in committed:
        assert _same(cloudckpt.load_full(mgr.step_url(step), storage=storage), state(seed, step)), (
            step
        )
    figures.add("incremental: committed checkpoints loaded", 2 * len(committed))
    return committed


def _same(loaded: dict, expected: dict) -> bool:
    import torch

    return (
        loaded["step"] == expected["step"]
        and loaded["model"].keys() == expected["model"].keys()
        and all(torch.equal(loaded["model"][k], v) for k, v in expected["model"].items())
    )


def run_incremental(
    world, s3_server, storage, url: str, *, steps: int, seed: int, figures, log_path, kills=None
) -> dict:
    rng = random.Random(seed)
    pruner = Pruner(url, seed, s3_server, log_path)
    outcomes: list[str] = []
    durations: list[float] = []  # of saves not killed: timed kills fall within one
    try:
        pruner.pause()
        for step in range(1, steps + 1):
            kill = kills[step - 1] if kills is not None else rng.choice(KILLS)
            keep_last = rng.choice([None, 2, 3])
            pruner.resume()
            delay = rng.uniform(0.0, statistics.median(durations)) if durations else 0.2
            started = time.perf_counter()
            outcome = _save(world, url, step, seed, storage, kill, delay, keep_last)
            if kill is None and outcome == "ok":
                durations.append(time.perf_counter() - started)
            if outcome == "killed" and rng.random() < 0.5:
                outcome += "+" + _save(world, url, step, seed, storage, None, 0.0, keep_last)
            pruner.pause()
            outcomes.append(f"{kill}:{outcome}")
            figures.add(f"incremental: save {kill or 'not killed'} -> {outcome}")
            _check(url, storage, seed, figures)
    finally:
        prunes, errors = pruner.stop()
    figures.add("incremental: prunes by the concurrent process", prunes)
    figures.add("incremental: races the concurrent pruner lost (an error, retried)", len(errors))
    assert prunes > 0, errors[-20:]  # it ran, and it deleted things while saves ran
    # at the end: nothing survives that the last checkpoint does not need
    store = shared_store(url, storage)
    run_coroutine(prune_run(store, RetentionPolicy(keep_last=1), 0.0, now=time.time() + LATER))
    run_coroutine(sweep_pins(store, now=time.time() + LATER, thorough=True))
    assert run_garbage(store) == []
    return {"outcomes": outcomes, "prunes": prunes, "pruner_errors": errors}


def test_short_incremental_run_with_kills_and_a_concurrent_pruner(
    saver_world, s3_server, storage, s3_url, figures, tmp_path
):
    """Three steps, one kill of each deterministic kind (the first save writes everything)."""
    result = run_incremental(
        saver_world,
        s3_server,
        storage,
        s3_url,
        steps=3,
        seed=11,
        figures=figures,
        log_path=tmp_path / "pruner.log",
        kills=["after_commit", "after_pin", "before_commit"],
    )
    assert len(result["outcomes"]) == 3, result


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_incremental_runs_with_random_kills_and_a_concurrent_pruner(
    saver_world, s3_server, storage, s3_url, seed, figures, tmp_path
):
    """Ten steps, kills at random (timed ones included)."""
    result = run_incremental(
        saver_world,
        s3_server,
        storage,
        f"{s3_url}/{seed}",
        steps=10,
        seed=seed,
        figures=figures,
        log_path=tmp_path / "pruner.log",
    )
    assert len(result["outcomes"]) == 10, result


def test_a_pin_of_a_running_save_keeps_the_base_until_its_lease_is_over(s3_server, storage, s3_url):
    """Deleting the base of a save in flight (its pin written, not committed) keeps every
    object of the base; a prune after the lease removes the pin and the objects."""
    from cloudckpt import SaveOptions
    from cloudckpt.layout import Pin, encode_pin, pin_key

    mgr = CheckpointManager(
        s3_url, storage=storage, incremental=True, save_options=SaveOptions(object_size=96 << 10)
    )
    mgr.save(1, state(5, 1))
    store = shared_store(s3_url, storage)
    pin = f"{step_dir(1)}{pin_key('00000000000000aa', step_dir(2).rstrip('/'))}"
    run_coroutine(
        store.put(pin, encode_pin(Pin(step_dir(2).rstrip("/"), "00000000000000aa", 60.0)))
    )
    data = [i.key for i in _list(store, step_dir(1) + "data/")]
    assert data
    mgr.delete(1)
    assert [i.key for i in _list(store, step_dir(1) + "data/")] == data  # pinned: all kept
    assert mgr.list() == []  # retained, not a checkpoint
    run_coroutine(prune_run(store, RetentionPolicy(), 0.0))  # the lease is not over
    assert [i.key for i in _list(store, step_dir(1) + "data/")] == data
    run_coroutine(prune_run(store, RetentionPolicy(), 0.0, now=time.time() + 61.0))
    assert _list(store, "") == []


def _list(store, prefix: str) -> list:
    async def collect():
        return [i async for i in store.list(prefix)]

    return run_coroutine(collect())


def test_a_committed_reference_keeps_exactly_the_objects_it_uses(s3_server, storage, s3_url):
    """Of a deleted base, exactly the objects a later checkpoint uses stay; deleting that one
    collects them (they are older than ``abandoned_after``)."""
    mgr = CheckpointManager(
        s3_url,
        storage=storage,
        incremental=True,
        abandoned_after=0,
        save_options=cloudckpt.SaveOptions(object_size=32 << 10),
    )
    mgr.save(1, state(9, 1))
    mgr.save(2, state(9, 2))
    used = {
        k
        for h, k in zip(
            *(lambda m: (m.object_homes, m.objects))(
                cloudckpt.read_manifest(mgr.step_url(2), storage=storage)
            )
        )
        if h
    }
    store = shared_store(s3_url, storage)
    all_data = {i.key[len(step_dir(1)) :] for i in _list(store, step_dir(1) + "data/")}
    assert used and used < all_data  # some tensors changed: some objects of step 1 unused
    plan = mgr.plan_delete(1)
    assert plan.kept == len(used) + 1  # the used objects and step 2's pin
    mgr.delete(1)
    assert {i.key[len(step_dir(1)) :] for i in _list(store, step_dir(1) + "data/")} == used
    assert _same(cloudckpt.load_full(mgr.step_url(2), storage=storage), state(9, 2))
    try:
        mgr.save(2, state(9, 2))
    except CheckpointExists:
        pass
    mgr.delete(2)
    assert _list(store, "") == []
