"""The ``cloudckpt`` command behaves like ``aws s3`` / ``gsutil``: every user mistake is one line
on stderr and exit 2; ``--version``; ``--json`` on ls/show/verify/prune; ``--endpoint-url``,
``--profile`` and ``--timeout`` on every command, before or after its name; help on every option.
Run as subprocesses against the session's SeaweedFS."""

from __future__ import annotations

import argparse
import json
import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.cli.documents import jsonable
from cloudckpt.cli.main import build_parser
from cloudckpt.layout import step_dir
from tests.reliability.stores import RawCheckpoint, cli

COMMANDS = ("ls", "show", "verify", "prune", "rm", "export", "convert")


def state(step: int) -> dict:
    return {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3) * step,
        "step": step,
        "name": "run-b",
        "blob": b"\x00\x01",
        "pair": (1, 2),
    }


@pytest.fixture
def run2(s3_env, s3_url):
    """A run with complete checkpoints at steps 10 and 20."""
    mgr = CheckpointManager(s3_url)
    for step in (10, 20):
        mgr.save(step, state(step))
    return s3_url


def _one_line_error(res, args) -> str:
    assert res.returncode == 2, (args, res.returncode, res.stdout, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, (args, res.stderr)
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
    assert res.stdout == "", (args, res.stdout)
    return lines[0]


def test_user_mistakes_are_one_line_and_exit_2(s3_env, run2, tmp_path):
    ckpt = f"{run2}/{step_dir(10)}".rstrip("/")
    (tmp_path / "a-folder.pt").mkdir()
    missing_dir = tmp_path / "no-such-folder" / "model.safetensors"
    cases = [
        # (args, env overrides, text expected in the one stderr line)
        (["ls", run2], {"AWS_ENDPOINT_URL": "127.0.0.1:1"}, "http:// or https://"),
        (["ls", run2], {"AWS_ENDPOINT_URL_S3": "localhost:9000"}, "AWS_ENDPOINT_URL_S3"),
        (["--endpoint-url", "127.0.0.1:1", "ls", run2], {}, "http:// or https://"),
        (["show", ckpt, "--endpoint-url", "s3://bucket"], {}, "http:// or https://"),
        (["--profile", "no-such-profile", "verify", ckpt], {}, "no-such-profile"),
        (["ls", ckpt], {}, f"cloudckpt show {ckpt}"),
        (["ls", ckpt, "--json"], {}, "is a checkpoint, not a run"),
        (["prune", ckpt, "--keep-last", "0"], {}, "is a checkpoint, not a run"),
        (["export", run2, str(missing_dir)], {}, "does not exist"),
        (["export", run2, str(tmp_path / "a-folder.pt")], {}, "is a folder"),
        (["export", run2, str(tmp_path / "out.txt")], {}, "OUT must end"),
        (["show", run2, "--step", "-1"], {}, "--step"),
        (["show", run2, "--step", "ten"], {}, "whole number"),
        (["verify", ckpt, "--step", "10"], {}, "drop --step"),
        (["rm", ckpt, "--step", "10"], {}, "drop --step"),
        (["export", ckpt, str(tmp_path / "m.pt"), "--step", "10"], {}, "drop --step"),
        (["--timeout", "0", "ls", run2], {}, "--timeout"),
        (["ls", run2, "--timeout", "soon"], {}, "--timeout"),
        (["prune", run2], {}, "--keep-last"),
        (["prune", run2, "--keep-last", "-1"], {}, "--keep-last"),
        (["prune", run2, "--keep-last", "1", "--keep-every", "0"], {}, "--keep-every"),
        (["prune", run2, "--keep-last", "1", "--abandoned-after", "nan"], {}, "seconds"),
        (["frobnicate", run2], {}, "invalid choice"),
        ([], {}, "required"),
        (["ls"], {}, "required"),
        (["ls", run2, "--no-such-option"], {}, "unrecognized"),
        (["ls", "ftp://nowhere/run"], {}, "error"),
        (["rm", run2], {}, "is a run"),
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda c: cli(s3_env, *c[0], **c[1]), cases))
    for (args, _, text), res in zip(cases, results):
        line = _one_line_error(res, args)
        assert text in line, (args, line)
    # nothing was changed, nothing written
    assert [i.step for i in CheckpointManager(run2).list()] == [10, 20]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-folder.pt"]


