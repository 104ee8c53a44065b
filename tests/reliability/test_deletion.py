"""Deletion deletes only what it owns (issue 13), on LocalStore and S3, through every entry point:
``CheckpointManager.delete`` / ``plan_delete`` / ``prune`` / ``prune_plans``, the clean-up of
killed attempts after a save, ``cloudckpt rm`` (``--step N``, a step URL, a plain checkpoint URL)
and ``cloudckpt prune``, each with and without ``--dry-run``.

Generated cases put random *foreign* keys (a user's notes, near misses of the layout's names,
another run's folder, uploads of such keys) next to the layout's own keys (manifests, data
objects of several attempts, unfinished uploads of both) in a run. The generator labels every
key itself; the checks compare raw listings (boto3, the filesystem) before and after: exactly
the owned keys of the deleted checkpoints are gone, everything else is byte-for-byte where it
was, and a dry run lists exactly what the real run then removes.
"""

from __future__ import annotations

import os
import random
import re
import secrets
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cloudckpt import CheckpointManager
from cloudckpt.errors import AccessDenied
from cloudckpt.layout import (
    MANIFEST_KEY,
    data_key,
    data_key_attempt,
    owned_key,
    parse_pin_key,
    step_dir,
)
from tests.reliability.stores import cli

pytestmark = pytest.mark.timeout(600)

#: Generated layouts per store for the Python entry points / for the CLI (each CLI case runs
#: 8 commands).
API_CASES = {
    "local": int(os.environ.get("CLOUDCKPT_DELETION_CASES", "200")),
    "s3": int(os.environ.get("CLOUDCKPT_S3_DELETION_CASES", "30")),
}
CLI_CASES = {"local": 2, "s3": 2}
_TMP_RE = re.compile(r"^\.(?P<name>.+)\.cloudckpt-tmp-[0-9a-f]{16}$")


# -- raw access to a store, behind cloudckpt's back -----------------------------------------------


class Raw:
    """Objects and unfinished uploads under ``url`` (boto3 for S3, the filesystem otherwise),
    keys relative to ``url``. On a local path an upload is a LocalStore temporary file
    ``.<name>.cloudckpt-tmp-<16 hex>``; its id is that file name."""

    def __init__(self, url: str, s3_server=None):
        self.url = url.rstrip("/")
        if url.startswith("s3://"):
            self.bucket, _, self.root = self.url[len("s3://") :].partition("/")
            self.client = s3_server.boto3_client()
        else:
            self.client, self.path = None, Path(self.url)

    def put(self, key: str, data: bytes = b"x") -> None:
        if self.client is not None:
            self.client.put_object(Bucket=self.bucket, Key=f"{self.root}/{key}", Body=data)
            return
        path = self.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def start_upload(self, key: str) -> str:
        if self.client is not None:
            return self.client.create_multipart_upload(
                Bucket=self.bucket, Key=f"{self.root}/{key}"
            )["UploadId"]
        path = self.path / key
        path.parent.mkdir(parents=True, exist_ok=True)
        name = f".{path.name}.cloudckpt-tmp-{secrets.token_hex(8)}"
        (path.parent / name).write_bytes(b"partial")
        return name

    def snapshot(self) -> tuple[dict[str, bytes], set[tuple[str, str]]]:
        """({key: content}, {(key, upload id)})."""
        objects: dict[str, bytes] = {}
        uploads: set[tuple[str, str]] = set()
        if self.client is not None:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.root + "/"
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    objects[obj["Key"][len(self.root) + 1 :]] = obj["ETag"].encode()
            resp = self.client.list_multipart_uploads(
                Bucket=self.bucket, Prefix=self.root + "/", MaxUploads=1000
            )
            assert not resp.get("IsTruncated")
            uploads = {
                (u["Key"][len(self.root) + 1 :], u["UploadId"]) for u in resp.get("Uploads", [])
            }
            return objects, uploads
        for dirpath, _, files in os.walk(self.path):
            rel_dir = os.path.relpath(dirpath, self.path)
            rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/") + "/"
            for name in files:
                m = _TMP_RE.match(name)
                if m:
                    uploads.add((rel_dir + m["name"], name))
                else:
                    objects[rel_dir + name] = (Path(dirpath) / name).read_bytes()
        return objects, uploads


