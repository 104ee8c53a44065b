"""CheckpointManager against the session's SeaweedFS: retention, listing cost, deletion, prune
of killed saves, prune concurrent with a save, async saves."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from cloudckpt import CheckpointManager, SaveOptions
from cloudckpt.errors import CheckpointExists, CheckpointNotFound
from cloudckpt.layout import step_dir
from cloudckpt.runtime.loop import run_coroutine
from tests.cli_forkserver import run_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def state(step: int, n: int = 1000) -> dict:
    return {
        "model": {
            "w": torch.arange(n, dtype=torch.float32) * step,
            "b": torch.full((3, 4), step, dtype=torch.int64),
        },
        "meta": {"step": step, "lr": 0.5 / (step + 1)},
    }


def blank(n: int = 1000) -> dict:
    return {
        "model": {"w": torch.zeros(n), "b": torch.zeros(3, 4, dtype=torch.int64)},
        "meta": {"step": -1, "lr": 0.0},
    }


def assert_state(sd: dict, step: int, n: int = 1000) -> None:
    ref = state(step, n)
    assert torch.equal(sd["model"]["w"], ref["model"]["w"])
    assert torch.equal(sd["model"]["b"], ref["model"]["b"])
    assert sd["meta"] == ref["meta"]


def run_keys(s3_server, url: str) -> list[str]:
    """Every object key under a run URL, relative to it (boto3, independent of cloudckpt)."""
    bucket, _, root = url[len("s3://") :].partition("/")
    client = s3_server.boto3_client()
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=root + "/"):
        keys += [o["Key"][len(root) + 1 :] for o in page.get("Contents", [])]
    return keys


def run_uploads(s3_server, url: str) -> list[str]:
    bucket, _, root = url[len("s3://") :].partition("/")
    resp = s3_server.boto3_client().list_multipart_uploads(Bucket=bucket, Prefix=root + "/")
    return [u["Key"][len(root) + 1 :] for u in resp.get("Uploads", [])]


def test_ten_saves_keep_last_3_keep_every_4(s3_env, s3_url):
    mgr = CheckpointManager(s3_url, keep_last=3, keep_every=4)
    for step in range(1, 11):
        mgr.save(step, state(step))
    infos = mgr.list()
    assert [(i.step, i.complete) for i in infos] == [(4, True), (8, True), (9, True), (10, True)]
    for step in (4, 8, 9, 10):
        sd = blank()
        assert mgr.load(sd, step=step) == step
        assert_state(sd, step)
    sd = blank()
    assert mgr.load(sd) == 10
    assert_state(sd, 10)
    # the deleted checkpoints left nothing behind
    dirs = {k.split("/", 1)[0] + "/" for k in run_keys(s3_env, s3_url)}
    assert dirs == {step_dir(s) for s in (4, 8, 9, 10)}
    assert run_uploads(s3_env, s3_url) == []
    detailed = mgr.list(details=True)
    assert all(i.world_size == 1 and i.objects >= 1 and i.total_bytes >= 4048 for i in detailed)
    assert mgr.info(9).total_bytes == detailed[2].total_bytes
    with pytest.raises(CheckpointExists):
        mgr.save(10, state(10))


def test_empty_run_missing_step_and_delete(s3_env, s3_url):
    mgr = CheckpointManager(s3_url)
    sd = blank()
    assert mgr.list() == [] and mgr.latest() is None
    assert mgr.load(sd) is None
    assert torch.equal(sd["model"]["w"], torch.zeros(1000))
    with pytest.raises(CheckpointNotFound):
        mgr.load(sd, step=3)
    mgr.save(3, state(3))
    mgr.save(5, state(5))
    assert mgr.latest().step == 5 and mgr.latest().created_at is not None
    assert mgr.delete(5) >= 2
    assert mgr.delete(5) == 0
    assert [i.step for i in mgr.list()] == [3]
    assert mgr.load(sd) == 3
    assert_state(sd, 3)
    with pytest.raises(CheckpointNotFound):
        mgr.info(5)


def test_list_of_1000_checkpoints_is_cheap(s3_env, s3_url):
    mgr = CheckpointManager(s3_url)
    store = mgr.store
    incomplete = {0, 7, 257, 507, 757, 999 - 1}

    async def fabricate():
        sem = asyncio.Semaphore(32)

        async def put(key):
            async with sem:
                await store.put(key, b"x")

        keys = []
        for s in range(1000):
            keys.append(f"{step_dir(s)}data/0123456789abcdef/r00000-0000.bin")
            if s not in incomplete:
                keys.append(f"{step_dir(s)}manifest.msgpack")
        await asyncio.gather(*(put(k) for k in keys))

    run_coroutine(fabricate())
    store.stats.reset()
    infos = mgr.list()
    requests = dict(store.stats.requests)
    assert [i.step for i in infos] == list(range(1000))
    assert {i.step for i in infos if not i.complete} == incomplete
    lists = sum(n for op, n in requests.items() if op.startswith("list"))
    assert lists <= 3, requests
    assert requests.get("get", 0) == 0, requests
    # one HEAD per apparently incomplete checkpoint (plus SeaweedFS page-boundary repairs)
    assert requests.get("head", 0) <= len(incomplete) + 3, requests
    store.stats.reset()
    assert mgr.latest().step == 999
    assert store.stats.requests.get("get", 0) == 0


def test_stale_attempt_of_same_step_is_cleaned_after_save(s3_env, s3_url):
    client = s3_env.boto3_client()
    bucket, _, root = s3_url[len("s3://") :].partition("/")
    stale = f"{root}/{step_dir(5)}data/00000000deadbeef/"
    client.put_object(Bucket=bucket, Key=stale + "r00000-0000.bin", Body=b"old bytes")
    client.create_multipart_upload(Bucket=bucket, Key=stale + "r00001-0000.bin")
    mgr = CheckpointManager(s3_url)
    assert [(i.step, i.complete) for i in mgr.list()] == [(5, False)]
    mgr.save(5, state(5))
    assert not any("deadbeef" in k for k in run_keys(s3_env, s3_url))
    assert run_uploads(s3_env, s3_url) == []
    sd = blank()
    assert mgr.load(sd) == 5
    assert_state(sd, 5)


def test_async_saves_prune_after_each(s3_env, s3_url):
    mgr = CheckpointManager(s3_url, keep_last=1)
    handles = []
    for step in (1, 2, 3):
        sd = state(step)
        handles.append(mgr.save(step, sd, blocking=False))
        sd["model"]["w"].fill_(-1)  # the checkpoint holds the values as of the call
    result = handles[-1].result(timeout=120)
    assert result.url == mgr.step_url(3) and handles[-1].step == 3
    assert all(h.done() for h in handles)
    assert [i.step for i in mgr.list()] == [3]
    sd = blank()
    assert mgr.load(sd) == 3
    assert_state(sd, 3)


def test_prune_keeps_fresh_incomplete_and_dry_run(s3_env, s3_url):
    mgr = CheckpointManager(s3_url, keep_last=1)
    mgr.save(1, state(1))
    mgr.save(2, state(2))  # auto-prune removes step 1
    client = s3_env.boto3_client()
    bucket, _, root = s3_url[len("s3://") :].partition("/")
    client.put_object(
        Bucket=bucket,
        Key=f"{root}/{step_dir(3)}data/00000000cafecafe/r00000-0000.bin",
        Body=b"in progress",
    )
    assert [(i.step, i.complete) for i in mgr.list()] == [(2, True), (3, False)]
    assert mgr.prune() == []  # step 3 is younger than the grace period
    eager = CheckpointManager(s3_url, keep_last=1, abandoned_after=0)
    assert [i.step for i in eager.prune(dry_run=True)] == [3]
    assert [(i.step, i.complete) for i in eager.list()] == [(2, True), (3, False)]
    assert [i.step for i in eager.prune()] == [3]
    assert [i.step for i in eager.list()] == [2]


KILLED_SAVE = textwrap.dedent("""
    import sys, torch
    from cloudckpt import CheckpointManager, SaveOptions
    mgr = CheckpointManager(sys.argv[1], save_options=SaveOptions(object_size=16 << 20))
    big = {"a": torch.ones(2 << 20), "big": torch.randn(96 << 20 >> 2)}
    print("saving", flush=True)
    mgr.save(2, big)
    print("saved", flush=True)
