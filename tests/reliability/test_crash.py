"""Crash consistency: a 2-rank save killed (SIGKILL of one rank, or of the whole job) at many
points spread over the save never leaves a checkpoint that looks complete but is not, never harms
the previous checkpoint, and never blocks a new save of the same step.

Each kill point (``killpoints.py``) runs one cycle on a run that keeps growing, as a job that
crashes again and again would:

1. the job saves step ``s`` with ``CheckpointManager.save`` and is killed where the point says
   (the harness reports the victim "killed by signal 9"; every survivor raises a cloudckpt
   ``CheckpointError`` instead of hanging);
2. ``list()`` / ``latest()`` / ``info()`` / ``load_full`` of step ``s``: not complete, unless the
   kill came after the manifest request went out (``may_commit``), in which case it loads
   bit-exact;
3. the previous complete checkpoint still loads bit-exact and verifies;
4. a fresh job saves step ``s`` again: it succeeds (or is refused with ``CheckpointExists`` when the
   killed save had committed), the result loads bit-exact, and the manager's clean-up left only
   the committed attempt's objects and no unfinished upload under the step.

The long mode (``-m slow``) adds many more deterministic points and kills of the whole job at
random instants of a save (time based, from outside).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.errors import CheckpointNotFound
from cloudckpt.layout import step_dir
from cloudckpt.testing.ranks.world import ProcessWorld, RankFailedError
from tests.reliability.conftest import SAVE_OPTIONS
from tests.reliability.killpoints import KillPoint, ci_kill_points, long_kill_points
from tests.reliability.ranks import load_step, save_step, warm_up
from tests.reliability.states import differences, full_expected

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def crash_world(s3_server):
    """A 2-rank world of its own: kill points tear it down again and again."""
    world = ProcessWorld(2, env=s3_server.env(), timeout=180.0, failure_grace=20.0)
    yield world
    world.close()


class Run:
    """One run (a CheckpointManager root) that the kill cycles keep saving into."""

    def __init__(self, backend: str, url: str, storage, s3_server, root: Path | None = None):
        self.backend = backend
        self.url = url
        self.storage = storage if backend == "s3" else None
        self.s3_server = s3_server
        self.root = root
        self.mgr = CheckpointManager(url, storage=self.storage)
        self.committed: dict[int, int] = {}  # step -> gen of its committed save
        self.next_step = 0

    def save(
        self, world: ProcessWorld, step: int, gen: int, *, options=SAVE_OPTIONS, **kw
    ) -> list[dict]:
        return world.run(
            save_step,
            self.mgr.step_url(step),
            step,
            gen,
            storage=self.storage,
            options=options,
            run_url=self.url,
            **kw,
        )

    def check_loads(self, step: int) -> None:
        """``load_full`` of a committed step is bit-exact (it reads every byte of the checkpoint
        and checks every block's crc32c on the way)."""
        gen = self.committed[step]
        loaded = cloudckpt.load_full(self.mgr.step_url(step), storage=self.storage)
        assert differences(loaded, full_expected(2, step, gen)) == [], (step, gen)

    def step_contents(self, step: int) -> tuple[list[str], list[str]]:
        """(object keys, unfinished uploads or temporary files) under a step, relative to it,
        seen behind cloudckpt's back."""
        prefix = step_dir(step)
        if self.backend == "file":
            base = self.root / prefix
            keys, temps = [], []
            for dirpath, _, files in os.walk(base):
                for name in files:
                    rel = os.path.relpath(os.path.join(dirpath, name), base).replace(os.sep, "/")
                    (temps if ".cloudckpt-tmp-" in name else keys).append(rel)
            return sorted(keys), sorted(temps)
        bucket, _, root = self.url[len("s3://") :].partition("/")
        client = self.s3_server.boto3_client()
        full = f"{root}/{prefix}"
        keys = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=full):
            keys += [o["Key"][len(full) :] for o in page.get("Contents", [])]
        uploads = client.list_multipart_uploads(Bucket=bucket, Prefix=full).get("Uploads", [])
        return sorted(keys), sorted(u["Key"][len(full) :] for u in uploads)


def _outcomes(directory: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in directory.glob("rank*.json")}