# -- generated layouts -----------------------------------------------------------------------------


def _attempt(rng: random.Random) -> str:
    while True:
        a = "".join(rng.choice("0123456789abcdef") for _ in range(16))
        if a.upper() != a:  # has a letter: its upper-case twin is a near miss, not itself
            return a


def _foreign_in_step(rng: random.Random, a: str) -> str:
    """A key under a step folder that is *not* the layout's, however close it looks."""
    return rng.choice(
        [
            "README.md",
            "notes/today.txt",
            "data/README",
            "data/notes.txt",
            f"data/{a}/r00000-0000.bin.bak",
            f"data/{a}/R00000-0000.bin",
            f"data/{a.upper()}/r00000-0000.bin",
            f"data/{a[:15]}/r00000-0000.bin",
            f"data/{a}0/r00000-0000.bin",
            f"data/{a}/r0000-0000.bin",
            f"data/{a}/r00000-000.bin",
            f"data/{a}/r000001-0000.bin",
            f"data/{a}/r00000-00001.bin",
            f"data/{a}/sub/r00000-0000.bin",
            f"data/{a}/r00000-0000.binx",
            f"data/{a}/r00000_0000.bin",
            f"data/{a}/r-0001-0000.bin",
            "manifest.msgpack.old",
            "Manifest.msgpack",
            "manifest.msgpack~",
            "old/manifest.msgpack",
            f"old/data/{a}/r00000-0000.bin",
            "step-000000000001/manifest.msgpack",
            f"step-000000000001/data/{a}/r00000-0000.bin",
            f"data/{a}/r00000-0000.bin.d/x",
        ]
    )


def _foreign_in_run(rng: random.Random, a: str) -> str:
    return rng.choice(
        [
            "README.md",
            "step-000000000001.txt",
            # a folder of any name is a checkpoint folder: near misses of the layout inside one
            "step-1/manifest.msgpack.old",
            f"step-1/data/{a}/r00000-0000.bin.bak",
            "notes/step-000000000002/readme",
            "other-run/step-000000000002/manifest.msgpack",
            f"other-run/step-000000000002/data/{a}/r00000-0000.bin",
        ]
    )


@dataclass
class Layout:
    """What a generated run holds, every key labelled by the generator (run-relative). A step
    ``None`` is a checkpoint at the root itself."""

    complete: set = field(default_factory=set)
    owned: dict = field(default_factory=dict)
    owned_uploads: dict = field(default_factory=dict)
    foreign: set[str] = field(default_factory=set)
    foreign_uploads: set[tuple[str, str]] = field(default_factory=set)

    @property
    def steps(self) -> list[int]:
        return sorted(self.owned)


def _collides(key: str, taken: set[str]) -> bool:
    """On a filesystem a key cannot also be a folder of other keys."""
    parts = key.split("/")
    dirs = {"/".join(parts[:i]) for i in range(1, len(parts))}
    return key in taken or bool(dirs & taken) or any(t.startswith(key + "/") for t in taken)


class _Writer:
    def __init__(self, rng: random.Random, raw: Raw):
        self.rng, self.raw, self.taken = rng, raw, set()

    def put(self, key: str, bucket: set) -> None:
        if not _collides(key, self.taken):
            self.taken.add(key)
            self.raw.put(key, self.rng.randbytes(self.rng.randint(0, 40)))
            bucket.add(key)

    def upload(self, key: str, bucket: set) -> None:
        if not _collides(key, self.taken - {key}):
            bucket.add((key, self.raw.start_upload(key)))