""")


def _wait_until_still(snapshot, quiet_s: float = 2.0, limit_s: float = 60.0) -> None:
    """Return once ``snapshot()`` has not changed for ``quiet_s`` seconds (at most ``limit_s``)."""
    last, since, deadline = snapshot(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, "the store kept changing after the kill"
        time.sleep(0.25)
        now = snapshot()
        if now != last:
            last, since = now, time.monotonic()


def test_killed_save_then_prune_removes_leftovers(s3_env, s3_url, tmp_path):
    mgr = CheckpointManager(s3_url, abandoned_after=0)
    mgr.save(1, state(1))
    script = tmp_path / "killed_save.py"
    script.write_text(KILLED_SAVE)
    proc = subprocess.Popen(
        [sys.executable, str(script), s3_url],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not run_uploads(s3_env, s3_url):  # kill while a multipart upload is in flight
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no multipart upload was seen"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert any(k.startswith(step_dir(2)) for k in run_uploads(s3_env, s3_url))
    # requests the saver had sent before the kill may still land (a loaded server finishes them
    # later); prune with abandoned_after=0 judges what is there, so wait until the step is still
    # (in production the grace period, an hour by default, covers this)
    _wait_until_still(
        lambda: (sorted(run_keys(s3_env, s3_url)), sorted(run_uploads(s3_env, s3_url)))
    )
    assert mgr.latest().step == 1
    assert [(i.step, i.complete) for i in mgr.list()][0] == (1, True)
    sd = blank()
    assert mgr.load(sd) == 1
    assert_state(sd, 1)
    removed = mgr.prune()
    assert [(i.step, i.complete) for i in removed] == [(2, False)]
    assert not any(k.startswith(step_dir(2)) for k in run_keys(s3_env, s3_url))
    assert run_uploads(s3_env, s3_url) == []
    assert [i.step for i in mgr.list()] == [1]


CONCURRENT_PRUNER = textwrap.dedent("""
    import os, sys, time
    from cloudckpt import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=1)
    mgr.prune()
    print("ready", flush=True)
    rounds = 1
    while not os.path.exists(sys.argv[2]):
        mgr.prune()
        rounds += 1
    print(rounds, flush=True)