def test_an_empty_run_is_not_a_mistake(s3_env, s3_url):
    res = cli(s3_env, "ls", s3_url)
    assert res.returncode == 0, res.stderr
    assert res.stdout == "" and res.stderr.strip() == f"no checkpoints under {s3_url}"
    res = cli(s3_env, "ls", s3_url, "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == []


def test_version():
    res = cli(None, "--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"cloudckpt {cloudckpt.__version__}"


def _all_parsers(parser: argparse.ArgumentParser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _all_parsers(sub)


def test_every_option_has_help_and_every_command_takes_the_global_options():
    parsers = list(_all_parsers(build_parser()))
    assert {p.prog.split()[-1] for p in parsers[1:]} == set(COMMANDS)
    for parser in parsers:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help != argparse.SUPPRESS, (parser.prog, action.dest)
        options = {s for a in parser._actions for s in a.option_strings}
        assert {"--endpoint-url", "--profile", "--timeout"} <= options, parser.prog
        if parser.prog.split()[-1] in ("ls", "show", "verify", "prune"):
            assert "--json" in options, parser.prog


def test_global_options_before_or_after_the_command(s3_env, run2, tmp_path):
    endpoint = s3_env.env()["AWS_ENDPOINT_URL"]
    # no endpoint in the environment: the option alone reaches the server, on either side
    for args in (
        ["--endpoint-url", endpoint, "ls", run2],
        ["ls", run2, "--endpoint-url", endpoint],
    ):
        res = cli(s3_env, *args, AWS_ENDPOINT_URL=None)
        assert res.returncode == 0, (args, res.stderr)
        assert [line.split()[0] for line in res.stdout.splitlines()[1:]] == ["10", "20"]
    # the option overrides the environment: a closed port, given up on within --timeout
    res = cli(s3_env, "--timeout", "2", "ls", run2, "--endpoint-url", "http://127.0.0.1:9")
    assert res.returncode == 1, res.stdout + res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("cloudckpt ls: ")]
    assert len(errors) == 1 and errors[0].startswith("cloudckpt ls: error: "), res.stderr
    assert "Traceback" not in res.stderr and "127.0.0.1:9" in res.stderr  # retries are logged
    # --profile: credentials of a named profile, none in the environment
    creds = tmp_path / "credentials"
    creds.write_text(
        f"[ckpt]\naws_access_key_id = {s3_env.access_key}\n"
        f"aws_secret_access_key = {s3_env.secret_key}\n"
    )
    env = dict(
        AWS_SHARED_CREDENTIALS_FILE=str(creds), AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None
    )
    res = cli(s3_env, "verify", run2, "--profile", "ckpt", "--json", **env)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["ok"] is True
    res = cli(s3_env, "verify", run2, **env)
    assert res.returncode == 2 and "credentials" in res.stderr, res.stderr


def test_json_ls_show_verify(s3_env, run2):
    res = cli(s3_env, "ls", run2, "--json")
    assert res.returncode == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["step"] for r in rows] == [10, 20]
    for row in rows:
        assert set(row) == {
            "step",
            "name",
            "url",
            "complete",
            "created_at",
            "total_bytes",
            "objects",
            "world_size",
            "damaged",
        }
        assert row["damaged"] is None and row["name"] == step_dir(row["step"]).rstrip("/")
        assert row["complete"] is True and row["world_size"] == 1 and row["total_bytes"] == 24
        assert row["url"].rstrip("/").endswith(step_dir(row["step"]).rstrip("/"))
        assert "T" in row["created_at"] and row["created_at"][-6] in "+-"  # ISO 8601, offset

    res = cli(s3_env, "show", run2, "--step", "20", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert set(doc) >= {
        "url",
        "created_at",
        "world_size",
        "cloudckpt_version",
        "metadata",
        "tensors",
        "values",
    }
    assert doc["world_size"] == 1 and doc["cloudckpt_version"] == cloudckpt.__version__
    assert doc["tensors"] == [
        {"name": "w", "dtype": "float32", "shape": [2, 3], "chunks": 1, "bytes": 24}
    ]
    values = {v["name"]: v for v in doc["values"]}
    assert values["step"]["value"] == 20 and values["name"]["value"] == "run-b"
    assert values["pair"]["value"] == [1, 2]
    assert values["blob"]["value"] == repr(b"\x00\x01")  # not JSON: its repr

    url = f"{run2}/{step_dir(10)}"
    res = cli(s3_env, "verify", url, "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is True and doc["problems"] == [] and doc["objects_checked"] == 1
    assert doc["bytes_checked"] == 24 and isinstance(doc["notes"], list)
    raw = RawCheckpoint(url.rstrip("/"), s3_env)
    key = next(iter(cloudckpt.read_manifest(url).objects))
    raw.flip(key, 0)
    res = cli(s3_env, "verify", url, "--json")
    assert res.returncode == 1, res.stdout + res.stderr
    doc = json.loads(res.stdout)
    assert doc["ok"] is False and len(doc["problems"]) == 1
    assert key.rsplit("/", 1)[-1] in doc["problems"][0]


def test_json_prune(s3_env, run2):
    res = cli(s3_env, "prune", run2, "--keep-last", "1", "--dry-run", "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["dry_run"] is True and [r["step"] for r in doc["removed"]] == [10]
    entry = doc["removed"][0]
    assert set(entry) == {"step", "name", "url", "complete", "objects", "uploads", "left"}
    assert any(o.endswith("manifest.msgpack") for o in entry["objects"])
    assert all(o.startswith(run2) for o in entry["objects"])
    assert [i.step for i in CheckpointManager(run2).list()] == [10, 20]
    res = cli(s3_env, "prune", run2, "--keep-last", "1", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["dry_run"] is False
    assert [i.step for i in CheckpointManager(run2).list()] == [20]
    res = cli(s3_env, "prune", run2, "--keep-last", "1", "--json")
    assert json.loads(res.stdout) == {"dry_run": False, "removed": []}


@pytest.mark.parametrize(
    "value, expected",
    [
        (b"\x00", repr(b"\x00")),
        (2**70, repr(2**70)),
        (2**4000, "<int of 4001 bits>"),
        (math.inf, "inf"),
        (math.nan, "nan"),
        ((1, "a", None), [1, "a", None]),
        ({1: "x"}, repr({1: "x"})),
        ({"a": (True, 1.5)}, {"a": [True, 1.5]}),
        (torch.tensor([1]), repr(torch.tensor([1]))),
    ],
)
def test_values_json_cannot_hold_become_repr_strings(value, expected):
    out = jsonable(value)
    assert out == expected
    json.dumps(out, allow_nan=False)


def test_deep_nesting_stays_json():
    deep: list = []
    for _ in range(200):
        deep = [deep]
    json.dumps(jsonable(deep), allow_nan=False)


@pytest.mark.parametrize(
    "endpoint", ["127.0.0.1:1", "localhost:9000", "s3://bucket", "http://", "http://host:port", ""]
)
def test_python_api_refuses_an_endpoint_without_scheme_too(endpoint):
    from cloudckpt.errors import ConfigError
    from cloudckpt.storage import StorageOptions

    with pytest.raises(ConfigError, match="endpoint|URL") as info:
        StorageOptions(endpoint_url=endpoint)
    assert "\n" not in str(info.value)
    StorageOptions(endpoint_url="http://127.0.0.1:1")  # a URL with a scheme and a host is fine
    StorageOptions(endpoint_url="https://s3.eu-west-1.amazonaws.com")