def _checkpoint(w: _Writer, layout: Layout, step, complete: bool) -> None:
    """Owned objects and uploads of 1-2 attempts, a manifest when ``complete``, maybe an upload of
    the manifest's key, and foreign keys and uploads, under step ``step`` (None: the root)."""
    rng = w.rng
    base = "" if step is None else step_dir(step)
    owned = layout.owned.setdefault(step, set())
    uploads = layout.owned_uploads.setdefault(step, set())
    attempts = [_attempt(rng) for _ in range(rng.randint(1, 2))]
    for i, a in enumerate(attempts):
        for _ in range(rng.randint(0 if i else 1, 3)):
            rank = rng.choice([0, 1, 3, 99999, 123456])
            n = rng.choice([0, 1, 2, 9999, 10000])
            w.put(base + data_key(a, rank, n), owned)
    if complete:
        w.put(base + MANIFEST_KEY, owned)
        layout.complete.add(step)
    for _ in range(rng.randint(0, 2)):
        w.upload(
            base + data_key(rng.choice(attempts), rng.randint(0, 4), rng.randint(0, 5)), uploads
        )
    if rng.random() < 0.3:
        w.upload(base + MANIFEST_KEY, uploads)
    foreign, foreign_uploads = set(), set()
    for _ in range(rng.randint(1, 4)):
        w.put(base + _foreign_in_step(rng, rng.choice(attempts)), foreign)
    if rng.random() < 0.5:
        w.upload(base + _foreign_in_step(rng, rng.choice(attempts)), foreign_uploads)
    # the generator's labels agree with the layout's predicate
    assert all(owned_key(k[len(base) :]) for k in owned | {k for k, _ in uploads})
    assert not any(owned_key(k[len(base) :]) for k in foreign | {k for k, _ in foreign_uploads})
    layout.foreign |= foreign
    layout.foreign_uploads |= foreign_uploads


def generate(rng: random.Random, raw: Raw, *, steps=None) -> Layout:
    """A run at ``raw``: 1-4 random steps, complete or not (or exactly ``steps``, a dict
    {step: complete}; step None is a checkpoint at the root), see :func:`_checkpoint`, and
    foreign keys at the run level."""
    layout, w = Layout(), _Writer(rng, raw)
    if steps is None:
        steps = {s: rng.random() < 0.6 for s in rng.sample(range(1, 40), rng.randint(1, 4))}
    for step, complete in steps.items():
        _checkpoint(w, layout, step, complete)
    if None not in steps:
        for _ in range(rng.randint(0, 2)):
            w.put(_foreign_in_run(rng, _attempt(rng)), layout.foreign)
    return layout


def expect_gone(before, after, layout: Layout, steps) -> None:
    """``after`` is ``before`` less exactly the owned objects and uploads of ``steps``."""
    objects, uploads = before
    gone = set().union(set(), *(layout.owned[s] for s in steps))
    gone_uploads = set().union(set(), *(layout.owned_uploads[s] for s in steps))
    assert set(after[0]) == set(objects) - gone, (
        sorted(set(objects) - gone - set(after[0])),
        sorted(set(after[0]) - set(objects)),
    )
    assert {k: objects[k] for k in after[0]} == after[0]  # nothing rewritten either
    assert after[1] == uploads - gone_uploads
    assert layout.foreign <= set(after[0]) and layout.foreign_uploads <= after[1]


def diff(before, after) -> tuple[set[str], set[tuple[str, str]]]:
    return set(before[0]) - set(after[0]), before[1] - after[1]


def plan_keys(plans) -> tuple[set[str], set[tuple[str, str]]]:
    objects, uploads = set(), set()
    for plan in plans:
        objects |= set(plan.objects)
        uploads |= {(u.key, u.upload_id) for u in plan.uploads}
    return objects, uploads


def listed_keys(stdout: str, url: str) -> tuple[set[str], set[tuple[str, str]]]:
    """The keys a dry run printed (indented lines), relative to ``url``."""
    root = url.rstrip("/") + "/"
    objects, uploads = set(), set()
    for line in stdout.splitlines():
        if not line.startswith("  "):
            continue
        words = line.split()
        if words[0] == "upload":
            assert words[1].startswith(root), line
            uploads.add((words[1][len(root) :], words[2]))
        else:
            assert len(words) == 1 and words[0].startswith(root), line
            objects.add(words[0][len(root) :])
    return objects, uploads


# -- fixtures --------------------------------------------------------------------------------------


@dataclass
class Target:
    kind: str
    base: str  # a fresh folder URL (no trailing slash)
    server: object  # the S3 server for boto3 and the CLI's environment, or None

    def url(self, name: str) -> str:
        return f"{self.base}/{name}"

    def raw(self, name: str) -> Raw:
        return Raw(self.url(name), self.server)


