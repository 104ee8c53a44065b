"""The ``cloudckpt`` command, run as a process (a child of the CLI fork server) against the
session's SeaweedFS."""

from __future__ import annotations

import pytest
import torch

from cloudckpt import CheckpointManager
from cloudckpt.layout import step_dir
from tests.cli_forkserver import run_cli
from tests.reliability.stores import REPO, cli, cli_env


def state(step: int) -> dict:
    return {
        "layer": {
            "weight": torch.arange(12, dtype=torch.float32).reshape(3, 4) * step,
            "bias": torch.full((4,), step, dtype=torch.bfloat16),
        },
        "step": step,
        "name": "run-a",
    }


@pytest.fixture
def run3(s3_env, s3_url):
    """A run with complete checkpoints at steps 10, 20, 30."""
    mgr = CheckpointManager(s3_url)
    for step in (10, 20, 30):
        mgr.save(step, state(step))
    return s3_url


def test_ls(s3_env, run3):
    res = cli(s3_env, "ls", run3)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.strip().splitlines()
    assert lines[0].split() == ["step", "time", "size", "objects", "world_size", "complete"]
    rows = [line.split() for line in lines[1:]]
    assert [r[0] for r in rows] == ["10", "20", "30"]
    assert all(r[-1] == "yes" and r[-2] == "1" for r in rows)


def test_show(s3_env, run3):
    res = cli(s3_env, "show", run3, "--step", "20")
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert step_dir(20).rstrip("/") in out
    weight = next(line.split() for line in out.splitlines() if line.startswith("layer.weight"))
    assert weight[1:] == ["float32", "(3,", "4)", "1", "48"]
    bias = next(line.split() for line in out.splitlines() if line.startswith("layer.bias"))
    assert bias[1] == "bfloat16"
    assert any(line.split()[:3] == ["name", "str", "'run-a'"] for line in out.splitlines())
    # a run URL without --step shows the newest complete checkpoint
    res = cli(s3_env, "show", run3)
    assert res.returncode == 0 and step_dir(30).rstrip("/") in res.stdout
    assert "step 30" in res.stderr


def test_verify_ok_and_corrupted(s3_env, run3):
    url = f"{run3}/{step_dir(10)}"
    res = cli(s3_env, "verify", url)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("OK")
    bucket, _, root = run3[len("s3://") :].partition("/")
    client = s3_env.boto3_client()
    listing = client.list_objects_v2(Bucket=bucket, Prefix=f"{root}/{step_dir(10)}data/")
    key = listing["Contents"][0]["Key"]
    body = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    body[0] ^= 0xFF
    client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    res = cli(s3_env, "verify", url)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.startswith("FAILED") and key.rsplit("/", 1)[1] in res.stdout
    assert "Traceback" not in res.stderr


def test_prune(s3_env, run3):
    res = cli(s3_env, "prune", run3, "--keep-last", "1", "--keep-every", "20", "--dry-run")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split().count("would") == 1 and "step 10 " in res.stdout
    assert [i.step for i in CheckpointManager(run3).list()] == [10, 20, 30]
    res = cli(s3_env, "prune", run3, "--keep-last", "1", "--keep-every", "20")
    assert res.returncode == 0, res.stderr
    assert "removed step 10 " in res.stdout
    assert [i.step for i in CheckpointManager(run3).list()] == [20, 30]


def test_rm(s3_env, run3):
    res = cli(s3_env, "rm", run3, "--step", "20")
    assert res.returncode == 0, res.stderr
    assert "removed" in res.stdout
    assert [i.step for i in CheckpointManager(run3).list()] == [10, 30]
    res = cli(s3_env, "rm", f"{run3}/{step_dir(30)}")
    assert res.returncode == 0, res.stderr
    assert [i.step for i in CheckpointManager(run3).list()] == [10]


def test_export(s3_env, run3, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "model.safetensors"
    res = cli(s3_env, "export", run3, str(out), "--step", "20")
    assert res.returncode == 0, res.stderr
    tensors = load_file(str(out))
    ref = state(20)
    assert set(tensors) == {"layer.weight", "layer.bias"}
    assert torch.equal(tensors["layer.weight"], ref["layer"]["weight"])
    assert torch.equal(tensors["layer.bias"], ref["layer"]["bias"])
    pt = tmp_path / "full.pt"
    res = cli(s3_env, "export", run3, str(pt))
    assert res.returncode == 0, res.stderr
    loaded = torch.load(str(pt), weights_only=True)
    ref = state(30)
    assert torch.equal(loaded["layer"]["weight"], ref["layer"]["weight"])
    assert loaded["step"] == 30 and loaded["name"] == "run-a"


def test_error_cases_exit_cleanly(s3_env, s3_url, tmp_path):
    mgr = CheckpointManager(s3_url)
    mgr.save(1, state(1))
    cases = [
        # (args, env overrides, expected status, text expected in stderr)
        (["ls", "ftp://nowhere/run"], {}, 2, "error"),
        (
            ["ls", s3_url],
            {"AWS_ACCESS_KEY_ID": None, "AWS_SECRET_ACCESS_KEY": None},
            2,
            "credentials",
        ),
        (["ls", s3_url], {"AWS_SECRET_ACCESS_KEY": "wrong-secret"}, 2, "error"),
        (["ls", "s3://no-such-bucket-cloudckpt/run"], {}, 2, "error"),
        (["show", f"{s3_url}/nothing-here"], {}, 1, "no complete checkpoint"),
        (["verify", s3_url, "--step", "7"], {}, 1, "error"),
        (["rm", s3_url], {}, 2, "is a run"),
        (["rm", f"{s3_url}/{step_dir(99)}"], {}, 1, "nothing to remove"),
        (["export", s3_url, str(tmp_path / "out.txt")], {}, 2, "OUT must end"),
        (["prune", s3_url], {}, 2, "--keep-last"),
    ]
    for args, env, status, text in cases:
        res = run_cli(args, cwd=REPO, env=cli_env(s3_env, **env), timeout=180)
        out, err = res.stdout, res.stderr
        assert res.returncode == status, (args, out, err)
        assert text in err, (args, err)
        assert "Traceback" not in err, (args, err)
    assert [i.step for i in mgr.list()] == [1]