""")


def test_prune_concurrent_with_save(s3_env, s3_url, tmp_path):
    import cloudckpt

    mgr = CheckpointManager(s3_url, save_options=SaveOptions(object_size=4 << 20))
    mgr.save(1, state(1))
    stop = tmp_path / "stop"
    script = tmp_path / "pruner.py"
    script.write_text(CONCURRENT_PRUNER)
    proc = subprocess.Popen(
        [sys.executable, str(script), s3_url, str(stop)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        n = 6 << 20
        for step in (2, 3, 4):
            sd = state(step, n)
            mgr.save(step, sd)
            check = blank(n)
            assert mgr.load(check, step=step) == step
            assert_state(check, step, n)
            assert cloudckpt.verify(mgr.step_url(step)).ok
    finally:
        stop.write_text("stop")
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert int(out.strip()) >= 2
    assert mgr.latest().step == 4
    assert [i.step for i in mgr.list()] == [4]


def _damage_manifest(s3_server, url: str, step: int, how: str) -> None:
    """Rewrite step ``step``'s manifest in place (boto3): one flipped byte, cut short, or bytes
    that are not a manifest at all."""
    bucket, _, root = url[len("s3://") :].partition("/")
    key = f"{root}/{step_dir(step)}manifest.msgpack"
    client = s3_server.boto3_client()
    raw = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    if how == "flip":
        raw[len(raw) // 2] ^= 0x40
    elif how == "truncate":
        raw = raw[: len(raw) // 3]
    else:
        raw = bytearray(b"not a manifest at all")
    client.put_object(Bucket=bucket, Key=key, Body=bytes(raw))


@pytest.mark.parametrize("how", ["flip", "truncate", "garbage"])
def test_a_damaged_manifest_is_listed_as_damaged_and_the_others_still_are(
    s3_env, s3_url, s3_server, how
):
    mgr = CheckpointManager(s3_url)
    for step in (1, 2, 3):
        mgr.save(step, state(step))
    _damage_manifest(s3_server, s3_url, 2, how)

    infos = mgr.list(details=True)
    assert [i.step for i in infos] == [1, 2, 3]
    assert [i.damaged is not None for i in infos] == [False, True, False]
    assert infos[0].total_bytes == infos[2].total_bytes > 0

    env = {**os.environ, "PYTHONPATH": REPO}
    res = run_cli(["ls", "--details", s3_url], cwd=REPO, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    rows = {line.split()[0]: line for line in res.stdout.splitlines()[1:]}
    assert "DAMAGED" in rows["2"] and "DAMAGED" not in rows["1"] + rows["3"]
    assert f"step 2: cannot be loaded: {infos[1].damaged}" in res.stderr
    res = run_cli(["ls", "--json", s3_url], cwd=REPO, env=env, timeout=120)
    import json

    assert [d["damaged"] is not None for d in json.loads(res.stdout)] == [False, True, False]


@pytest.mark.parametrize("entry", ["manager", "cli"])
def test_prune_never_removes_the_newest_loadable_checkpoint_behind_a_damaged_one(
    s3_env, s3_url, s3_server, entry
):
    mgr = CheckpointManager(s3_url)
    for step in (1, 2, 3, 4):
        mgr.save(step, state(step))
    _damage_manifest(s3_server, s3_url, 4, "flip")
    _damage_manifest(s3_server, s3_url, 3, "garbage")

    if entry == "manager":
        CheckpointManager(s3_url, keep_last=1).prune()
    else:
        res = run_cli(
            ["prune", "--keep-last", "1", s3_url],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            timeout=120,
        )
        assert res.returncode == 0, res.stderr
        assert "step 4: its manifest is damaged" in res.stderr
    # the newest (damaged) step is kept as always, and so is step 2, the newest that loads;
    # the damaged step 3 and the old step 1 go
    assert [i.step for i in mgr.list()] == [2, 4]
    target = blank()
    mgr.load(target, step=2)
    assert_state(target, 2)
