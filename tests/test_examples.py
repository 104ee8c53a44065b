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
    env.update(PYTHONPATH=str(REPO), AWS_CONFIG_FILE=os.devnull,
               AWS_SHARED_CREDENTIALS_FILE=os.devnull, OMP_NUM_THREADS="1", **extra)
    return env


def _smoke(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "examples/smoke.py", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)


def test_smoke_uses_the_endpoint_in_the_environment(s3_server, monkeypatch):
    res = _smoke(_env(**s3_server.env()))
    assert res.returncode == 0, res.stderr
    assert (f"using the S3 endpoint in AWS_ENDPOINT_URL ({s3_server.endpoint_url}), "
            f"bucket {s3_server.bucket}") in res.stdout
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