def kill_cycle(world: ProcessWorld, run: Run, point: KillPoint, scratch: Path, figures) -> dict:
    """One kill point, checked end to end (see the module docstring). Returns what happened."""
    step = run.next_step
    run.next_step += 1
    url = run.mgr.step_url(step)
    previous = max(run.committed)
    world.start()
    scratch.mkdir(parents=True, exist_ok=True)

    # 1. the killed save (the global planning exchange only happens without a cached plan)
    options = SAVE_OPTIONS
    if point.target == "save global planning":
        options = dataclasses.replace(options, use_plan_cache=False)
    with pytest.raises(RankFailedError) as failed:
        run.save(
            world, step, 0, point=point, pids=world.pids, outcome_dir=str(scratch), options=options
        )
    victims = [0, 1] if point.scope == "job" else [point.rank]
    for rank in victims:
        assert "killed by signal 9" in failed.value.failures.get(rank, ""), failed.value
    survivors = _outcomes(scratch)
    for rank in set(range(2)) - set(victims):
        assert rank in survivors, f"rank {rank} neither died nor reported: {failed.value}"
        outcome = survivors[rank]
        assert not outcome["ok"] and "CheckpointError" in outcome["error"], outcome
    figures.add("crash kill points")
    figures.add(f"crash kills ({point.scope})")

    # 2. the killed step is not complete (or, past the commit point, complete and exact)
    infos = {i.step: i for i in run.mgr.list()}
    complete = step in infos and infos[step].complete
    if complete:  # recorded first, so that a failure here does not derail the next cycles
        run.committed[step] = 0
    if not point.may_commit:
        assert not complete, f"{point}: the killed save is listed complete"
        with pytest.raises(CheckpointNotFound):
            run.mgr.info(step)
        with pytest.raises(CheckpointNotFound):
            cloudckpt.load_full(url, storage=run.storage)
    assert [i.step for i in infos.values() if i.complete] == sorted(run.committed)
    latest = run.mgr.latest()
    assert latest is not None and latest.step == (step if complete else previous)
    if complete:
        run.check_loads(step)
        figures.add("crash kills that had committed")

    # 3. the previous checkpoint is intact
    run.check_loads(previous)

    # 4. a new save of the same step
    retried = run.save(world, step, 1)
    if complete:
        for outcome in retried:
            assert not outcome["ok"] and "CheckpointExists" in outcome["error"], outcome
    else:
        assert all(o["ok"] for o in retried), retried
        run.committed[step] = 1
        attempt = retried[0]["attempt"]
        manifest = cloudckpt.read_manifest(url, storage=run.storage)
        assert all(key.startswith(f"data/{attempt}/") for key in manifest.objects)
        keys, unfinished = run.step_contents(step)
        assert keys == sorted(["manifest.msgpack", *manifest.objects]), (
            f"{point}: leftovers of the killed attempt after the new save"
        )
        assert unfinished == [], f"{point}: unfinished uploads left: {unfinished}"
    run.check_loads(step)
    return {"step": step, "complete_after_kill": complete}


def _make_run(backend: str, s3_server, storage, tmp_path_factory) -> Run:
    if backend == "s3":
        run = Run(
            "s3",
            s3_server.url(f"crash-{os.getpid()}-{random.getrandbits(32):08x}"),
            storage,
            s3_server,
        )
    else:
        root = tmp_path_factory.mktemp("crash-run")
        run = Run("file", root.as_uri(), storage, s3_server, root)
    return run


@pytest.fixture(scope="module")
def runs(crash_world, s3_server, storage, tmp_path_factory):
    """One run per backend, each starting with a committed step 0."""
    made = {}
    for backend in ("s3", "file"):
        run = _make_run(backend, s3_server, storage, tmp_path_factory)
        assert all(o["ok"] for o in run.save(crash_world, 0, 0))
        run.committed[0] = 0
        run.next_step = 1
        made[backend] = run
    return made


@pytest.mark.parametrize("point", ci_kill_points(), ids=str)
def test_kill_point(point, crash_world, runs, tmp_path, figures):
    kill_cycle(crash_world, runs[point.backend], point, tmp_path / "outcomes", figures)


def test_after_the_kills_a_two_rank_job_loads_the_latest(crash_world, runs):
    """What the cycles left behind: every committed step verifies, the latest loads on 2 ranks."""
    for run in runs.values():
        for step in run.committed:
            report = cloudckpt.verify(run.mgr.step_url(step), storage=run.storage)
            assert report.ok, (step, report.problems)
        latest = run.mgr.latest()
        assert latest.step == max(run.committed)
        results = crash_world.run(
            load_step, latest.url, latest.step, run.committed[latest.step], storage=run.storage
        )
        assert results == [{"ok": True, "bad": [], "seconds": r["seconds"]} for r in results]


