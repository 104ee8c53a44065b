"""Nothing is lost at exit: a script that ends while an asynchronous save runs still writes a
complete checkpoint; a save that fails then says so on stderr (naming the URL) and the exit
status is 1. Real subprocesses, LocalStore and SeaweedFS, single process and a 1-rank gloo group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cloudckpt
from tests.e2e.exit_script import state

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("exit_script.py")
LINE = "cloudckpt: the save to {url} did not complete before exit: "


def _run(entry: str, url: str, env: dict[str, str] | None = None, *extra: str):
    base = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    base.update(
        env or {},
        PYTHONPATH=str(REPO),
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        OMP_NUM_THREADS="1",
    )
    res = subprocess.run(
        [sys.executable, str(SCRIPT), entry, url, *extra],
        cwd=REPO,
        env=base,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # the test means something only if the save was still running when the script ended
    assert "running at the end: True" in res.stdout, (res.stdout, res.stderr)
    return res


def _assert_saved(url: str, step: int = 7) -> None:
    expected = state(step)
    blank = {"w": torch.zeros_like(expected["w"]), "b": torch.zeros(10), "step": 0}
    cloudckpt.load(blank, url)
    assert torch.equal(blank["w"], expected["w"]) and torch.equal(blank["b"], expected["b"])
    assert blank["step"] == step


def _target(kind: str, tmp_path: Path, s3_server, s3_url: str) -> tuple[str, dict]:
    if kind == "local":
        return str(tmp_path / "ckpt"), {}
    return s3_url, s3_server.env()


@pytest.mark.parametrize("kind", ["local", "s3"])
@pytest.mark.parametrize("entry", ["async_save", "manager"])
def test_a_save_running_at_exit_is_completed(entry, kind, tmp_path, s3_server, s3_url, monkeypatch):
    url, env = _target(kind, tmp_path, s3_server, s3_url)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    if entry == "manager":  # two earlier checkpoints, for the script's keep_last=2 to prune
        for step in (5, 6):
            cloudckpt.CheckpointManager(url).save(step, state(step))
    res = _run(entry, url, env)
    assert res.returncode == 0, res.stderr
    assert "cloudckpt:" not in res.stderr, res.stderr
    if entry == "async_save":
        _assert_saved(url)
    else:  # the save and the manager's follow-up work (keep_last=2 pruned step 5) both ran
        mgr = cloudckpt.CheckpointManager(url)
        assert [i.step for i in mgr.list()] == [6, 7]
        _assert_saved(mgr.step_url(7))


def test_under_a_gloo_group_a_save_running_at_exit_is_completed(tmp_path, s3_env, s3_url):
    res = _run("async_save", s3_url, s3_env.env(), "--gloo", str(tmp_path))
    assert res.returncode == 0, res.stderr
    assert "cloudckpt:" not in res.stderr, res.stderr
    _assert_saved(s3_url)


@pytest.mark.parametrize("end, status", [("raise", 1), ("exit3", 3)])
def test_the_script_keeps_its_own_exit_status(end, status, tmp_path):
    url = str(tmp_path / "ckpt")
    res = _run("async_save", url, {}, "--end", end)
    assert res.returncode == status, res.stderr
    assert "cloudckpt:" not in res.stderr, res.stderr
    _assert_saved(url)


def _failing_target(how: str, tmp_path: Path, s3_server, s3_url: str) -> tuple[str, dict]:
    if how == "read-only identity":  # reads (planning) work, every write is refused
        return s3_url, s3_server.readonly_env()
    if how == "missing bucket":
        return f"s3://missing-{s3_url.rsplit('-', 1)[1]}/run", s3_server.env()
    root = tmp_path / "ckpt"  # local: a file where the data directory must go
    root.mkdir()
    (root / "data").write_bytes(b"in the way")
    return str(root), {}


@pytest.mark.parametrize(
    "entry, how, gloo",
    [
        ("async_save", "read-only identity", False),
        ("manager", "read-only identity", False),
        ("async_save", "missing bucket", False),
        ("async_save", "local", False),
        ("async_save", "read-only identity", True),
    ],
)
def test_a_save_failing_at_exit_is_reported_and_exits_1(
    entry, how, gloo, tmp_path, s3_server, s3_url
):
    url, env = _failing_target(how, tmp_path, s3_server, s3_url)
    extra = ("--gloo", str(tmp_path)) if gloo else ()
    res = _run(entry, url, env, *extra)
    assert res.returncode == 1, (res.stdout, res.stderr)
    failed_url = cloudckpt.CheckpointManager(url).step_url(7) if entry == "manager" else url
    lines = [line for line in res.stderr.splitlines() if line.startswith("cloudckpt:")]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(LINE.format(url=failed_url)), res.stderr
    assert (
        "AccessDenied" if "read-only" in how else "BucketNotFound" if "bucket" in how else "Error"
    ) in lines[0]


def test_cloudckpt_first_used_during_exit_imports_cleanly():
    """Importing the runtime from an atexit handler (threading hooks closed by then) is fine."""
    code = (
        "import atexit, importlib\n"
        "atexit.register(lambda: "
        "print(importlib.import_module('cloudckpt.runtime.loop').__name__))\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert (res.returncode, res.stdout, res.stderr) == (0, "cloudckpt.runtime.loop\n", "")
