"""cloudckpt.integrations.dcp_trainer (DCPRun) and cloudckpt.dcp.run against SeaweedFS: a 2-rank
FSDP2 run saved with dcp.save / dcp.async_save, stopped, resumed from S3 in a fresh state; the
losses after the resume equal an uninterrupted run's and the final model, optimizer and
scheduler states are equal exactly; a half-written newer step is never resumed from; retention
keeps the newest complete ones. In-process: listing, pruning and deleting a run's folders, and
what a hostile listing or a damaged .metadata does."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from cloudckpt.errors import CheckpointExists, CheckpointNotFound, ConfigError, ManifestError
from tests.integrations.dcp_training import (
    AppState,
    build_model,
    build_optim,
    full_state,
    same,
    train_step,
)


def rank_train(url: str, *, until: int, save_every: int, mode: str, seed: int) -> dict:
    from cloudckpt.integrations.dcp_trainer import DCPRun

    model = build_model(seed)
    optim, sched = build_optim(model)
    app = AppState(model, optim, sched)
    state = {"app": app}
    run = DCPRun(url, keep_last=2)
    resumed = run.load(state)
    losses = {}
    for step in range(app.step + 1, until + 1):
        losses[step] = train_step(model, optim, sched, step)
        app.step = step
        if step % save_every == 0:
            if mode == "sync":
                run.save(state, step)
            else:
                run.async_save(state, step)
    run.close()
    return {"resumed": resumed, "losses": losses, "final": full_state(model, optim, sched)}


def _put(url: str, key: str, data: bytes) -> None:
    from cloudckpt.runtime.loop import run_coroutine, shared_store

    run_coroutine(shared_store(url).put(key, data))


def _complete(url: str) -> list[int | None]:
    from cloudckpt.integrations.dcp_trainer import DCPRun

    return [c.step for c in DCPRun(url).list() if c.complete]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_resumed_run_equals_an_uninterrupted_one(world2, s3_env, s3_url, mode):
    whole = world2.run(rank_train, f"{s3_url}/whole", until=6, save_every=2, mode=mode, seed=0)
    world2.run(rank_train, f"{s3_url}/part", until=4, save_every=2, mode=mode, seed=0)
    # a save of step 6 killed after its first data file: no .metadata, never resumed from
    _put(f"{s3_url}/part", "step-6/__0_0.distcp", b"half-written")
    resumed = world2.run(rank_train, f"{s3_url}/part", until=6, save_every=2, mode=mode, seed=7)
    for rank in (0, 1):
        assert whole[rank]["resumed"] is None
        assert resumed[rank]["resumed"] == 4
        assert sorted(resumed[rank]["losses"]) == [5, 6]
        assert resumed[rank]["losses"] == {s: whole[rank]["losses"][s] for s in (5, 6)}
        assert same(resumed[rank]["final"], whole[rank]["final"])
    assert whole[0]["final"]["sched"]["last_epoch"] == 6
    # keep_last=2: the two newest complete steps stay, the step-6 save replaced the half-written
    assert _complete(f"{s3_url}/whole") == [4, 6]
    assert _complete(f"{s3_url}/part") == [4, 6]


def rank_latest(urls: list[str]):
    import torch.distributed as dist

    from cloudckpt.integrations.dcp_trainer import DCPRun

    try:
        return DCPRun(urls[dist.get_rank()], timeout=30).latest()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def test_rank_0_chooses_the_step_and_every_rank_fails_with_its_listing(world2, s3_env, s3_url):
    _put(s3_url, "step-4/.metadata", b"rank 0 sees a complete step 4")
    # rank 1 looks at an empty run: it still resumes from the step rank 0 chose
    assert world2.run(rank_latest, [s3_url, f"{s3_url}-empty"]) == [4, 4]
    bad = world2.run(rank_latest, ["s3://no-such-bucket-dcp/run", s3_url])
    assert bad[0] == bad[1] and bad[0].startswith("BucketNotFound: "), bad  # the same, one line
    assert "failed on rank 0" in bad[0] and "\n" not in bad[0]


# -- one process: the run's folders ---------------------------------------------------------------


def _save_step(run, step: int, value: float) -> None:
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # DCP: "assuming the intent is to save in a single process"
        dcp.save({"w": torch.full((4,), value), "n": step}, storage_writer=run.writer(step))


def test_listing_pruning_and_latest_of_a_run(s3_env, s3_url, caplog):
    from cloudckpt.integrations.dcp_trainer import DCPRun

    run = DCPRun(s3_url, keep_last=2)
    assert run.list() == [] and run.latest() is None
    for step in (1, 2, 3):
        _save_step(run, step, float(step))
    _put(s3_url, "step-3/notes.txt", b"the user's own file")
    _put(s3_url, "step-9/__0_0.distcp", b"a save in flight")  # incomplete, newest step
    _put(s3_url, "last/.metadata", b"not numbered")
    _put(s3_url, f"step-{'9' * 30}/.metadata", b"a step too long to be one")
    listed = {(c.name, c.step, c.complete) for c in run.list()}
    assert {("step-1", 1, True), ("step-3", 3, True), ("step-9", 9, False)} <= listed
    assert ("last", None, True) in listed and (f"step-{'9' * 30}", None, True) in listed
    assert run.latest() == 3  # not the incomplete 9, not the unnumbered ones

    state = {"w": torch.zeros(4), "n": 0}
    assert run.load(state) == 3 and torch.equal(state["w"], torch.full((4,), 3.0))

    assert [c.step for c in run.prune(dry_run=True)] == [1]
    assert [c.step for c in run.prune()] == [1]  # the fresh incomplete step-9 stays
    assert [(c.step, c.complete) for c in run.list() if c.step in (1, 2, 3, 9)] == [
        (2, True),
        (3, True),
        (9, False),
    ]
    # keep_last=0 still keeps the newest complete; an abandoned save (grace 0) goes
    caplog.set_level(logging.WARNING)
    time.sleep(1.1)  # the store's timestamps have whole seconds
    gone = DCPRun(s3_url, keep_last=0, abandoned_after=0).prune()
    assert [(c.step, c.complete) for c in gone] == [(2, True), (9, False)]
    assert _complete(s3_url)[:1] == [3]
    run.prune()
    assert 3 in _complete(s3_url)


def test_deleting_a_folder_keeps_foreign_objects_and_uncommits_it(s3_env, s3_url, caplog):
    from cloudckpt.dcp.run import delete_folder
    from cloudckpt.integrations.dcp_trainer import DCPRun
    from cloudckpt.runtime.loop import run_coroutine, shared_store

    run = DCPRun(s3_url)
    _save_step(run, 5, 1.0)
    _put(s3_url, "step-5/notes.txt", b"kept")
    caplog.set_level(logging.WARNING)
    removed = run_coroutine(delete_folder(shared_store(s3_url), "step-5"))
    assert removed >= 3  # .metadata, its checksums, the data file
    assert "notes.txt" in caplog.text
    assert [(c.step, c.complete) for c in run.list()] == [(5, False)]  # never loaded again
    assert run.latest() is None
    with pytest.raises(ConfigError):
        run_coroutine(delete_folder(shared_store(s3_url), "../other"))


def test_a_damaged_metadata_of_the_newest_step_is_a_typed_error_and_nothing_goes(s3_env, s3_url):
    from cloudckpt.integrations.dcp_trainer import DCPRun

    run = DCPRun(s3_url, keep_last=5)
    _save_step(run, 1, 1.0)
    _put(s3_url, "step-2/.metadata", b"\x80\x04garbage")
    assert run.latest() == 2
    with pytest.raises(ManifestError) as err:
        run.load({"w": torch.zeros(4), "n": 0})
    assert "\n" not in str(err.value)
    assert run.load({"w": torch.zeros(4), "n": 0}, step=1) == 1
    with pytest.raises(CheckpointNotFound) as err:  # a step with no .metadata
        run.load({"w": torch.zeros(4), "n": 0}, step=7)
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointExists) as err:  # a committed step is never written again
        run.save({"w": torch.zeros(4), "n": 0}, 1)
    assert "\n" not in str(err.value)
    assert _complete(s3_url) == [1, 2]


def test_bad_arguments_are_refused_before_any_request():
    from cloudckpt.integrations.dcp_trainer import DCPRun

    with pytest.raises(ConfigError):
        DCPRun("s3://")
    with pytest.raises(ConfigError):
        DCPRun("s3://bucket/run", keep_last=2, retention=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        DCPRun("s3://bucket/run").step_url(-1)


# -- the example ---------------------------------------------------------------------------------


def _example(s3_server, url: str, *args: str) -> dict[int, str]:
    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(s3_server.env(), PYTHONPATH=str(repo), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["examples/dcp_train.py", "--url", url, "--steps", "8", "--save-every", "2", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    losses = dict(re.findall(r"^step (\d+) loss (\S+)$", res.stdout, re.M))
    first = res.stdout.splitlines()[0]
    return {"first": first, "last": res.stdout.splitlines()[-1], **losses}


@pytest.mark.slow
def test_the_example_stopped_and_started_again_prints_the_losses_of_one_run(s3_server, s3_url):
    whole = _example(s3_server, f"{s3_url}/whole")
    part = _example(s3_server, f"{s3_url}/part", "--async", "--stop-at", "5")
    again = _example(s3_server, f"{s3_url}/part", "--async")
    assert whole["first"] == part["first"] == "fresh start"
    assert again["first"] == "resumed from step 4"
    assert sorted(again) == sorted(["first", "last", "5", "6", "7", "8"])
    assert all(again[s] == whole[s] for s in ("5", "6", "7", "8"))
    assert part["5"] == whole["5"]
    assert whole["last"] == again["last"] == "complete checkpoints: [6, 8]"


def test_a_run_in_a_local_folder(tmp_path):
    from cloudckpt.integrations.dcp_trainer import DCPRun

    run = DCPRun(tmp_path / "run", keep_last=1)
    for step in (1, 2):
        with pytest.warns(UserWarning):  # DCP: a single process
            run.save({"w": torch.full((4,), float(step)), "n": step}, step)
    run.wait()
    assert [(c.step, c.complete) for c in run.list()] == [(2, True)]
    assert sorted(p.name for p in (tmp_path / "run" / "step-2").iterdir()) == [
        ".metadata",
        ".metadata.checksums",
        "__0_0.distcp",
    ]
    state = {"w": torch.zeros(4), "n": 0}
    assert run.load(state) == 2 and state["n"] == 2