def test_stale_manifest_upload_is_cleaned_after_a_new_save(tmp_path):
    """A save killed while writing its manifest (LocalStore: after the temporary file was
    written, before it was linked) leaves ``.manifest.msgpack.cloudckpt-tmp-<id>``; the next
    successful save of that step through the manager should remove it like any other leftover
    of the killed attempt."""
    import torch

    mgr = CheckpointManager(str(tmp_path / "run"))
    stale = tmp_path / "run" / step_dir(3) / ".manifest.msgpack.cloudckpt-tmp-0123456789abcdef"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a manifest")
    (tmp_path / "run" / step_dir(3) / "data" / "0123456789abcdef").mkdir(parents=True)
    (tmp_path / "run" / step_dir(3) / "data" / "0123456789abcdef" / "r00000-0000.bin").write_bytes(
        b"stale data"
    )
    mgr.save(3, {"w": torch.arange(10)})
    assert not (tmp_path / "run" / step_dir(3) / "data" / "0123456789abcdef").exists()
    assert not stale.exists()


def test_killed_attempt_with_only_unfinished_uploads_is_cleaned_after_a_new_save(
    s3_server, storage
):
    """What a job killed during its first multipart parts leaves: unfinished uploads under the
    step, no finished object. The next successful save of that step must abort them."""
    import torch

    run_url = s3_server.url(f"crash-uploads-{os.getpid()}-{random.getrandbits(32):08x}")
    bucket, _, root = run_url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    stale = f"{root}/{step_dir(5)}data/0123456789abcdef/r00000-0000.bin"
    upload = client.create_multipart_upload(Bucket=bucket, Key=stale)
    client.upload_part(
        Bucket=bucket, Key=stale, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1024
    )
    CheckpointManager(run_url, storage=storage).save(5, {"w": torch.arange(10)})
    left = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{root}/").get("Uploads", [])
    assert [u["Key"] for u in left] == []


# -- long mode -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("point", long_kill_points(), ids=str)
def test_kill_point_long(point, crash_world, runs, tmp_path, figures):
    kill_cycle(crash_world, runs[point.backend], point, tmp_path / "outcomes", figures)


TIMED_KILLS = int(os.environ.get("CLOUDCKPT_TIMED_KILLS", "40"))


@pytest.mark.slow
def test_whole_job_killed_at_random_instants(crash_world, runs, tmp_path, figures):
    """SIGKILL every rank at a random instant of a save (from outside, time based): spread over
    the measured duration of a warm save, with the same checks as the deterministic points."""
    run = runs["s3"]
    rng = random.Random(20240607)
    crash_world.run(warm_up, run.url, run.storage)
    step = run.next_step
    run.next_step += 1
    started = time.perf_counter()
    assert all(o["ok"] for o in run.save(crash_world, step, 1))
    duration = time.perf_counter() - started
    run.committed[step] = 1
    finished_first = 0
    for i in range(TIMED_KILLS):
        step = run.next_step
        run.next_step += 1
        previous = max(run.committed)
        crash_world.run(warm_up, run.url, run.storage)
        pids = crash_world.pids
        delay = rng.uniform(0.0, 1.1 * duration)
        result: dict = {}

        def save(result: dict = result, step: int = step) -> None:
            try:
                result["ok"] = run.save(crash_world, step, 0)
            except RankFailedError as exc:
                result["killed"] = exc

        thread = threading.Thread(target=save)
        thread.start()
        time.sleep(delay)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        thread.join(120)
        assert not thread.is_alive()
        if "ok" in result:  # the save won the race: the harness does not know its ranks died
            crash_world.close()
        figures.add("crash kills (timed, job)")
        infos = {i.step: i for i in run.mgr.list()}
        complete = step in infos and infos[step].complete
        if "ok" in result:
            finished_first += 1
            assert complete
        if complete:
            run.committed[step] = 0
        assert run.mgr.latest().step == (step if complete else previous)
        run.check_loads(previous)
        if complete:
            run.check_loads(step)
            continue
        assert all(o["ok"] for o in run.save(crash_world, step, 1))
        run.committed[step] = 1
        run.check_loads(step)
    figures.add("crash timed kills after the save had finished", finished_first)
