"""SIGTERM on one rank of two: both ranks save the same step and exit; a world of one resumes."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import torch

from cloudckpt import CheckpointManager
from cloudckpt.layout import step_dir


def train_until_preempted(url: str, progress_dir: str) -> dict | None:
    """Runs on every rank: resume, train (w += 1 per step), stop when any rank gets SIGTERM."""
    import torch.distributed as dist

    from cloudckpt.runs.preemption import Preempted, PreemptionHandler

    rank = dist.get_rank()
    mgr = CheckpointManager(url, keep_last=2)
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    with PreemptionHandler(mgr, check_every=1) as handler:
        start = handler.resume(sd) or 0
        try:
            for step in range(start + 1, 100_000):
                sd["w"] += 1
                sd["progress"]["step"] = step
                Path(progress_dir, f"rank{rank}").write_text(str(step))
                time.sleep(0.01)
                handler.checkpoint_if_preempted(step, sd)
        except Preempted as exc:
            return {
                "step": exc.step,
                "code": exc.code,
                "signum": exc.signum,
                "w": float(sd["w"][0]),
                "resumed_from": start,
            }
    return None


def resume_everywhere(url: str) -> tuple[int | None, float]:
    mgr = CheckpointManager(url)
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    step = mgr.load(sd)
    return step, float(sd["w"][0])


def test_sigterm_on_one_rank_saves_same_step_and_resumes(world2, s3_env, s3_url, tmp_path):
    outcome: dict = {}

    def run():
        try:
            outcome["results"] = world2.run(
                train_until_preempted, s3_url, str(tmp_path), timeout=180
            )
        except BaseException as exc:  # surfaced by the asserts below
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    marker = tmp_path / "rank1"
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text() and int(marker.read_text()) >= 5):
        assert thread.is_alive(), outcome
        assert time.monotonic() < deadline, "rank 1 made no progress"
        time.sleep(0.02)
    os.kill(world2.pids[1], signal.SIGTERM)
    thread.join(180)
    assert "error" not in outcome, outcome.get("error")
    r0, r1 = outcome["results"]
    assert r0["step"] == r1["step"] >= 5
    assert r0["code"] == r1["code"] == 143
    assert r1["signum"] == signal.SIGTERM and r0["signum"] is None
    assert r0["w"] == r1["w"] == r0["step"]

    # both ranks agree on the latest step when resuming together
    assert world2.run(resume_everywhere, s3_url) == [(r0["step"], float(r0["step"]))] * 2

    # restart with world size 1 (this process)
    mgr = CheckpointManager(s3_url)
    assert [i.step for i in mgr.list()] == [r0["step"]]
    sd = {"w": torch.zeros(16), "progress": {"step": 0}}
    assert mgr.load(sd) == r0["step"]
    assert torch.equal(sd["w"], torch.full((16,), float(r0["step"])))
    assert sd["progress"] == {"step": r0["step"]}


def fail_while_listing(url: str, which: str) -> dict:
    """Every rank: a manager whose store refuses rank 0's credentials (rank 0 is the only rank
    that lists), then the collective step that lists; returns what each rank raised."""
    import torch.distributed as dist

    from cloudckpt.runs.preemption import PreemptionHandler
    from cloudckpt.storage import StorageOptions

    rank = dist.get_rank()
    mgr = CheckpointManager(
        url, storage=StorageOptions(access_key_id="nobody", secret_access_key="wrong-secret")
    )
    handler = PreemptionHandler(mgr, timeout=120.0)  # far longer than the harness's 60 s
    try:
        if which == "save_and_exit":
            if rank == 1:
                handler.request()
            assert handler.should_stop(1)
            handler.save_and_exit(1, {"w": torch.zeros(4)})
        else:
            mgr.load({"w": torch.zeros(4)})
    except Exception as exc:
        return {
            "raised": True,
            "types": [c.__name__ for c in type(exc).__mro__],
            "message": str(exc),
        }
    return {"raised": False}


def test_listing_failure_on_rank_0_fails_every_rank_at_once(world2, s3_url):
    """Rank 0's listing raising makes both ranks raise the same error, well before the 120 s
    collective timeout: the harness gives the call 60 s, so a rank left waiting for the
    timeout fails this test with WorldTimeoutError."""
    for which in ("save_and_exit", "load"):
        results = world2.run(fail_while_listing, s3_url, which, timeout=60)
        assert [r["raised"] for r in results] == [True, True], (which, results)
        assert results[0]["types"] == results[1]["types"], (which, results)
        assert results[0]["message"] == results[1]["message"], (which, results)
        assert "CheckpointError" in results[0]["types"] and "AccessDenied" in results[0]["types"], (
            which,
            results,
        )
        assert "failed on rank 0 " in results[0]["message"], (which, results)


def check_while_saving_in_background(url: str) -> dict:
    """Every rank: an async save in flight while the training loop keeps checking for a stop;
    the first rank whose save is done asks for the stop, so every rank checks equally often."""
    from cloudckpt.runs.preemption import PreemptionHandler

    mgr = CheckpointManager(url)
    handler = PreemptionHandler(mgr)
    sd = {"w": torch.arange(4 << 20, dtype=torch.float32), "step": 1}
    handle = mgr.save(1, sd, blocking=False)
    handle.add_done_callback(lambda _h: handler.request())
    checks = 1
    while not handler.should_stop(checks):
        checks += 1
    return {"checks": checks, "bytes": handle.result().bytes_written}


def test_stop_checks_run_alongside_a_background_save(world2, s3_url):
    """The stop checks (training thread) and an async save's phases (background thread) use
    different gloo groups, so neither corrupts nor blocks the other."""
    results = world2.run(check_while_saving_in_background, s3_url, timeout=120)
    assert results[0]["checks"] == results[1]["checks"]
    assert results[0]["bytes"] == results[1]["bytes"] == 16 << 20
    loaded = world2.run(resume_everywhere_w, s3_url)
    assert loaded == [1, 1]


def resume_everywhere_w(url: str) -> int | None:
    sd = {"w": torch.zeros(4 << 20), "step": 0}
    step = CheckpointManager(url).load(sd)
    assert torch.equal(sd["w"], torch.arange(4 << 20, dtype=torch.float32)) and sd["step"] == 1
    return step


def resume_with_a_damaged_newest(url: str) -> dict:
    """Every rank: three saves, then (rank 0, between barriers) step 3's manifest replaced by
    bytes that are not a manifest; the default resume, then an explicit one of the step the
    error names."""
    import torch.distributed as dist

    from cloudckpt.runtime.loop import run_coroutine

    mgr = CheckpointManager(url)
    for step in (1, 2, 3):
        mgr.save(step, {"w": torch.full((8,), float(step))})
    dist.barrier()
    if dist.get_rank() == 0:
        run_coroutine(mgr.store.put(step_dir(3) + "manifest.msgpack", b"not a manifest"))
    dist.barrier()
    sd = {"w": torch.zeros(8)}
    outcome: dict = {}
    try:
        mgr.load(sd)
        outcome["raised"] = False
    except Exception as exc:
        outcome.update(raised=True, types=[c.__name__ for c in type(exc).__mro__], message=str(exc))
    outcome["untouched"] = bool(torch.equal(sd["w"], torch.zeros(8)))
    outcome["explicit"] = mgr.load(sd, step=2)
    outcome["loaded"] = sd["w"].tolist()
    return outcome


def test_a_damaged_newest_manifest_fails_every_rank_naming_the_step_that_loads(world2, s3_url):
    """The default resume never falls back on an older step by itself (that would silently
    lose training): every rank raises the same ManifestError, loads nothing, and is told which
    step decodes; loading that step works."""
    results = world2.run(resume_with_a_damaged_newest, s3_url, timeout=120)
    for r in results:
        assert r["raised"] and "ManifestError" in r["types"] and "ValueError" in r["types"], r
        assert r["untouched"] and r["explicit"] == 2 and r["loaded"] == [2.0] * 8, r
    assert results[0]["message"] == results[1]["message"]
    message = results[0]["message"]
    assert "step 3" in message and "load(state_dict, step=2)" in message, message