@pytest.fixture(params=["local", "s3"])
def target(request, tmp_path) -> Target:
    if request.param == "local":
        return Target("local", str(tmp_path / "area"), None)
    server = request.getfixturevalue("s3_env")
    return Target("s3", request.getfixturevalue("s3_url"), server)


# -- the layout's predicate (pure) -----------------------------------------------------------------


@settings(max_examples=500, deadline=None, derandomize=True)
@given(
    attempt=st.text("0123456789abcdef", min_size=16, max_size=16),
    rank=st.integers(0, 10**7),
    n=st.integers(0, 10**6),
)
def test_owned_key_accepts_every_data_key(attempt, rank, n):
    key = data_key(attempt, rank, n)
    assert owned_key(key) and data_key_attempt(key) == attempt


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(
    key=st.one_of(
        st.text(st.sampled_from("data/0123456789abcdefr-.binAF\n_"), max_size=48),
        st.builds(
            lambda a, r, n, junk, where: (
                (f"data/{a}/r{r}-{n}.bin")[:where] + junk + (f"data/{a}/r{r}-{n}.bin")[where:]
            ),
            st.text("0123456789abcdef", min_size=16, max_size=16),
            st.integers(0, 10**6).map(lambda r: f"{r:05d}"),
            st.integers(0, 10**5).map(lambda n: f"{n:04d}"),
            st.text(min_size=1, max_size=3),
            st.integers(0, 40),
        ),
    )
)
def test_owned_key_accepts_nothing_else(key):
    """A key is owned iff it is the manifest, exactly what ``data_key`` writes or a pin
    (``pin_key``: ``pins/<attempt>.<folder>``)."""
    m = re.fullmatch(r"data/([0-9a-f]{16})/r([0-9]+)-([0-9]+)\.bin", key)
    canonical = m is not None and data_key(m[1], int(m[2]), int(m[3])) == key
    assert owned_key(key) == (key == MANIFEST_KEY or canonical or parse_pin_key(key) is not None)


# -- generated layouts through the Python entry points --------------------------------------------


def test_generated_layouts_python_api(target, figures):
    """For each generated run: ``plan_delete`` then ``delete`` of one step, then ``prune_plans``
    (dry run) and ``prune`` with keep_last=1 and abandoned_after=0. Each removes exactly the owned
    keys of the checkpoints it names and lists them exactly beforehand."""
    for case in range(API_CASES[target.kind]):
        rng = random.Random(1300 + case)
        name = f"api{case}"
        raw = target.raw(name)
        layout = generate(rng, raw)
        mgr = CheckpointManager(target.url(name))
        victim = rng.choice(layout.steps)
        before = raw.snapshot()
        planned = plan_keys([mgr.plan_delete(victim)])
        assert raw.snapshot() == before  # planning removes nothing
        removed = mgr.delete(victim)
        after = raw.snapshot()
        expect_gone(before, after, layout, [victim])
        assert planned == diff(before, after) and removed == len(planned[0])

        eager = CheckpointManager(target.url(name), keep_last=1, abandoned_after=0)
        rest = [s for s in layout.steps if s != victim]
        complete = sorted(set(rest) & layout.complete)
        doomed = set(complete[:-1]) | {
            s
            for s in rest
            if s not in layout.complete and (layout.owned[s] or layout.owned_uploads[s])
        }
        dry = eager.prune_plans(dry_run=True)
        assert raw.snapshot() == after
        assert {i.step for i, _ in dry} == doomed, case
        pruned = eager.prune()
        final = raw.snapshot()
        assert sorted(i.step for i in pruned) == sorted(doomed)
        expect_gone(after, final, layout, doomed)
        assert plan_keys(p for _, p in dry) == diff(after, final)
        figures.add(f"deletion: generated runs ({target.kind}, Python API)")
        figures.add(
            "deletion: foreign keys and uploads checked after a deletion",
            2 * (len(layout.foreign) + len(layout.foreign_uploads)),
        )


