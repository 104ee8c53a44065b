"""examples/smoke.py in its three modes, and the output helpers of examples/demo.sh."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import cloudckpt

REPO = Path(__file__).resolve().parents[1]


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        PYTHONPATH=str(REPO),
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        OMP_NUM_THREADS="1",
        **extra,
    )
    return env


def _smoke(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "examples/smoke.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_smoke_uses_the_endpoint_in_the_environment(s3_server, monkeypatch):
    res = _smoke(_env(**s3_server.env()))
    assert res.returncode == 0, res.stderr
    assert (
        f"using the S3 endpoint in AWS_ENDPOINT_URL ({s3_server.endpoint_url}), "
        f"bucket {s3_server.bucket}"
    ) in res.stdout
    assert "private" not in res.stdout
    url = re.search(r"the checkpoint stays at (\S+);", res.stdout).group(1)
    assert url.startswith(f"s3://{s3_server.bucket}/smoke/")
    for key, value in s3_server.env().items():
        monkeypatch.setenv(key, value)
    assert cloudckpt.verify(url).ok  # the URL it printed exists on the user's endpoint


def test_smoke_names_a_missing_bucket_in_one_line(s3_server):
    res = _smoke(_env(**s3_server.env()), "--bucket", "no-such-smoke-bucket")
    assert res.returncode == 1
    assert res.stderr.startswith("smoke: FAILED: ")
    assert "the bucket 'no-such-smoke-bucket' does not exist" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_smoke_without_an_endpoint_starts_and_removes_its_own_server():
    res = _smoke(_env())
    assert res.returncode == 0, res.stderr
    assert "AWS_ENDPOINT_URL is not set: starting a private local S3 server" in res.stdout
    assert "verify: ok" in res.stdout
    assert "are gone now" in res.stdout


# -- examples/demo.sh's output helpers (examples/demo_lib.sh) ---------------------------------

TORCHRUN_SUMMARY = """\
[2026-11-30 12:00:00] torch.distributed.elastic.multiprocessing.api: WARNING Sending process 7 closing signal SIGTERM
============================================================
examples/train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_12:00:01
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : 143 (pid: 8)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_12:00:00
  host      : node
  rank      : 0 (local_rank: 0)
  exitcode  : -9 (pid: 7) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 7
============================================================
"""  # noqa: E501 - torchrun's own output, verbatim


def _demo_lib(script: str, tmp_path: Path) -> str:
    """Run `script` in bash after sourcing demo_lib.sh; stdout is a pipe, not a terminal."""
    res = subprocess.run(
        ["bash", "-c", f". examples/demo_lib.sh\n{script}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PY": sys.executable, "TMPDIR": str(tmp_path)},
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_demo_titles_have_no_escape_codes_off_a_terminal(tmp_path):
    out = _demo_lib("say training on 2 processes", tmp_path)
    assert out == "\n== training on 2 processes\n"
    assert "\x1b" not in out


def test_demo_explains_exit_statuses_in_plain_words(tmp_path):
    out = _demo_lib("for c in 0 1 130 137 143 139 3; do explain_status $c; done", tmp_path)
    lines = out.splitlines()
    assert lines[0] == "finished normally"
    assert "non-zero" in lines[1]
    assert lines[2].startswith("interrupted by Ctrl-C")
    assert lines[3].startswith("killed by SIGKILL (137 = 128 + 9)")
    assert lines[4].startswith("stopped by SIGTERM (143 = 128 + 15), as a spot preemption")
    assert lines[5] == "ended by signal 11 (139 = 128 + 11)"
    assert lines[6] == "failed with status 3"


def test_demo_explains_each_rank_of_a_torchrun_summary(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(TORCHRUN_SUMMARY)
    out = _demo_lib(f"explain_ranks {log}", tmp_path)
    assert out.splitlines() == [
        "rank 0 exited with 137: killed by SIGKILL (137 = 128 + 9), as when a node dies: "
        "no chance to save anything",
        "rank 1 exited with 143: stopped by SIGTERM (143 = 128 + 15), as a spot preemption or "
        "'kubectl delete pod' does",
    ]
    log.write_text("no summary here\n")
    assert _demo_lib(f"explain_ranks {log}", tmp_path) == ""


def test_demo_install_step_shows_progress_and_failures(tmp_path):
    out = _demo_lib(
        "pip_step 'a missing wheel' --no-index --find-links . "
        "no-such-package-cloudckpt || echo status=$?",
        tmp_path,
    )
    assert out.startswith("  installing a missing wheel ...\n")
    assert "status=1" in out
    ok = _demo_lib("pip_step 'an installed package' --no-index pip", tmp_path)
    assert ok.splitlines()[0] == "  installing an installed package ..."
    assert re.fullmatch(r"  installed an installed package in \d+ s", ok.splitlines()[-1])
    assert not list(tmp_path.glob("cloudckpt-demo-pip.*"))  # its log is removed