def test_after_save_cleanup_removes_only_stale_attempts(target, figures):
    """A save at a step that holds killed attempts (objects, uploads, a manifest upload) and
    foreign keys: the clean-up after the commit removes the killed attempts' owned keys only."""
    cases = 4 if target.kind == "local" else 2
    for case in range(cases):
        rng = random.Random(2600 + case)
        name = f"resave{case}"
        raw = target.raw(name)
        layout = generate(rng, raw, steps={7: False, 8: True})
        before = raw.snapshot()
        mgr = CheckpointManager(target.url(name))
        mgr.save(7, {"w": torch.arange(64, dtype=torch.float32), "case": case})
        after = raw.snapshot()
        new = set(after[0]) - set(before[0])
        assert new and all(
            k.startswith(step_dir(7)) and owned_key(k[len(step_dir(7)) :]) for k in new
        ), new
        kept = {k: v for k, v in after[0].items() if k not in new}
        expect_gone(before, (kept, after[1]), layout, [7])
        sd = {"w": torch.zeros(64), "case": -1}
        assert mgr.load(sd, step=7) == 7 and sd["case"] == case
        figures.add(f"deletion: saves over killed attempts and foreign keys ({target.kind})")


# -- generated layouts through the CLI ------------------------------------------------------------


def _cli(target: Target, *args):
    res = cli(target.server, *args)
    assert "Traceback" not in res.stderr, res.stderr
    return res


def test_generated_layouts_cli(target, figures):
    """``rm RUN --step N``, ``rm RUN/step-N``, ``prune`` and ``rm CHECKPOINT`` (a checkpoint
    that is not a step of a run), each as ``--dry-run`` then for real: the dry run lists exactly
    the objects and uploads the real command removes, and those are exactly the owned keys."""
    for case in range(CLI_CASES[target.kind]):
        rng = random.Random(3900 + case)
        name = f"cli{case}"
        raw, url = target.raw(name), target.url(name)
        layout = generate(rng, raw, steps={3: True, 5: False, 9: True, 11: True})
        runs = [("--step", 3), ("url", 5), ("prune", None)]
        for how, step in runs:
            if how == "--step":
                args = ["rm", url, "--step", str(step)]
            elif how == "url":
                args = ["rm", f"{url}/{step_dir(step)}"]
            else:
                args = ["prune", url, "--keep-last", "1", "--abandoned-after", "0"]
            before = raw.snapshot()
            dry = _cli(target, *args, "--dry-run")
            assert dry.returncode == 0, dry.stderr
            assert raw.snapshot() == before
            real = _cli(target, *args)
            assert real.returncode == 0, real.stderr
            after = raw.snapshot()
            steps = [step] if step is not None else [9]
            expect_gone(before, after, layout, steps)
            assert listed_keys(dry.stdout, url) == diff(before, after), (args, dry.stdout)
            if any(k.startswith(step_dir(s)) for s in steps for k in layout.foreign):
                assert "left" in real.stderr and "not part of a checkpoint" in real.stderr
        # a checkpoint that is no step of a run: its root holds the layout directly
        ck_raw, ck_url = target.raw(f"{name}-ckpt"), target.url(f"{name}-ckpt")
        ck = generate(rng, ck_raw, steps={None: case % 2 == 0})
        before = ck_raw.snapshot()
        dry = _cli(target, "rm", ck_url, "--dry-run")
        assert dry.returncode == 0 and ck_raw.snapshot() == before, dry.stderr
        real = _cli(target, "rm", ck_url)
        assert real.returncode == 0, real.stderr
        after = ck_raw.snapshot()
        expect_gone(before, after, ck, [None])
        assert listed_keys(dry.stdout, ck_url) == diff(before, after)
        figures.add(f"deletion: generated runs ({target.kind}, CLI rm and prune, dry and real)")


# -- refusals --------------------------------------------------------------------------------------


def test_rm_refuses_what_is_neither_a_checkpoint_nor_a_run(target, figures):
    """A folder of runs and other files, a folder of other files, a checkpoint's ``data/``
    folder: refused in one line, exit 2, nothing removed (with ``--dry-run`` too). A run is
    refused as a run (exit 2); a URL with nothing there is "nothing to remove" (exit 1)."""
    rng = random.Random(5200)
    raw = target.raw("exp")
    for run in ("run-a", "run-b"):
        generate(rng, Raw(target.url(f"exp/{run}"), target.server), steps={1: True, 2: False})
    for key in ("notes.txt", "misc/plot.png", "misc/data/readme"):
        raw.put(key)
    before = raw.snapshot()
    attempt = next(k for k in before[0] if k.startswith("run-a/step-000000000001/data/"))
    cases = [  # (URL under exp, extra args, status, text in stderr)
        ("", (), 2, "neither a checkpoint nor a run"),
        ("", ("--dry-run",), 2, "neither a checkpoint nor a run"),
        ("misc", (), 2, "neither a checkpoint nor a run"),
        (attempt.rsplit("/", 2)[0], (), 2, "neither a checkpoint nor a run"),
        ("run-a", (), 2, "is a run with 2 checkpoints,"),
        ("run-a", ("--dry-run",), 2, "is a run"),
        ("nothing-here", (), 1, "nothing to remove"),
    ]
    for where, extra, status, text in cases:
        url = target.url(f"exp/{where}".rstrip("/"))
        res = _cli(target, "rm", url, *extra)
        assert res.returncode == status, (where, extra, res.stdout, res.stderr)
        assert text in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stdout == ""
        assert raw.snapshot() == before, (where, extra)
        figures.add(f"deletion: rm refusals ({target.kind})")


def test_rm_of_an_incomplete_checkpoint_removes_its_owned_keys(target):
    """After a crash: a step with data objects and uploads but no manifest is deletable with
    ``rm``; its foreign keys stay and a line on stderr names them."""
    raw = target.raw("run")
    layout = generate(random.Random(6100), raw, steps={4: False, 6: True})
    raw.put(step_dir(4) + "NOTES")
    layout.foreign.add(step_dir(4) + "NOTES")
    before = raw.snapshot()
    res = _cli(target, "rm", target.url("run"), "--step", "4")
    assert res.returncode == 0, res.stderr
    assert "incomplete checkpoint" in res.stdout
    assert "left" in res.stderr and "NOTES" in res.stderr
    expect_gone(before, raw.snapshot(), layout, [4])
    assert [(i.step, i.complete) for i in CheckpointManager(target.url("run")).list()][-1] == (
        6,
        True,
    )


def test_step_folder_symlinked_out_of_the_run_is_refused(tmp_path, figures):
    """``rm RUN --step N``, ``rm RUN/step-N`` (with and without ``--dry-run``),
    ``CheckpointManager.delete`` / ``plan_delete`` and ``prune`` on a run whose step folder is a
    symlink to a folder outside it (holding a sentinel and files named like a checkpoint's):
    refused with ``AccessDenied`` (CLI exit 2, one line), nothing removed anywhere."""
    outside = tmp_path / "outside"
    for key in ("sentinel", MANIFEST_KEY, data_key("0123456789abcdef", 0, 0)):
        (outside / key).parent.mkdir(parents=True, exist_ok=True)
        (outside / key).write_bytes(b"precious " + key.encode())
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run))
    mgr.save(1, {"w": torch.ones(4)})
    os.symlink(outside, run / step_dir(5).rstrip("/"))
    out_before = Raw(str(outside)).snapshot()
    run_before = Raw(str(run)).snapshot()
    target = Target("local", str(tmp_path), None)
    for args in (["--step", "5"], ["--step", "5", "--dry-run"]):
        res = _cli(target, "rm", str(run), *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert "symlink" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    for url in (str(run / step_dir(5)), f"file://{run}/{step_dir(5)}"):
        res = _cli(target, "rm", url)
        assert res.returncode == 2 and "symlink" in res.stderr, (url, res.stderr)
    with pytest.raises(AccessDenied):
        mgr.delete(5)
    with pytest.raises(AccessDenied):
        mgr.plan_delete(5)
    assert CheckpointManager(str(run), keep_last=1, abandoned_after=0).prune() == []
    res = _cli(target, "prune", str(run), "--keep-last", "1", "--abandoned-after", "0")
    assert res.returncode == 0 and "nothing to remove" in res.stdout, res.stderr
    assert Raw(str(outside)).snapshot() == out_before
    assert Raw(str(run)).snapshot() == run_before
    assert (outside / "sentinel").read_bytes() == b"precious sentinel"
    figures.add("deletion: symlinked step folders refused")
